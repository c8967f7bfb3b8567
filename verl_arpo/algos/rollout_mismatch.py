"""The gap between the rollout engine's log-probs and the trainer's, and its correction
(docs/algorithms.md, "Rollout–training mismatch").

The engine samples with its own numerics (vLLM or the HF engine, often in bf16); the trainer
recomputes log π_old(a_t) with the FSDP actor. The two differ, so the PPO ratio is taken against a
policy that did not generate the tokens. Per valid token (m = response_mask), with
    δ_t = log π_old(a_t) − log π_rollout(a_t)
the metrics are
    mismatch/log_prob_abs_diff = mean_m |δ|
    mismatch/kl                = mean_m (−δ)             k1 estimate of KL(π_rollout ‖ π_old)
    mismatch/k3_kl             = mean_m (e^δ − δ − 1)    k3 estimate, ≥ 0
and the importance weights (verl's `algorithm.rollout_is_*` keys) are
    token:    w_t = e^{δ_t}
    sequence: w_t = e^{Σ_s m_s δ_s}  (one weight for every token of the sequence)
    truncate: w ← min(w, threshold)                      (TIS, the only mode here)
The policy loss multiplies each token's surrogate by w (detached): `compute_policy_loss(...,
rollout_is_weights=w)`. verl's rejection mode (`rollout_is_mode=mask`, which changes the loss
denominator) and its veto are not implemented and refused at validation.
"""

from __future__ import annotations

import torch

from verl_arpo.config.run import RolloutISLevel, RolloutISMode
from verl_arpo.config.typed import choices
from verl_arpo.utils.torch_functional import masked_mean

__all__ = ["ROLLOUT_IS_LEVELS", "ROLLOUT_IS_MODES", "mismatch_metrics", "rollout_is_weights"]

ROLLOUT_IS_LEVELS = choices(RolloutISLevel)   # the config's Literal: one list of accepted names
ROLLOUT_IS_MODES = choices(RolloutISMode)


def mismatch_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                     response_mask: torch.Tensor) -> dict[str, float]:
    """mean |δ|, the k1 and k3 KL estimates over the valid tokens (see the module docstring)."""
    delta = (old_log_prob - rollout_log_prob).detach().float()
    mask = response_mask.float()
    # one host transfer for the three numbers (this runs once per micro-batch of the update)
    values = torch.stack([masked_mean(delta.abs(), mask), masked_mean(-delta, mask),
                          masked_mean(torch.expm1(delta) - delta, mask)]).tolist()
    return dict(zip(("mismatch/log_prob_abs_diff", "mismatch/kl", "mismatch/k3_kl"), values))


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       threshold: float, level: str = "token",
                       mode: str = "truncate") -> tuple[torch.Tensor, dict[str, float]]:
    """(weights [B, T], detached and 0 off the mask; metrics)."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"algorithm.rollout_is_level={level!r}; accepted: {list(ROLLOUT_IS_LEVELS)}")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"algorithm.rollout_is_mode={mode!r}; accepted: {list(ROLLOUT_IS_MODES)}")
    mask = response_mask.to(old_log_prob.dtype)
    delta = ((old_log_prob - rollout_log_prob).detach() * mask).clamp(-20.0, 20.0)
    if level == "sequence":
        delta = delta.sum(-1, keepdim=True).clamp(-20.0, 20.0).expand_as(delta)
    raw = torch.exp(delta) * mask
    weights = raw.clamp(max=threshold)
    values = torch.stack([masked_mean(weights, mask), masked_mean((raw > threshold).to(mask.dtype), mask)]).tolist()
    return weights.detach(), dict(zip(("mismatch/rollout_is_mean", "mismatch/rollout_is_fraction_high"), values))
