"""The optimizer side of an update, shared by the actor, the critic and SFT: AdamW, its learning-rate
schedule, moving its state for optimizer_offload, and the clipped, finite-only step.

    build_adamw, build_lr_scheduler, move_optimizer_state
    clip_grad_and_step      clip the global gradient norm, step, skip the step on a non-finite norm
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from verl_arpo.config import OptimConfig

logger = logging.getLogger(__name__)


def build_adamw(params: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that train (requires_grad)."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=float(optim.lr), betas=tuple(optim.betas),
                             eps=float(optim.eps), weight_decay=float(optim.weight_decay))


def move_optimizer_state(optimizer, device: torch.device | None) -> None:
    """Move AdamW moments to `device` (optimizer_offload: the host between updates), or with None back
    to the device of each one's parameter — the host too when param_offload keeps the parameters
    there: a moment on another device than its parameter breaks the step."""
    for param, state in optimizer.state.items():
        target = param.device if device is None else device
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step" and value.device != target:
                state[key] = value.to(target, non_blocking=True)


def build_lr_scheduler(optimizer, optim_cfg: OptimConfig, total_steps: int):
    """Linear warmup, then constant or cosine (to min_lr_ratio·lr)."""
    total = max(1, int(total_steps or 1))
    warmup = int(optim_cfg.lr_warmup_steps or -1)
    if warmup < 0:
        warmup = int(float(optim_cfg.lr_warmup_steps_ratio or 0.0) * total)
    style = optim_cfg.warmup_style
    floor = float(optim_cfg.min_lr_ratio or 0.0)
    if style not in ("constant", "cosine"):
        raise ValueError(f"unknown optim.warmup_style {style!r}; accepted: ['constant', 'cosine']")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        if style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_and_step(module: torch.nn.Module, optimizer, grad_clip: float | None, name: str) -> float:
    """Clip the global gradient norm and step; skip the step (with a warning) on a non-finite norm.

    torch.nn.utils.clip_grad_norm_ works on FSDP2 DTensor gradients: the norm comes back as a
    DTensor with a partial placement, whose `full_tensor()` is the global norm (identical on every
    rank, so every rank makes the same skip decision). Returns the norm before clipping.
    """
    max_norm = float(grad_clip) if grad_clip is not None and grad_clip > 0 else math.inf
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if math.isfinite(norm):
        optimizer.step()
    else:
        logger.warning("%s: grad_norm is %s; skipping this optimizer step", name, norm)
    optimizer.zero_grad(set_to_none=True)
    return norm
