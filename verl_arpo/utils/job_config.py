"""The typed trainer configuration: one frozen dataclass per section of configs/ppo_trainer.yaml.

The YAML stays the user-facing reference (Hydra composes it with the presets and the command line;
`--cfg job` prints it; docs/configuration.md is generated from its comments). After validation
(verl_arpo.trainer.config) the composed tree is turned into a `JobConfig` once, by
`JobConfig.from_mapping`, and that object is what the trainer reads and ships to the workers: no
`.get(key, default)` in the code that uses it, so a default lives in exactly two places that a
test keeps equal — the YAML and the dataclass field below.

    JobConfig
      data               DataConfig
      actor_rollout_ref  ActorRolloutRefConfig: model, actor (optim, fsdp_config, ...), ref, rollout
      critic             CriticConfig
      reward_model, custom_reward_function, algorithm, ray_init, trainer

Values that are *derived* from several keys are computed once, here, and named (`JobConfig.derived`):
world size, whether a KL term is active, whether the reference model and the critic are needed,
whether the update is strictly on-policy, and each worker's batch sizes (`Batching`: verl's
`ppo_mini_batch_size` counts prompts, a worker runs trajectories). User keys are never rewritten.

A key the code does not read yet is listed in `NOT_IMPLEMENTED` with what to use instead; a
non-default value there is a configuration error (`not_implemented_problems`), never silently
ignored. Unknown keys fail with the key named (Hydra's struct mode does this first on the command
line; `from_mapping` does it for any other mapping).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any
from collections.abc import Mapping

__all__ = ["ConfigError", "JobConfig", "Derived", "Batching", "DataConfig", "ModelConfig", "ActorConfig", "RefConfig",
           "RolloutSection", "CriticConfig", "ToolsConfig", "AlgorithmConfig", "TrainerConfig", "OptimConfig", "FSDPConfig",
           "from_mapping", "NOT_IMPLEMENTED", "not_implemented_problems", "kl_term_active"]


class ConfigError(ValueError):
    """A config with one or more bad values; `.problems` lists (key, message) pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        lines = [f"  - {key}: {msg}" for key, msg in self.problems]
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n" + "\n".join(lines))


def kl_term_active(enabled: Any, coef: Any) -> bool:
    """A KL term (the actor's KL loss, or the in-reward KL) counts only when it is switched on *and*
    its weight is non-zero: `use_kl_loss=true, kl_loss_coef=0` (as in the seeds' scripts) is off,
    so no reference forward runs and no `ref_log_prob` is needed (docs/algorithms.md, "The policy
    loss shared by all of them"). The one definition the config normalisation and the actor use."""
    try:
        weight = float(coef)
    except (TypeError, ValueError):
        return False
    return bool(enabled) and weight != 0.0 and weight == weight


# ------------------------------------------------------------------------------------------------
# sections (field defaults = configs/ppo_trainer.yaml; tests/trainer/test_job_config.py keeps them equal)
# ------------------------------------------------------------------------------------------------
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
    truncation: str = "error"
    dataloader_num_workers: int = 0
    system_prompt_override: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    custom_chat_template: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # ??? in the YAML: required
    external_lib: str | None = None
    override_config: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    use_prefix_sharing: bool = False
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    warmup_style: str = "constant"
    total_training_steps: int = -1
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.999)


MODEL_DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16")
"""Accepted values of fsdp_config.model_dtype besides null (training_core.model_dtype)."""


def resolve_model_dtype(value: str | None, trained: bool, device_type: str) -> str:
    """"float32" or "bfloat16": the dtype a model's weights are loaded in (`fsdp_config.model_dtype`,
    verl's key). null: fp32 for a trained model (actor, critic: the optimizer's master weights); for
    the frozen reference bf16 on CUDA, as verl loads it (half the memory and half the init broadcast;
    it computes in bf16 there anyway), and fp32 on the CPU, where bf16 is emulated on most machines
    (docs/performance.md, "Precision on the CPU")."""
    if value is not None:
        if value not in MODEL_DTYPE_NAMES:
            raise ValueError(f"fsdp_config.model_dtype={value!r}: choose one of {sorted(MODEL_DTYPE_NAMES)} or null")
        return "bfloat16" if value.startswith("b") else "float32"
    return "bfloat16" if not trained and device_type == "cuda" else "float32"


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    fsdp_size: int = -1
    mixed_precision: dict | None = None
    model_dtype: str | None = None  # the weights' dtype as loaded (training_core.model_dtype)


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = "vanilla"


@dataclass(frozen=True)
class CheckpointConfig:
    contents: tuple = ("model", "optimizer", "extra")


@dataclass(frozen=True)
class ActorConfig:
    strategy: str = "fsdp"
    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 2
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    grad_clip: float | None = 1.0
    max_grad_norm: float | None = None
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    skip_old_log_prob_on_policy: bool = True
    shuffle: bool = False
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    enable_entropy_balanced_clipping: bool = False
    enable_entropy_balanced_advantage: bool = False
    entropy_advantage_alpha: float = 0.2
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    @property
    def clip_norm(self) -> float | None:
        """The gradient-norm clip: `max_grad_norm` (verl's alias) when set, else `grad_clip`."""
        return self.max_grad_norm if self.max_grad_norm is not None else self.grad_clip


@dataclass(frozen=True)
class RefFSDPConfig:
    param_offload: bool = False
    reshard_after_forward: bool = True
    mixed_precision: dict | None = None
    model_dtype: str | None = None  # null: bf16 on GPU (as verl), fp32 on CPU (training_core.model_dtype)


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)


@dataclass(frozen=True)
class MultiTurnConfig:
    enable: bool = True


@dataclass(frozen=True)
class ValKwargs:
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass(frozen=True)
class ToolsConfig:
    """`actor_rollout_ref.rollout.tools`, also the root of a tool YAML file (configs/tools/*.yaml) read by
    the tool registry; `tool_instances` maps a tool name to {class_path, params} (free-form params:
    each tool class checks its own, see docs/tools.md)."""

    call_limit: int = 3
    """maximum tool calls per trajectory (the rollout enforces it)"""
    max_workers: int = 64
    """tool calls running at the same time"""
    timeout: float = 120
    """wall-clock seconds for one call, retries and backoff included"""
    retry_count: int = 3
    """extra attempts after an exception or an empty result"""
    retry_backoff: float = 0.5
    """seconds before the first retry; doubles each time"""
    verbose_logging: bool = False
    """log every call (tag, seconds, ok)"""
    fail_on_error: bool = True
    """raise when a tool fails to load instead of skipping it with a warning"""
    tool_instances: dict = field(default_factory=lambda: {
        "python": {"class_path": "verl_arpo.workers.rollout.tools.python_tool.PythonTool",
                   "params": {"timeout": 20, "sandbox": "auto", "conda_path": None, "conda_env": None}},
        "search": {"class_path": "verl_arpo.workers.rollout.tools.local_search_tool.LocalSearchTool",
                   "params": {"cache_file": "search_cache/local_search_cache.sqlite", "max_results": 3,
                              "result_length": 500, "api_key": None, "zone": None, "location": "us"}}})


# rollout.mode: rounds with barriers (agent_loop.py) or none (async_agent_loop.py)
ROLLOUT_MODES = ("sync_with_tool", "async_with_tool")

@dataclass(frozen=True)
class RolloutSection:
    """`actor_rollout_ref.rollout` as written; the agent loop reads it as it is."""

    name: str = "hf"
    mode: str = "sync_with_tool"  # one of ROLLOUT_MODES
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    prompt_length: int = 1536
    response_length: int = 4096
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = True
    free_cache_engine: bool = True
    load_format: str = "auto"
    tensor_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    enable_prefix_caching: bool = True
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    do_sample: bool = True
    n: int = 1
    initial_rollouts: int | None = None
    beam_size: int = 2
    branch_rule: str = "arpo"
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    entropy_mode: str = "topk_proxy"
    entropy_window: int = 20
    entropy_topk: int = 10
    enable_dynamic_rollouts: bool = False
    dynamic_rollout_beta: float = 0.5
    branch_penalty_gamma: float = 0.05
    initial_entropy_tokens: int = 50
    max_rounds: int | None = None
    seed: int = 0
    seed_requests: bool = True
    calculate_log_probs: bool = True
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)


@dataclass(frozen=True)
class CriticModelConfig:
    path: str | None = None  # ${actor_rollout_ref.model.path}
    tokenizer_path: str | None = None  # ${actor_rollout_ref.model.path}
    override_config: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass(frozen=True)
class CriticConfig:
    strategy: str = "fsdp"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 2
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ppo_epochs: int = 1
    shuffle: bool = False
    grad_clip: float | None = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = False
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


@dataclass(frozen=True)
class KLCtrlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass(frozen=True)
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    rollout_is_threshold: float | None = None
    rollout_is: bool = False
    rollout_is_level: str = "token"
    rollout_is_mode: str = "truncate"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)


@dataclass(frozen=True)
class RayInitConfig:
    address: str | None = None
    num_cpus: int | None = None
    runtime_env: dict = field(default_factory=lambda: {"env_vars": {}})
    include_dashboard: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    balance_batch: bool = True
    total_epochs: int = 1
    total_training_steps: int | None = None
    project_name: str = "verl_arpo"
    experiment_name: str = "default"
    logger: tuple = ("console",)
    log_val_generations: int = 0
    nnodes: int = 1
    n_gpus_per_node: int = 8
    device: str = "auto"
    save_freq: int = -1
    resume_mode: str = "auto"
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
    preemption_grace_s: float | None = 30.0
    val_only: bool = False
    force_resume: bool = False


@dataclass(frozen=True)
class Batching:
    """How one worker splits its share of a batch into forward (and backward) passes, in trajectories
    per worker: verl's user keys count prompts (`ppo_mini_batch_size`) or all workers (the deprecated
    global micro sizes); these are what a worker runs. Built by `JobConfig.derived`, nowhere else."""

    micro_batch: int
    """trajectories per forward without dynamic batch sizes."""
    use_dynamic_bsz: bool
    """micro-batches by token budget instead of by count."""
    max_token_len: int
    """the token budget of a micro-batch with use_dynamic_bsz."""
    mini_batch: int | None = None
    """trajectories per optimizer step on this worker (updates only)."""

    @classmethod
    def for_update(cls, section: "ActorConfig | CriticConfig", n: int, world: int) -> "Batching":
        """An actor's or critic's update: ppo_mini_batch_size prompts × n ÷ world trajectories per step."""
        return cls(_micro_per_worker(section.ppo_micro_batch_size, section.ppo_micro_batch_size_per_gpu, world),
                   bool(section.use_dynamic_bsz), int(section.ppo_max_token_len_per_gpu),
                   mini_batch=int(section.ppo_mini_batch_size) * int(n) // int(world))

    @classmethod
    def for_log_prob(cls, section: "RolloutSection | RefConfig", world: int) -> "Batching":
        """A log-prob pass from its log_prob_* keys (rollout: the actor's old log-probs; ref)."""
        return cls(_micro_per_worker(section.log_prob_micro_batch_size, section.log_prob_micro_batch_size_per_gpu,
                                     world), bool(section.log_prob_use_dynamic_bsz), int(section.log_prob_max_token_len_per_gpu))

    @classmethod
    def for_values(cls, critic: "CriticConfig", world: int) -> "Batching":
        """The critic's value pass: its micro size, forward_max_token_len_per_gpu."""
        return cls(_micro_per_worker(critic.ppo_micro_batch_size, critic.ppo_micro_batch_size_per_gpu, world),
                   bool(critic.use_dynamic_bsz), int(critic.forward_max_token_len_per_gpu))


def _micro_per_worker(global_size: int | None, per_gpu: int, world: int) -> int:
    """verl's deprecated global micro batch (over all workers) wins when it is set."""
    return int(global_size) // world if global_size is not None else int(per_gpu)


@dataclass(frozen=True)
class Derived:
    """Facts that depend on several keys, computed once by `JobConfig.derived`: user keys keep the
    meaning they have in the YAML, and whatever a worker needs in other units is a field here."""

    world_size: int
    """trainer.nnodes × trainer.n_gpus_per_node: data-parallel workers."""
    kl_loss_active: bool
    """actor.use_kl_loss and kl_loss_coef ≠ 0 (core_algos.kl_term_active)."""
    kl_in_reward_active: bool
    """algorithm.use_kl_in_reward and kl_ctrl.kl_coef ≠ 0."""
    need_ref: bool
    """a reference model is built and run: an active KL loss or in-reward KL."""
    need_critic: bool
    """algorithm.adv_estimator == gae."""
    on_policy: bool
    """one epoch over one mini-batch and nothing else reading π_old: the update's own forward gives
    π_old (detached) and the separate old-log-prob pass is skipped."""
    actor_update: Batching
    """the actor's update: ppo_mini_batch_size prompts × rollout.n ÷ world per optimizer step."""
    actor_log_prob: Batching
    """the actor's old-log-prob pass (rollout.log_prob_*)."""
    ref_log_prob: Batching
    """the reference's log-prob pass (ref.log_prob_*)."""
    critic_update: Batching
    """the critic's update: critic.ppo_mini_batch_size prompts × rollout.n ÷ world per step."""
    critic_values: Batching
    """the critic's value pass (its micro size, forward_max_token_len_per_gpu)."""


@dataclass(frozen=True)
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @functools.cached_property
    def derived(self) -> Derived:
        a, algo, t = self.actor_rollout_ref.actor, self.algorithm, self.trainer
        world = int(t.nnodes) * int(t.n_gpus_per_node)
        kl_loss = kl_term_active(a.use_kl_loss, a.kl_loss_coef)
        kl_reward = kl_term_active(algo.use_kl_in_reward, algo.kl_ctrl.kl_coef)
        r, ref, c = self.actor_rollout_ref.rollout, self.actor_rollout_ref.ref, self.critic
        n = int(r.n)
        trajectories = int(self.data.train_batch_size) * n
        on_policy = (a.skip_old_log_prob_on_policy and a.ppo_epochs == 1 and a.ppo_mini_batch_size * n >= trajectories
                     and not kl_reward)
        return Derived(
            world_size=world, kl_loss_active=kl_loss, kl_in_reward_active=kl_reward,
            need_ref=kl_loss or kl_reward, need_critic=algo.adv_estimator == "gae", on_policy=on_policy,
            actor_update=Batching.for_update(a, n, world), actor_log_prob=Batching.for_log_prob(r, world),
            ref_log_prob=Batching.for_log_prob(ref, world), critic_update=Batching.for_update(c, n, world),
            critic_values=Batching.for_values(c, world))

    @classmethod
    def from_mapping(cls, data: Any) -> "JobConfig":
        """Build from a composed (resolved) OmegaConf tree or a plain mapping; unknown keys are errors."""
        return from_mapping(cls, _plain(data), "")


# ------------------------------------------------------------------------------------------------
# building
# ------------------------------------------------------------------------------------------------
def _plain(data: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a hard dependency
        return data
    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=True)
    return data


def _coerce(value: Any, typ: Any, key: str) -> Any:
    """Lists become tuples where the field is a tuple; numbers given as int/str become floats where
    the field is a float (YAML reads `1e-6` as a string)."""
    origin_args = typing.get_args(typ)
    base = {a for a in origin_args if a is not type(None)} if origin_args else {typ}
    if value is None:
        return None
    if tuple in base and isinstance(value, list):
        return tuple(value)
    if float in base and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            raise ConfigError([(key, f"must be a number, got {value!r}")]) from None
    return value


def from_mapping(cls: type, data: Mapping | Any, where: str) -> Any:
    """An instance of dataclass `cls` from `data` (a mapping, or already an instance): nested sections
    recursively, missing keys take the field default, an unknown key raises ConfigError naming it."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError([(where or "<root>", f"must be a section (a mapping), got {type(data).__name__}")])
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        raise ConfigError([(f"{where}.{k}".lstrip("."), f"unknown key; {cls.__name__} accepts {sorted(known)}")
                           for k in unknown])
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}".lstrip(".")
        typ = hints[name]
        kwargs[name] = from_mapping(typ, value, key) if is_dataclass(typ) else _coerce(value, typ, key)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    """A plain nested dict of a config dataclass (tuples stay tuples)."""
    return dataclasses.asdict(obj)


# ------------------------------------------------------------------------------------------------
# keys accepted for verl compatibility that no code reads yet
# ------------------------------------------------------------------------------------------------
NOT_IMPLEMENTED: dict[str, str] = {
    "data.return_raw_input_ids": "the raw prompt ids are not kept; the rollout reads the chat messages",
    "data.dataloader_num_workers": "batches are collated in the driver (no torch DataLoader workers)",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size": "FSDP2 shards over all ranks (1-D mesh); HSDP is not implemented",
    "critic.model.fsdp_config.fsdp_size": "FSDP2 shards over all ranks (1-D mesh); HSDP is not implemented",
    "actor_rollout_ref.rollout.ignore_eos": "generation always stops at EOS",
    "actor_rollout_ref.rollout.do_sample": "training rollouts always sample; greedy is for validation (val_kwargs.do_sample)",
    "reward_model.launch_reward_fn_async": "rewards are scored in the driver, in parallel processes (reward_model.num_workers)",
    "trainer.max_critic_ckpt_to_keep": "checkpoints are kept or dropped per step folder: use trainer.max_actor_ckpt_to_keep",
    "trainer.default_hdfs_dir": "no HDFS copy is made; checkpoints go to trainer.default_local_dir",
}
"""key → why it has no effect yet and what to use instead. A non-default value is rejected."""


def _lookup(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def not_implemented_problems(cfg: JobConfig) -> list[tuple[str, str]]:
    """(key, message) for every NOT_IMPLEMENTED key set to something other than its default."""
    default = JobConfig()
    problems = []
    for key, why in NOT_IMPLEMENTED.items():
        value, want = _lookup(cfg, key), _lookup(default, key)
        if value != want:
            problems.append((key, f"is not implemented ({why}): remove the override, or set it back to {want!r}"))
    return problems
