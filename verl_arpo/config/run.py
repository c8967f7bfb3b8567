"""The sections around the model: `data`, `algorithm`, `reward_model`, `custom_reward_function`,
`ray_init` and `trainer`.

Field defaults equal configs/ppo_trainer.yaml (tests/trainer/test_job_config.py keeps them equal).
Each section's `problems(where)` returns the value rules of its own keys; the rules that read
several sections live in `JobConfig.problems` (config/__init__.py).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from verl_arpo.config.typed import Problems
from verl_arpo.config.training import KLPenalty
from verl_arpo.utils.resources import resolve_bundled
from verl_arpo.utils.tracking import LOGGER_BACKENDS, parse_logger

Truncation = Literal["error", "left", "right"]
Device = Literal["auto", "cuda", "cpu"]
ResumeMode = Literal["auto", "disable", "resume_path"]
KLCtrlType = Literal["fixed", "adaptive"]
RolloutISLevel = Literal["token", "sequence"]
RolloutISMode = Literal["truncate"]
VERL_LOGGERS_NOT_SUPPORTED = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


@dataclass(frozen=True)
class DataConfig:
    tokenizer: str | None = None
    train_files: Any = "rl_datasets/train.parquet"
    val_files: Any = "rl_datasets/valid.parquet"
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 1536
    max_response_length: int = 4096
    train_batch_size: int = 128
    val_batch_size: int | None = None
    return_raw_input_ids: bool = False
    return_raw_chat: bool = True
    shuffle: bool = True
    seed: int = 1
    stratify_by: str | None = None
    filter_overlong_prompts: bool = True
    truncation: Truncation = "error"
    dataloader_num_workers: int = 0
    system_prompt_override: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    custom_chat_template: str | None = None

    def problems(self, where: str) -> Problems:
        out = []
        for leaf, what in (("train_batch_size", "prompts per step"), ("max_prompt_length", "tokens"),
                           ("max_response_length", "tokens")):
            if getattr(self, leaf) < 1:
                out.append((f"{where}.{leaf}", f"must be an integer >= 1 ({what})"))
        for leaf, required in (("train_files", True), ("val_files", False)):
            value = getattr(self, leaf)
            if required and not value:
                out.append((f"{where}.{leaf}", "is required: give a parquet file or a list of files"))
                continue
            for f in _files(value):
                if not resolve_bundled(f).is_file():  # the cwd, then the bundled task
                    out.append((f"{where}.{leaf}", f"no such file {f!r}"))
        return out


@dataclass(frozen=True)
class RewardModelConfig:
    enable: Literal[False] = field(default=False, metadata={
        "hint": "model-based rewards are not supported: set it to false (rule-based scorers)"})
    reward_manager: str = "naive"
    launch_reward_fn_async: bool = False
    num_workers: int | None = None
    parallel_threshold: int = 256
    score_timeout: float | None = 600.0


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: dict = field(default_factory=dict)

    def problems(self, where: str) -> Problems:
        if not self.path:
            return []
        p = resolve_bundled(self.path)
        if not p.is_file():
            return [(f"{where}.path", f"no such file {self.path!r}: give a .py file, or null for the built-in scorers "
                     "chosen by data_source")]
        if p.suffix != ".py":
            return [(f"{where}.path", f"{self.path!r} is not a Python (.py) file")]
        # import it now (the driver would, after Ray is up): a broken file fails here
        from verl_arpo.utils.reward_score.custom import load_custom_reward_function

        try:
            load_custom_reward_function(str(p), self.name or "compute_score")
        except Exception as exc:  # noqa: BLE001 - any error of the user's file is a config problem
            leaf = "name" if isinstance(exc, AttributeError) else "path"
            return [(f"{where}.{leaf}", f"{type(exc).__name__}: {exc}")]
        return []


@dataclass(frozen=True)
class KLCtrlConfig:
    type: KLCtrlType = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "grpo"  # a name in algos.core_algos.ADV_ESTIMATOR_REGISTRY (checked by trainer.config.validate_config)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: KLPenalty = "kl"
    rollout_is_threshold: float | None = None
    rollout_is: bool = False
    rollout_is_level: RolloutISLevel = "token"
    rollout_is_mode: RolloutISMode = field(default="truncate", metadata={
        "hint": "verl's mask mode, which changes the loss denominator, is not implemented"})
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)

    def problems(self, where: str) -> Problems:
        out = []
        cap = self.rollout_is_threshold
        if cap is not None and cap <= 0:
            out.append((f"{where}.rollout_is_threshold", "must be null (off) or a number > 0 (e.g. 2.0)"))
        if self.rollout_is and cap is None:
            out.append((f"{where}.rollout_is", "needs algorithm.rollout_is_threshold (the weight cap, e.g. 2.0)"))
        return out


DEFAULT_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}
"""Environment of the driver and of every Ray worker; ray_init.runtime_env.env_vars override it."""


class WorkerEnv(NamedTuple):
    """The workers' environment variables, split where they go (trainer/main_ppo.py, ray_trainer.py):
    `public` into Ray's runtime_env (which Ray's agent writes into its log), `secrets` (credential-named
    ones, utils/secrets.py) into the driver's environment and, by a method call, each worker's."""

    public: dict[str, str]
    secrets: dict[str, str]


@dataclass(frozen=True)
class RayInitConfig:
    address: str | None = None
    num_cpus: int | None = None
    runtime_env: dict = field(default_factory=lambda: {"env_vars": {}})
    """Ray's runtime_env, free-form (working_dir, pip, ...), but for `env_vars`: a mapping of names
    to a string, a number or true/false, checked here and split once (`worker_env`)."""
    include_dashboard: bool = False

    def problems(self, where: str) -> Problems:
        out = []
        if self.num_cpus is not None and self.num_cpus < 1:
            out.append((f"{where}.num_cpus", "must be null (all CPUs) or an integer >= 1"))
        env = (self.runtime_env or {}).get("env_vars")
        if env is not None and not isinstance(env, Mapping):
            out.append((f"{where}.runtime_env.env_vars", f"must be a mapping of NAME: value, got {type(env).__name__}"))
        elif env:
            out += [(f"{where}.runtime_env.env_vars.{k}", f"must be a string, a number or true/false (an environment "
                     f"variable's value), got {type(v).__name__}")
                    for k, v in env.items() if v is None or not isinstance(v, (str, int, float, bool))]
        return out

    @functools.cached_property
    def worker_env(self) -> WorkerEnv:
        """DEFAULT_RAY_ENV overridden by runtime_env.env_vars, as strings (true/false lower-case),
        split into what Ray may log and the credentials that must stay out of its logs."""
        from verl_arpo.utils.secrets import secret_env_vars

        merged = {**DEFAULT_RAY_ENV, **((self.runtime_env or {}).get("env_vars") or {})}
        merged = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in merged.items()}
        secrets = secret_env_vars(merged)
        return WorkerEnv({k: v for k, v in merged.items() if k not in secrets}, secrets)


@dataclass(frozen=True)
class TrainerConfig:
    balance_batch: bool = True
    total_epochs: int = 1
    total_training_steps: int | None = None
    project_name: str = "verl_arpo"
    experiment_name: str = "default"
    logger: tuple | str = ("console",)  # a list, or the seeds' "[console, wandb]" / "console,wandb" text
    log_val_generations: int = 0
    nnodes: int = 1
    n_gpus_per_node: int = 8
    device: Device = "auto"
    save_freq: int = -1
    resume_mode: ResumeMode = "auto"
    resume_from_path: str | None = None
    test_freq: int = -1
    val_before_train: bool = True
    critic_warmup: int = 0
    default_hdfs_dir: str | None = None
    default_local_dir: str = "checkpoints/verl_arpo/default"
    max_actor_ckpt_to_keep: int | None = None
    max_critic_ckpt_to_keep: int | None = None
    rollout_data_dir: str | None = None
    validation_data_dir: str | None = None
    seed: int = 0
    max_consecutive_skipped_steps: int = 3
    worker_call_timeout: float | None = 7200.0
    single_process: bool = False
    """Run the one worker in the driver's process, without Ray (docs/performance.md, "One process on a
    laptop"): nnodes = n_gpus_per_node = 1 and no ray_init cluster settings."""
    preemption_grace_s: float | None = 30.0
    val_only: bool = False
    force_resume: bool = False

    @property
    def loggers(self) -> list[str]:
        """trainer.logger as a list of backend names, whichever form it was written in."""
        return parse_logger(self.logger)

    def problems(self, where: str) -> Problems:
        out = []
        backends = self.loggers
        unknown = [b for b in backends if b not in LOGGER_BACKENDS]
        verl_only = [b for b in unknown if b in VERL_LOGGERS_NOT_SUPPORTED]
        if verl_only:
            out.append((f"{where}.logger", f"{verl_only} are verl loggers this trainer does not ship; use wandb or "
                        "tensorboard (the same scalars), or jsonl for a local file; accepted: "
                        f"{list(LOGGER_BACKENDS)}"))
        elif unknown:
            out.append((f"{where}.logger", f"unknown backend(s) {unknown}; accepted: {list(LOGGER_BACKENDS)}"))
        for backend in ("wandb", "tensorboard"):
            if backend in backends and importlib.util.find_spec(backend) is None:
                out.append((f"{where}.logger", f"{backend} is not installed: pip install 'verl_arpo[{backend}]', or "
                            f"remove {backend} from trainer.logger"))
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            out.append((f"{where}.resume_from_path", "resume_mode=resume_path needs resume_from_path (a global_step_N "
                        "folder)"))
        if self.log_val_generations < 0:
            out.append((f"{where}.log_val_generations", "must be an integer >= 0 (validation samples logged per "
                        "validation)"))
        if self.total_training_steps is not None and self.total_training_steps < 1:
            out.append((f"{where}.total_training_steps", "must be null or an integer >= 1"))
        if self.nnodes < 1:
            out.append((f"{where}.nnodes", "must be an integer >= 1"))
        if self.n_gpus_per_node < 1:
            out.append((f"{where}.n_gpus_per_node", "must be an integer >= 1 (workers per node: GPUs, or CPU "
                        "processes)"))
        if self.single_process and (self.nnodes != 1 or self.n_gpus_per_node != 1):
            out.append((f"{where}.single_process", f"runs one worker in the driver's process, but nnodes="
                        f"{self.nnodes} x n_gpus_per_node={self.n_gpus_per_node} asks for more: set "
                        "trainer.nnodes=1 trainer.n_gpus_per_node=1, or trainer.single_process=false (Ray workers)"))
        return out
