"""Checking the trainer config (configs/ppo_trainer.yaml) before Ray starts.

    job = validate_config(cfg)   the typed JobConfig, or a ConfigError naming every bad key and its fix
    mask_secrets(cfg)            a plain dict safe to print or log (API keys, tokens, passwords → ***)
    resolve_device(device)       trainer.device=auto → cuda when the Ray cluster (or this machine) has a GPU

The rules themselves live with the typed sections (verl_arpo/config: each section's `problems()`,
and `JobConfig.problems` for the rules across sections); this module is the trainer's door to them and
adds the one kind of rule the config cannot hold: that a key names a registered algorithm
(`registered_names`: the algorithms sit above the config).
Batch sizes follow verl: the user gives `data.train_batch_size` and `actor.ppo_mini_batch_size` in
*prompts*; each prompt becomes `rollout.n` trajectories (ARPO's branches fill the group up to n), and
the trajectories are split over `trainer.n_gpus_per_node × trainer.nnodes` workers. The keys keep
that meaning everywhere; what a worker runs is derived once, in `JobConfig.derived`.

Not checked here: anything that needs the model or the data loaded (prompt lengths, vocabulary),
tool YAML contents (the tool registry reports those when it builds the tools).

Secret masking lives in verl_arpo/utils/secrets.py (re-exported here).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_arpo.config import ConfigError, JobConfig, RegisteredNames
from verl_arpo.config.run import Device
from verl_arpo.config.typed import choices
from verl_arpo.utils.resources import bundled_root, resolve_bundled
from verl_arpo.utils.secrets import SECRET_ENV_VARS, MASK, is_secret_key, mask_secrets, mask_text  # noqa: F401
from verl_arpo.utils.tracking import LOGGER_BACKENDS, parse_logger

__all__ = ["ConfigError", "validate_config", "mask_secrets", "mask_text",
           "resolve_device", "parse_logger", "resolve_project_path", "PROJECT_ROOT", "LOGGER_BACKENDS"]

PROJECT_ROOT = bundled_root()
"""The folder holding configs/, rl_datasets/ and search_cache/ (the checkout, or the installed package data)."""

DEVICES = choices(Device)


def resolve_project_path(path: str | os.PathLike) -> Path:
    """An absolute path: as given, else relative to the cwd if it exists there, else among the
    package's bundled files (verl_arpo.utils.resources)."""
    return resolve_bundled(path)


def registered_names() -> RegisteredNames:
    """The config keys that name an algorithm, with the registries that hold the names (the algorithms
    register themselves in verl_arpo/algos; the config package sits below them and cannot look)."""
    from verl_arpo.algos.branching import BRANCH_RULES
    from verl_arpo.algos.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY

    return {"algorithm.adv_estimator": (ADV_ESTIMATOR_REGISTRY, ""),
            "actor_rollout_ref.actor.policy_loss.loss_mode": (POLICY_LOSS_REGISTRY, ""),
            "actor_rollout_ref.rollout.branch_rule": (BRANCH_RULES, " (aepo: AEPO's threshold rule with the "
                                                      "consecutive-branch penalty; arpo: ARPO's branch probability)")}


def validate_config(cfg: Any, on_typed: Callable[[JobConfig], None] | None = None) -> JobConfig:
    """The typed config built from a composed tree (or a mapping, or a JobConfig checked again), or a
    ConfigError listing every bad value (key, problem, fix), registry names included; `on_typed` as in
    `JobConfig.checked`."""
    return JobConfig.checked(cfg, on_typed, names=registered_names())


# ------------------------------------------------------------------------------------------------
# the device
# ------------------------------------------------------------------------------------------------
def cluster_gpus() -> int:
    """GPUs the workers can get: the Ray cluster's GPU resources once Ray is up (a CPU-only head node
    of a GPU cluster must still give GPU workers), else this machine's CUDA devices."""
    ray = sys.modules.get("ray")   # not imported: no cluster to ask (trainer.single_process)
    if ray is not None and ray.is_initialized():
        return int(ray.cluster_resources().get("GPU", 0))
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, gpus: int | None = None) -> str:
    """"cuda" or "cpu" for trainer.device: auto → cuda when the workers can get a GPU (`gpus`,
    default `cluster_gpus()`)."""
    if device not in DEVICES:
        raise ConfigError([("trainer.device", f"unknown {device!r}; accepted: {list(DEVICES)}")])
    has_cuda = (cluster_gpus() if gpus is None else int(gpus)) > 0
    if device == "cuda" and not has_cuda:
        raise ConfigError([("trainer.device", "cuda requested but neither the Ray cluster nor this machine has a "
                            "GPU: use trainer.device=cpu or trainer.device=auto")])
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    return device
