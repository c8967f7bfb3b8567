"""Checking the trainer config (configs/ppo_trainer.yaml) before Ray starts.

    validate_config(cfg)   every bad value at once, as a ConfigError naming the key and the fix
    mask_secrets(cfg)      a plain dict safe to print or log (API keys, tokens, passwords → ***)
    resolve_device(cfg)    trainer.device=auto → cuda when the Ray cluster (or this machine) has a GPU

Batch sizes follow verl: the user gives `data.train_batch_size` and `actor.ppo_mini_batch_size` in
*prompts*; each prompt becomes `rollout.n` trajectories (ARPO's branches fill the group up to n), and
the trajectories are split over `trainer.n_gpus_per_node × trainer.nnodes` workers. The keys keep
that meaning everywhere; what a worker runs (trajectories per worker) is derived once, in
`JobConfig.derived` (utils/job_config.py, `Batching`).

Not checked here: anything that needs the model or the data loaded (prompt lengths, vocabulary),
tool YAML contents (the tool registry reports those when it builds the tools).

Secret masking lives in verl_arpo/utils/secrets.py (re-exported here).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_arpo.utils.job_config import MODEL_DTYPE_NAMES, ROLLOUT_MODES, ConfigError, JobConfig, not_implemented_problems
from verl_arpo.utils.resources import bundled_root, resolve_bundled
from verl_arpo.utils.secrets import SECRET_ENV_VARS, MASK, is_secret_key, mask_secrets, mask_text  # noqa: F401
from verl_arpo.utils.tracking import LOGGER_BACKENDS, parse_logger

__all__ = ["ConfigError", "validate_config", "mask_secrets", "mask_text",
           "resolve_device", "parse_logger", "resolve_project_path", "PROJECT_ROOT", "LOGGER_BACKENDS"]

PROJECT_ROOT = bundled_root()
"""The folder holding configs/, rl_datasets/ and search_cache/ (the checkout, or the installed package data)."""

VERL_LOGGERS_NOT_SUPPORTED = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")
ROLLOUT_NAMES = ("hf", "vllm")
DEVICES = ("auto", "cuda", "cpu")
RESUME_MODES = ("auto", "disable", "resume_path")
TRUNCATIONS = ("error", "left", "right")
WARMUP_STYLES = ("constant", "cosine")
KL_CTRL_TYPES = ("fixed", "adaptive")
STRATEGIES = ("fsdp", "fsdp2")

_MISSING = object()


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------
def _as_omegaconf(cfg: Any) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.create(dict(cfg))


def _select(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """cfg[key] resolved; `default` when absent or null; _MISSING when ??? (or resolves to ???)."""
    try:
        value = OmegaConf.select(cfg, key, default=default, throw_on_missing=True)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
    except Exception:  # ???, an interpolation to ???, a broken interpolation
        return _MISSING
    return default if value is None else value


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    # [reliability: tests/reliability/README.md] NaN fails every comparison, so `clip_ratio=nan` or `optim.lr=nan`
    # passed each "must be > 0" check and reached the loss
    return None if number != number else number


def _is_one_of(value: Any, choices: Any) -> bool:
    """`value in choices`, False when `value` is unhashable and `choices` a dict (a registry).

    [reliability: tests/reliability/README.md] `algorithm.adv_estimator=[grpo]` (a list or map where a name belongs)
    raised TypeError: unhashable type from validate_config instead of a ConfigError naming the key."""
    try:
        return value in choices
    except TypeError:
        return False


def resolve_project_path(path: str | os.PathLike) -> Path:
    """An absolute path: as given, else relative to the cwd if it exists there, else among the
    package's bundled files (verl_arpo.utils.resources)."""
    return resolve_bundled(path)


def _files(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


# ------------------------------------------------------------------------------------------------
# validation: one function per topic; each calls add(key, message) for every problem it finds
# ------------------------------------------------------------------------------------------------
AR = "actor_rollout_ref"


def _check_model(c: DictConfig, add: Callable[[str, str], None]) -> None:
    key = f"{AR}.model.path"
    path = _select(c, key)
    if path is _MISSING or path in (None, ""):
        add(key, "is required: set it to a Hugging Face model folder (the one holding config.json)")
    elif not Path(os.path.expanduser(str(path))).is_dir():
        add(key, f"{path!r} is not a folder: give a local Hugging Face model folder (with config.json)")
    elif not (Path(os.path.expanduser(str(path))) / "config.json").is_file():
        add(key, f"{path!r} has no config.json: point it at a Hugging Face model folder")
    if _select(c, f"{AR}.hybrid_engine", True) is not True:
        add(f"{AR}.hybrid_engine", "only the colocated (hybrid) engine is implemented: set it to true")
    lora = _as_int(_select(c, f"{AR}.model.lora_rank", 0))
    if lora is None or lora < 0:
        add(f"{AR}.model.lora_rank", "must be an integer >= 0 (0 = full fine-tuning)")
    if _select(c, f"{AR}.model.use_prefix_sharing", False) is True:
        if _select(c, f"{AR}.model.use_remove_padding", False) is not True:
            add(f"{AR}.model.use_prefix_sharing", "packs the rows' prefix tree, so it needs packed sequences: set "
                f"{AR}.model.use_remove_padding=true (or use_prefix_sharing=false)")
        if _select(c, f"{AR}.model.attn_implementation", None) not in (None, "sdpa", "eager"):
            add(f"{AR}.model.use_prefix_sharing", "needs attention that takes a tree mask: set "
                f"{AR}.model.attn_implementation to sdpa or eager (or use_prefix_sharing=false)")


def _check_rollout(c: DictConfig, add: Callable[[str, str], None]) -> None:
    r = f"{AR}.rollout"
    name = _select(c, f"{r}.name", "hf")
    if name not in ROLLOUT_NAMES:
        add(f"{r}.name", f"unknown engine {name!r}; accepted: {list(ROLLOUT_NAMES)}")
    elif name == "vllm" and importlib.util.find_spec("vllm") is None:
        add(f"{r}.name", "vllm is not installed here: install it, or use actor_rollout_ref.rollout.name=hf")
    mode = _select(c, f"{r}.mode", "sync_with_tool")
    if mode not in ROLLOUT_MODES:
        add(f"{r}.mode", f"unknown mode {mode!r}; accepted: {list(ROLLOUT_MODES)} (sync: rounds with barriers; async: no barriers)")
    n = _as_int(_select(c, f"{r}.n", 1))
    if n is None or n < 1:
        add(f"{r}.n", "must be an integer >= 1 (trajectories per prompt)")
    init = _select(c, f"{r}.initial_rollouts")
    if init is not None:
        m0 = _as_int(init)
        if m0 is None or m0 < 1:
            add(f"{r}.initial_rollouts", "must be null or an integer >= 1")
        elif n is not None and n < m0:
            add(f"{r}.initial_rollouts", f"{m0} is larger than rollout.n={n}: set initial_rollouts <= n "
                "(ARPO starts initial_rollouts trajectories and branches up to n)")
    beam = _as_int(_select(c, f"{r}.beam_size", 2))
    if beam is None or beam < 1:
        add(f"{r}.beam_size", "must be an integer >= 1")
    p = _as_float(_select(c, f"{r}.branch_probability", 0.5))
    if p is None or not 0.0 <= p <= 1.0:
        add(f"{r}.branch_probability", "must be a number in [0, 1]")
    from verl_arpo.workers.rollout.branching import BRANCH_RULES, ENTROPY_MODES

    rule = _select(c, f"{r}.branch_rule", "arpo")
    if not _is_one_of(rule, BRANCH_RULES):
        add(f"{r}.branch_rule", f"unknown {rule!r}; accepted: {sorted(BRANCH_RULES)} (aepo: AEPO's threshold rule "
            "with the consecutive-branch penalty; arpo: ARPO's branch probability)")

    mode = _select(c, f"{r}.entropy_mode", "topk_proxy")
    if mode not in ENTROPY_MODES:
        add(f"{r}.entropy_mode", f"unknown {mode!r}; accepted: {list(ENTROPY_MODES)}")
    for leaf in ("entropy_window", "entropy_topk", "initial_entropy_tokens"):
        v = _as_int(_select(c, f"{r}.{leaf}", 1))
        if v is None or v < 1:
            add(f"{r}.{leaf}", "must be an integer >= 1")
    vn = _as_int(_select(c, f"{r}.val_kwargs.n", 1))
    if vn is None or vn < 1:
        add(f"{r}.val_kwargs.n", "must be an integer >= 1")
    multi = _select(c, f"{r}.multi_turn.enable", True)
    if multi not in (True, False, ""):
        add(f"{r}.multi_turn.enable", f"must be true or false, got {multi!r}")
    elif multi is False:  # accepted for the seeds' scripts (true or an unset variable), never ignored
        add(f"{r}.multi_turn.enable", "false is not implemented: the rollout is always the multi-turn tool loop; "
            "set it to true (a single-turn run is a tool config without tool_instances)")
    tp = _as_int(_select(c, f"{r}.tensor_model_parallel_size", 1))
    if tp is None or tp < 1:
        add(f"{r}.tensor_model_parallel_size", "must be an integer >= 1")
    elif tp > 1:  # refused, not ignored: each engine lives in one worker (one GPU) and holds the whole model
        add(f"{r}.tensor_model_parallel_size", f"{tp} is not implemented: every rollout engine runs inside one "
            "worker on one device and holds the whole model; set it to 1 (a model whose weights plus KV cache do "
            "not fit in gpu_memory_utilization of one GPU cannot be trained here yet)")
    if _select(c, f"{r}.name", "hf") == "hf":  # vLLM's engine keys: the HF engine has no such setting
        for leaf, default in VLLM_ONLY_KEYS.items():
            value = _select(c, f"{r}.{leaf}", default)
            if value != default:
                add(f"{r}.{leaf}", f"{value!r} applies to the vLLM engine only (rollout.name=vllm); the hf engine has "
                    f"no such setting: remove the override or set it back to {default!r}")


# vLLM engine arguments passed through from the rollout section, with their YAML defaults
VLLM_ONLY_KEYS = {"enforce_eager": True, "load_format": "auto", "max_num_batched_tokens": 8192, "max_num_seqs": 1024}


def _check_batches(c: DictConfig, add: Callable[[str, str], None]) -> None:
    nodes = _as_int(_select(c, "trainer.nnodes", 1))
    gpus = _as_int(_select(c, "trainer.n_gpus_per_node", 1))
    if nodes is None or nodes < 1:
        add("trainer.nnodes", "must be an integer >= 1")
    if gpus is None or gpus < 1:
        add("trainer.n_gpus_per_node", "must be an integer >= 1 (workers per node: GPUs, or CPU processes)")
    bsz = _as_int(_select(c, "data.train_batch_size", 1))
    if bsz is None or bsz < 1:
        add("data.train_batch_size", "must be an integer >= 1 (prompts per step)")
    n = _as_int(_select(c, f"{AR}.rollout.n", 1))
    if None in (nodes, gpus, bsz, n) or min(nodes, gpus, bsz, n) < 1:
        return  # reported above; the arithmetic below needs all four
    world = nodes * gpus
    if bsz * n % world:
        add("data.train_batch_size", f"train_batch_size × rollout.n = {bsz} × {n} = {bsz * n} trajectories "
            f"do not split evenly over {world} workers (trainer.n_gpus_per_node × trainer.nnodes): "
            "change the batch size, rollout.n or the worker count")
    _check_mini_batch(c, add, f"{AR}.actor", bsz, n, world)
    for section in (f"{AR}.rollout", f"{AR}.ref"):
        old = _select(c, f"{section}.log_prob_micro_batch_size")
        if old is not None and (_as_int(old) is None or _as_int(old) < world or _as_int(old) % world):
            add(f"{section}.log_prob_micro_batch_size", f"(deprecated, global) must be a multiple of the "
                f"{world} workers; better set log_prob_micro_batch_size_per_gpu instead")
        per = _as_int(_select(c, f"{section}.log_prob_micro_batch_size_per_gpu", 1))
        if per is None or per < 1:
            add(f"{section}.log_prob_micro_batch_size_per_gpu", "must be an integer >= 1")
    if _select(c, "algorithm.adv_estimator") == "gae" and _select(c, "critic") not in (_MISSING, None):
        _check_mini_batch(c, add, "critic", bsz, n, world)


def _check_mini_batch(c: DictConfig, add, section: str, bsz: int, n: int, world: int) -> None:
    key = f"{section}.ppo_mini_batch_size"
    mini = _as_int(_select(c, key, 1))
    if mini is None or mini < 1:
        add(key, "must be an integer >= 1 (prompts per optimizer step)")
        return
    if mini > bsz or bsz % mini:
        add(key, f"{mini} prompts must divide data.train_batch_size={bsz}: pick a divisor of the batch")
    if mini * n % world:
        add(key, f"ppo_mini_batch_size × rollout.n = {mini} × {n} = {mini * n} trajectories do not split "
            f"evenly over {world} workers: pick a mini batch whose ×n is a multiple of the worker count")
        return
    per_worker = mini * n // world
    old = _select(c, f"{section}.ppo_micro_batch_size")
    if old is not None:
        old_i = _as_int(old)
        if old_i is None or old_i < world or old_i % world:
            add(f"{section}.ppo_micro_batch_size", f"(deprecated, global) must be a multiple of the {world} "
                "workers; better set ppo_micro_batch_size_per_gpu instead")
            return
        micro = old_i // world
    else:
        micro = _as_int(_select(c, f"{section}.ppo_micro_batch_size_per_gpu", 1))
    if micro is None or micro < 1:
        add(f"{section}.ppo_micro_batch_size_per_gpu", "must be an integer >= 1")
    elif _select(c, f"{section}.use_dynamic_bsz", False) is not True and per_worker % micro:
        add(f"{section}.ppo_micro_batch_size_per_gpu", f"{micro} does not divide the {per_worker} trajectories "
            f"each worker gets per mini batch (ppo_mini_batch_size × n ÷ workers = {mini} × {n} ÷ {world}): "
            "pick a divisor, or set use_dynamic_bsz=true")


def _check_lengths(c: DictConfig, add: Callable[[str, str], None]) -> None:
    lens = {}
    for leaf in ("max_prompt_length", "max_response_length"):
        v = _as_int(_select(c, f"data.{leaf}", 1))
        if v is None or v < 1:
            add(f"data.{leaf}", "must be an integer >= 1 (tokens)")
        lens[leaf] = v or 0
    one_seq = lens["max_prompt_length"] + lens["max_response_length"]
    budgets = [(f"{AR}.actor.use_dynamic_bsz", f"{AR}.actor.ppo_max_token_len_per_gpu"),
               (f"{AR}.rollout.log_prob_use_dynamic_bsz", f"{AR}.rollout.log_prob_max_token_len_per_gpu"),
               (f"{AR}.ref.log_prob_use_dynamic_bsz", f"{AR}.ref.log_prob_max_token_len_per_gpu")]
    for flag, key in budgets:
        if _select(c, flag, False) is True:
            budget = _as_int(_select(c, key, 0))
            if budget is None or budget < one_seq:
                add(key, f"token budget {budget} < max_prompt_length + max_response_length = {one_seq}: one "
                    "full sequence must fit (the seeds use 2-4 × that sum)")
    trunc = _select(c, "data.truncation", "error")
    if trunc not in TRUNCATIONS:
        add("data.truncation", f"unknown {trunc!r}; accepted: {list(TRUNCATIONS)}")


def _check_algorithm(c: DictConfig, add: Callable[[str, str], None]) -> None:
    from verl_arpo.trainer.ppo.core_algos import (ADV_ESTIMATOR_REGISTRY, KL_PENALTIES, LOSS_AGG_MODES,
                                                  POLICY_LOSS_REGISTRY)

    est = _select(c, "algorithm.adv_estimator", "grpo")
    if not _is_one_of(est, ADV_ESTIMATOR_REGISTRY):
        add("algorithm.adv_estimator", f"unknown {est!r}; accepted: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    if est == "gae":
        critic = _select(c, "critic")
        if critic in (_MISSING, None) or _select(c, "critic.model.path") in (_MISSING, None, ""):
            add("critic", "adv_estimator=gae needs a critic: give critic.model.path (and the critic section "
                "of ppo_trainer.yaml), or use algorithm.adv_estimator=grpo")
        else:
            mode = _select(c, "critic.loss_agg_mode", "token-mean")
            if mode not in LOSS_AGG_MODES:
                add("critic.loss_agg_mode", f"unknown {mode!r}; accepted: {list(LOSS_AGG_MODES)}")
    mode = _select(c, f"{AR}.actor.loss_agg_mode", "token-mean")
    if mode not in LOSS_AGG_MODES:
        add(f"{AR}.actor.loss_agg_mode", f"unknown {mode!r}; accepted: {list(LOSS_AGG_MODES)}")
    kl = _select(c, f"{AR}.actor.kl_loss_type", "low_var_kl")
    if kl not in KL_PENALTIES:
        add(f"{AR}.actor.kl_loss_type", f"unknown {kl!r}; accepted: {list(KL_PENALTIES)}")
    kl = _select(c, "algorithm.kl_penalty", "kl")
    if kl not in KL_PENALTIES:
        add("algorithm.kl_penalty", f"unknown {kl!r}; accepted: {list(KL_PENALTIES)}")
    ctrl = _select(c, "algorithm.kl_ctrl.type", "fixed")
    if ctrl not in KL_CTRL_TYPES:
        add("algorithm.kl_ctrl.type", f"unknown {ctrl!r}; accepted: {list(KL_CTRL_TYPES)}")
    from verl_arpo.trainer.ppo.rollout_mismatch import ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES

    cap = _select(c, "algorithm.rollout_is_threshold")
    if cap is not None and (_as_float(cap) is None or _as_float(cap) <= 0):
        add("algorithm.rollout_is_threshold", "must be null (off) or a number > 0 (e.g. 2.0)")
    if cap is not None and _select(c, f"{AR}.rollout.calculate_log_probs", True) is False:
        add(f"{AR}.rollout.calculate_log_probs", "must be true when algorithm.rollout_is_threshold is set: "
            "the importance weights need the engine's log-probs")
    if _select(c, "algorithm.rollout_is", False) is True and cap is None:
        add("algorithm.rollout_is", "needs algorithm.rollout_is_threshold (the weight cap, e.g. 2.0)")
    for leaf, choices in (("rollout_is_level", ROLLOUT_IS_LEVELS), ("rollout_is_mode", ROLLOUT_IS_MODES)):
        value = _select(c, f"algorithm.{leaf}", choices[0])
        if value not in choices:
            add(f"algorithm.{leaf}", f"unknown or not implemented {value!r}; accepted: {list(choices)}")
    loss = _select(c, f"{AR}.actor.policy_loss.loss_mode", "vanilla")
    if not _is_one_of(loss, POLICY_LOSS_REGISTRY):
        add(f"{AR}.actor.policy_loss.loss_mode", f"unknown {loss!r}; accepted: {sorted(POLICY_LOSS_REGISTRY)}")


def _check_actor(c: DictConfig, add: Callable[[str, str], None]) -> None:
    a = f"{AR}.actor"
    clip = _as_float(_select(c, f"{a}.clip_ratio", 0.2))
    if clip is None or clip <= 0:
        add(f"{a}.clip_ratio", "must be a number > 0 (PPO ε)")
    for leaf in ("clip_ratio_low", "clip_ratio_high"):
        v = _select(c, f"{a}.{leaf}")
        if v is not None and (_as_float(v) is None or _as_float(v) < 0):
            add(f"{a}.{leaf}", "must be null or a number >= 0")
    low = _as_float(_select(c, f"{a}.clip_ratio_low"))
    if low is not None and low >= 1:
        add(f"{a}.clip_ratio_low", "must be < 1 (the lower bound is 1 − clip_ratio_low)")
    cc = _as_float(_select(c, f"{a}.clip_ratio_c", 3.0))
    if cc is None or cc <= 1:
        add(f"{a}.clip_ratio_c", f"dual-clip constant must be > 1, got {cc!r}: use e.g. 3.0")
    for key in (f"{a}.grad_clip", f"{a}.max_grad_norm"):
        v = _select(c, key)
        if v is not None and (_as_float(v) is None or _as_float(v) <= 0):
            add(key, "must be null or a number > 0 (max gradient norm)")
    epochs = _as_int(_select(c, f"{a}.ppo_epochs", 1))
    if epochs is None or epochs < 1:
        add(f"{a}.ppo_epochs", "must be an integer >= 1")
    strategy = _select(c, f"{a}.strategy", "fsdp")
    if strategy not in STRATEGIES:
        add(f"{a}.strategy", f"unknown {strategy!r}; accepted: {list(STRATEGIES)}")
    for section in (f"{a}.fsdp_config", f"{AR}.ref.fsdp_config", "critic.model.fsdp_config"):
        v = _select(c, f"{section}.model_dtype")
        if v is not None and v not in MODEL_DTYPE_NAMES:
            add(f"{section}.model_dtype", f"unknown {v!r}; accepted: null (fp32 trained, bf16 reference on GPU) or "
                f"{list(MODEL_DTYPE_NAMES)}")
    for section in (f"{a}.optim", "critic.optim"):
        if section == "critic.optim" and _select(c, "algorithm.adv_estimator") != "gae":
            continue
        lr = _as_float(_select(c, f"{section}.lr", 1e-6))
        if lr is None or lr <= 0:
            add(f"{section}.lr", "must be a number > 0")
        style = _select(c, f"{section}.warmup_style", "constant")
        if style not in WARMUP_STYLES:
            add(f"{section}.warmup_style", f"unknown {style!r}; accepted: {list(WARMUP_STYLES)}")


def _check_files(c: DictConfig, add: Callable[[str, str], None]) -> None:
    for key, required in (("data.train_files", True), ("data.val_files", False)):
        value = _select(c, key)
        if value is _MISSING or (required and not value):
            add(key, "is required: give a parquet file or a list of files")
            continue
        for f in _files(value):
            if not resolve_project_path(f).is_file():  # the cwd, then the bundled task
                add(key, f"no such file {f!r}")
    path = _select(c, "custom_reward_function.path")
    if path not in (None, "", _MISSING):
        p = resolve_project_path(path)
        if not p.is_file():
            add("custom_reward_function.path", f"no such file {str(path)!r}: give a .py file, or null for the "
                "built-in scorers chosen by data_source")
        elif p.suffix != ".py":
            add("custom_reward_function.path", f"{str(path)!r} is not a Python (.py) file")
        else:  # import it now (the driver would, after Ray is up): a broken file fails here
            from verl_arpo.utils.reward_score.custom import load_custom_reward_function

            name = _select(c, "custom_reward_function.name", "compute_score")
            try:
                load_custom_reward_function(str(p), name)
            except Exception as exc:  # noqa: BLE001 - any error of the user's file is a config problem
                leaf = "name" if isinstance(exc, AttributeError) else "path"
                add(f"custom_reward_function.{leaf}", f"{type(exc).__name__}: {exc}")
    if _select(c, "reward_model.enable", False) is True:
        add("reward_model.enable", "model-based rewards are not supported: set it to false (rule-based scorers)")


def _check_trainer(c: DictConfig, add: Callable[[str, str], None]) -> None:
    backends = parse_logger(_select(c, "trainer.logger", ["console"]))
    unknown = [b for b in backends if b not in LOGGER_BACKENDS]
    verl_only = [b for b in unknown if b in VERL_LOGGERS_NOT_SUPPORTED]
    if verl_only:
        add("trainer.logger", f"{verl_only} are verl loggers this trainer does not ship; use wandb or tensorboard "
                              f"(the same scalars), or jsonl for a local file; accepted: {list(LOGGER_BACKENDS)}")
    elif unknown:
        add("trainer.logger", f"unknown backend(s) {unknown}; accepted: {list(LOGGER_BACKENDS)}")
    import importlib.util

    for backend, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if backend in backends and importlib.util.find_spec(module) is None:
            add("trainer.logger", f"{backend} is not installed: pip install 'verl_arpo[{backend}]', or remove "
                                  f"{backend} from trainer.logger")
    device = _select(c, "trainer.device", "auto")
    if device not in DEVICES:
        add("trainer.device", f"unknown {device!r}; accepted: {list(DEVICES)}")
    elif device == "cuda" and not _select(c, "ray_init.address"):
        # a local cluster is this machine; a remote one is checked against its resources after Ray is up
        import torch

        if not torch.cuda.is_available():
            add("trainer.device", "cuda requested but no CUDA device is visible: use trainer.device=cpu or auto")
    mode = _select(c, "trainer.resume_mode", "auto")
    if mode not in RESUME_MODES:
        add("trainer.resume_mode", f"unknown {mode!r}; accepted: {list(RESUME_MODES)}")
    elif mode == "resume_path" and not _select(c, "trainer.resume_from_path"):
        add("trainer.resume_from_path", "resume_mode=resume_path needs resume_from_path (a global_step_N folder)")
    for leaf in ("save_freq", "test_freq", "total_epochs"):
        if _as_int(_select(c, f"trainer.{leaf}", 1)) is None:
            add(f"trainer.{leaf}", "must be an integer")
    shown = _as_int(_select(c, "trainer.log_val_generations", 0))
    if shown is None or shown < 0:
        add("trainer.log_val_generations", "must be an integer >= 0 (validation samples logged per validation)")
    steps = _select(c, "trainer.total_training_steps")
    if steps is not None and (_as_int(steps) is None or _as_int(steps) < 1):
        add("trainer.total_training_steps", "must be null or an integer >= 1")
    cpus = _select(c, "ray_init.num_cpus")
    if cpus is not None and (_as_int(cpus) is None or _as_int(cpus) < 1):
        add("ray_init.num_cpus", "must be null (all CPUs) or an integer >= 1")


def _check_typed(c: DictConfig, add: Callable[[str, str], None]) -> None:
    """The tree builds a JobConfig (no unknown key, numbers where numbers belong) and sets no key that
    no code reads yet to a non-default value (job_config.NOT_IMPLEMENTED)."""
    try:
        plain = OmegaConf.to_container(c, resolve=True, throw_on_missing=False)
    except Exception:  # a broken interpolation: the checks above name it
        return
    plain.pop("hydra", None)
    try:
        job = JobConfig.from_mapping(plain)
    except ConfigError as exc:
        for key, msg in exc.problems:
            add(key, msg)
        return
    for key, msg in not_implemented_problems(job):
        add(key, msg)


_CHECKS = (_check_model, _check_rollout, _check_batches, _check_lengths, _check_algorithm, _check_actor,
           _check_files, _check_trainer, _check_typed)


def validate_config(cfg: DictConfig | Mapping) -> None:
    """Raise ConfigError listing every bad value (key, problem, fix); return None when all is well."""
    c = _as_omegaconf(cfg)
    problems: list[tuple[str, str]] = []

    def add(key: str, message: str) -> None:
        problems.append((key, message))

    for check in _CHECKS:
        check(c, add)
    if problems:
        raise ConfigError(problems)


# ------------------------------------------------------------------------------------------------
# the device
# ------------------------------------------------------------------------------------------------
def cluster_gpus() -> int:
    """GPUs the workers can get: the Ray cluster's GPU resources once Ray is up (a CPU-only head node
    of a GPU cluster must still give GPU workers), else this machine's CUDA devices."""
    try:
        import ray

        if ray.is_initialized():
            return int(ray.cluster_resources().get("GPU", 0))
    except ImportError:  # pragma: no cover - ray is a hard dependency
        pass
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(cfg: DictConfig | Mapping | str, gpus: int | None = None) -> str:
    """"cuda" or "cpu" for trainer.device: auto → cuda when the workers can get a GPU (`gpus`,
    default `cluster_gpus()`). Accepts the config or the value."""
    device = cfg if isinstance(cfg, str) else (_select(_as_omegaconf(cfg), "trainer.device", "auto"))
    if device not in DEVICES:
        raise ConfigError([("trainer.device", f"unknown {device!r}; accepted: {list(DEVICES)}")])
    has_cuda = (cluster_gpus() if gpus is None else int(gpus)) > 0
    if device == "cuda" and not has_cuda:
        raise ConfigError([("trainer.device", "cuda requested but neither the Ray cluster nor this machine has a "
                            "GPU: use trainer.device=cpu or trainer.device=auto")])
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    return device
