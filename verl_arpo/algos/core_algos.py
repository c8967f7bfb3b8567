"""The algorithm core: advantages, policy/value/entropy losses, KL, and the AEPO variants.

Pure tensor functions with verl-compatible names, signatures and numerics (verl 0.9 is the
reference), plus two registries so a new algorithm is one registered function:

    @register_adv_est("my_est")          → get_adv_estimator_fn("my_est")
    @register_policy_loss("my_loss")     → get_policy_loss_fn("my_loss")

Notation (docs/algorithms.md): r = exp(logπθ − logπold) per token, A = advantage, m = response loss mask
(1 = token sampled by the model; 0 = tool result, forced token, padding), ε_l/ε_h =
clip_ratio_low/high, c = clip_ratio_c, sg = stop-gradient.

Where we depart from verl or from the ARPO/AEPO reference code, the function says so.
No config objects are required and there is no global state besides the registries.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from verl_arpo.config import (
    ActorConfig,
    AlgorithmConfig,
    KLCtrlConfig,
    kl_term_active,  # noqa: F401 - re-exported: the rule the actor applies
)
from verl_arpo.config.training import KLPenalty, LossAggMode
from verl_arpo.config.typed import choices
from verl_arpo.utils.torch_functional import (
    check_same_shape,
    clip_by_value,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
)

# --------------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------------
ADV_ESTIMATOR_REGISTRY: dict[str, Callable] = {}
POLICY_LOSS_REGISTRY: dict[str, Callable] = {}


def register_adv_est(name: str) -> Callable:
    """Decorator: register an advantage estimator under `name` (algorithm.adv_estimator)."""

    def deco(fn: Callable) -> Callable:
        if name in ADV_ESTIMATOR_REGISTRY and ADV_ESTIMATOR_REGISTRY[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return deco


def get_adv_estimator_fn(name: str) -> Callable:
    """Look up an advantage estimator; unknown names raise ValueError listing the accepted ones."""
    name = getattr(name, "value", name)  # accept enum members
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown `adv_estimator` {name!r}; accepted: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[name]


def register_policy_loss(name: str) -> Callable:
    """Decorator: register a policy loss under `name` (actor.policy_loss.loss_mode)."""

    def deco(fn: Callable) -> Callable:
        if name in POLICY_LOSS_REGISTRY and POLICY_LOSS_REGISTRY[name] is not fn:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return deco


def get_policy_loss_fn(name: str) -> Callable:
    """Look up a policy loss; unknown names raise ValueError listing the accepted ones."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy `loss_mode` {name!r}; accepted: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


# --------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------
LOSS_AGG_MODES = choices(LossAggMode)   # the config's Literal: one list of accepted names


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss into a scalar.

    - token-mean:              Σ_{i,t} m·L / N_tokens
    - seq-mean-token-sum:      mean_i Σ_t m·L
    - seq-mean-token-mean:     mean_i (Σ_t m·L / Σ_t m)
    - seq-mean-token-sum-norm: mean_i (Σ_t m·L / T_budget)   (Dr.GRPO; T_budget = loss_scale_factor,
                               default T = loss_mask.shape[-1], the response length budget)

    Sequence means run over sequences with ≥ 1 valid token. Single-rank use needs only the first
    three arguments. A data-parallel caller whose ranks see different shares of the mini-batch
    passes the global counts (`batch_num_tokens` for token-mean, `global_batch_size` for the
    sequence modes) and `dp_size`; the result is multiplied by dp_size because FSDP averages
    gradients over ranks, so Σ_ranks(result)/dp_size equals the global objective.
    Departure: verl ≤ 0.4 summed (not averaged) over sequences in seq-mean-token-sum-norm, a loss B×
    larger than the Dr.GRPO paper's; we follow the paper. An empty mask gives 0.
    """
    check_same_shape(loss_mat=loss_mat, loss_mask=loss_mask)
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        n_tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        n_tokens = torch.as_tensor(n_tokens, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
        return masked_sum(loss_mat, mask) / n_tokens * dp_size
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown `loss_agg_mode` {loss_agg_mode!r}; accepted: {list(LOSS_AGG_MODES)}")
    token_sum = masked_sum(loss_mat, mask, axis=-1)
    tokens_per_seq = mask.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sum
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sum / tokens_per_seq.clamp(min=1)
    else:  # seq-mean-token-sum-norm
        budget = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        seq_losses = token_sum / budget
    seq_valid = (tokens_per_seq > 0).to(loss_mat.dtype)
    n_seqs = seq_valid.sum() if global_batch_size is None else global_batch_size
    n_seqs = torch.as_tensor(n_seqs, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
    return (seq_losses * seq_valid).sum() / n_seqs * dp_size


# --------------------------------------------------------------------------------------------
# Advantage estimators
# --------------------------------------------------------------------------------------------
def _group_scores(scores: torch.Tensor, index) -> dict[Any, list[int]]:
    if len(index) != scores.shape[0]:
        raise ValueError(f"`index` has {len(index)} entries but the batch has {scores.shape[0]} rows")
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    return groups


@register_adv_est("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float | torch.Tensor = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each response.

    Backwards over t, with t' the next *valid* position:  δ_t = r_t + γ·V_{t'} − V_t,
    Â_t = δ_t + γλ·Â_{t'}  (V and Â are 0 past the last valid token). Masked positions (tool
    results, padding) do not advance the recursion: the value and advantage carry across them, so
    a `<result>` block in the middle of a trajectory leaves the advantages of the model's tokens
    exactly as if it were absent. returns = Â + V (before whitening); advantages = Â whitened over
    valid tokens, then × mask. Shapes [B, T] → ([B, T], [B, T]).
    """
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        adv_rev = []
        for t in reversed(range(values.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            m = mask[:, t]
            next_value = m * values[:, t] + (1 - m) * next_value
            last_gae = m * gae + (1 - m) * last_gae
            adv_rev.append(last_gae)
        advantages = torch.stack(adv_rev[::-1], dim=-1)
        returns = advantages + values
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage, one value per response broadcast over its tokens.

    s_i = Σ_t r_{i,t}; per group g (same `index`, the prompt uid): μ_g, σ_g = mean and *unbiased*
    std (a group of one: μ = 0, σ = 1). A_i = (s_i − μ_g)/(σ_g + ε), or s_i − μ_g when
    norm_adv_by_std_in_grpo is False (Dr.GRPO). Returns (A·m, A·m).
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        out = torch.empty_like(scores)
        for rows in _group_scores(scores, index).values():
            s = scores[rows]
            if len(rows) == 1:
                mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
            else:
                mean, std = s.mean(), s.std(unbiased=True)
            out[rows] = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
        adv = out.unsqueeze(-1) * response_mask.to(out.dtype)
    return adv, adv


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: A_i = s_i − mean_{j≠i, j∈g} s_j  (= n/(n−1)·(s_i − μ_g)); a group of one keeps s_i.
    Returns (A·m, A·m)."""
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        out = scores.clone()
        for rows in _group_scores(scores, index).values():
            n = len(rows)
            if n > 1:
                s = scores[rows]
                out[rows] = s * n / (n - 1) - s.mean() * n / (n - 1)
        adv = out.unsqueeze(-1) * response_mask.to(out.dtype)
    return adv, adv


@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgorithmConfig | None = None,
    gamma: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: G_t = r_t + γ·G_{t'} over valid tokens (t' the next valid one), whitened over
    valid tokens. γ from `gamma`, else `config.gamma`, else 1.0. Returns (whiten(G)·m, G).

    Departure from verl: verl resets the running return to 0 at every masked position, which in a
    multi-turn trajectory cuts the outcome reward off from every token before the first `<result>`
    block. Here masked positions are skipped (the return carries across them), which equals verl's
    result whenever the mask has no interior zeros.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    if gamma is None:
        gamma = (config or AlgorithmConfig()).gamma
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        running = torch.zeros_like(token_level_rewards[:, 0])
        rev = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            m = mask[:, t]
            running = m * (token_level_rewards[:, t] + gamma * running) + (1 - m) * running
            rev.append(running * m)
        returns = torch.stack(rev[::-1], dim=-1)
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


def compute_entropy_aware_advantage(
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float = 0.2,
) -> torch.Tensor:
    """AEPO entropy-aware advantage: A' = A · (1 + α·z),  z = (H − mean(H[m])) / std(H[m]).

    H is the current policy's per-token full-vocabulary entropy (detached here); mean and
    *unbiased* std run over the masked tokens of the batch given (the micro-batch); std == 0, or
    fewer than two valid tokens, → std = 1. An empty mask returns A unchanged. A' replaces A in
    every term of the loss, including the A < 0 test of the dual clip.
    (The reference computed H only when entropy_coeff != 0 — 0 in every shipped config — so this
    silently did nothing; callers here compute H whenever the flag is on.)
    """
    check_same_shape(advantages=advantages, entropy=entropy, response_mask=response_mask)
    h = entropy.detach().to(advantages.dtype)
    mask = response_mask.bool()
    n = int(mask.sum().item())
    if n == 0:
        return advantages
    valid = h[mask]
    mean = valid.mean()
    std = valid.std(unbiased=True) if n > 1 else torch.ones((), dtype=h.dtype)
    if not torch.isfinite(std) or std.item() == 0.0:
        std = torch.ones((), dtype=h.dtype)
    z = (h - mean) / std
    return advantages * (1 + alpha * z)


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    entropy_balanced_clipping: bool = False,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped PPO surrogate with dual clip; returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower).

        r  = exp(clamp(logπθ − logπold, −20, 20))
        L1 = −A·r ;  L2 = −A·clamp(r, 1−ε_l, U) ;  Lc = max(L1, L2)
        L  = where(A < 0, min(−A·c, Lc), Lc) ;  pg_loss = agg_loss(L, m)
    with U = 1+ε_h normally. ε_l, ε_h default to `cliprange` (DAPO clip-higher: set them apart).
    Metrics: pg_clipfrac = mean_m[L2 > L1], ppo_kl = mean_m[−log r],
    pg_clipfrac_lower = mean_m[(Lc > −A·c) ∧ (A < 0)].

    AEPO entropy clipping-balanced loss (`entropy_balanced_clipping=True`): U = (1+ε_h)·r/sg(r).
    Its value is 1+ε_h, so the forward loss is unchanged; its gradient is (1+ε_h)·∇logπ, so tokens
    with A > 0 and r > 1+ε_h keep the gradient −A·(1+ε_h)·∇logπ instead of zero. Lower and dual
    clip are unchanged. Like the AEPO reference, this applies to *all* tokens and uses no entropy
    threshold (the paper motivates it by high-entropy tokens; the code never tests entropy).

    Rollout correction (`rollout_is_weights` w, detached, see rollout_mismatch.py): L ← w·L per token
    before aggregation, the truncated importance weight of π_old against the rollout engine.
    """
    check_same_shape(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                     response_mask=response_mask)
    if cliprange is None and (cliprange_low is None or cliprange_high is None):
        cliprange = 0.2
    eps_low = cliprange if cliprange_low is None else cliprange_low
    eps_high = cliprange if cliprange_high is None else cliprange_high
    if clip_ratio_c <= 1.0:
        raise ValueError(f"`clip_ratio_c` must be > 1.0 for the dual clip, got {clip_ratio_c}")

    neg_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_approx_kl)
    ppo_kl = masked_mean(-neg_approx_kl, response_mask)

    if entropy_balanced_clipping:
        upper = (1.0 + eps_high) * ratio / ratio.detach()
    else:
        upper = torch.full_like(ratio, 1.0 + eps_high)
    loss1 = -advantages * ratio
    loss2 = -advantages * clip_by_value(ratio, 1.0 - eps_low, upper)
    clipped = torch.maximum(loss1, loss2)
    pg_clipfrac = masked_mean(torch.gt(loss2, loss1).float(), response_mask)

    loss3 = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss3, clipped), clipped)
    pg_clipfrac_lower = masked_mean((torch.gt(clipped, loss3) & negative).float(), response_mask)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _clip_args(config: ActorConfig | None) -> dict:
    """The clip settings of the actor section (None: the YAML defaults): ε_low / ε_high default to
    clip_ratio."""
    c = config or ActorConfig()
    low = c.clip_ratio if c.clip_ratio_low is None else c.clip_ratio_low
    high = c.clip_ratio if c.clip_ratio_high is None else c.clip_ratio_high
    return dict(cliprange=c.clip_ratio, cliprange_low=low, cliprange_high=high, clip_ratio_c=c.clip_ratio_c)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode: str = "token-mean", config: ActorConfig | None = None, **agg_kwargs):
    """Registered form of `compute_policy_loss`; clip settings from `config` (the actor section:
    clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c). Returns the 4-tuple."""
    return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                               loss_agg_mode=loss_agg_mode, **_clip_args(config), **agg_kwargs)


@register_policy_loss("entropy_balanced")
def compute_policy_loss_entropy_balanced(old_log_prob, log_prob, advantages, response_mask,
                                         loss_agg_mode: str = "token-mean", config: ActorConfig | None = None, **agg_kwargs):
    """AEPO entropy clipping-balanced loss (actor.enable_entropy_balanced_clipping=True); see
    `compute_policy_loss(entropy_balanced_clipping=True)`."""
    return compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                               loss_agg_mode=loss_agg_mode, entropy_balanced_clipping=True,
                               **_clip_args(config), **agg_kwargs)


# --------------------------------------------------------------------------------------------
# Entropy, value and KL terms
# --------------------------------------------------------------------------------------------
def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor,
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """agg_loss(H(logits), m): the mean policy entropy (the actor subtracts entropy_coeff × this)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ½·agg(max((V−R)², (clip(V, V_old−c, V_old+c) − R)²)).
    `agg_kwargs` (dp_size, batch_num_tokens, global_batch_size) go to `agg_loss`, as for the policy
    loss: a data-parallel critic passes the mini-batch's global counts and gets its share of the
    mini-batch objective. Returns (vf_loss, vf_clipfrac = mean_m[clipped term larger])."""
    check_same_shape(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    vclipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    l1 = (vpreds - returns) ** 2
    l2 = (vclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(l1, l2), response_mask, loss_agg_mode, **agg_kwargs)
    vf_clipfrac = masked_mean(torch.gt(l2, l1).float(), response_mask)
    return vf_loss, vf_clipfrac


KL_PENALTIES = choices(KLPenalty)   # the config's Literal


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between policy and reference, Δ = logprob − ref_logprob:

    kl / k1: Δ ;  abs: |Δ| ;  mse / k2: ½Δ² ;
    low_var_kl / k3: exp(d) − d − 1 with d = clamp(ref_logprob − logprob, −20, 20), result clamped
    to [−10, 10] (Schulman's unbiased low-variance estimator).
    `full` needs the whole distributions and raises NotImplementedError.
    """
    check_same_shape(logprob=logprob, ref_logprob=ref_logprob)
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        d = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
    if kl_penalty == "full":
        raise NotImplementedError("kl_penalty='full' needs full-vocabulary distributions, which the actor does "
                                  "not keep; use 'low_var_kl' (k3), 'kl' (k1), 'mse' (k2) or 'abs'")
    raise ValueError(f"unknown `kl_penalty` {kl_penalty!r}; accepted: {list(KL_PENALTIES)}")


def apply_kl_penalty_to_rewards(token_level_scores: torch.Tensor, old_log_prob: torch.Tensor,
                                ref_log_prob: torch.Tensor, response_mask: torch.Tensor,
                                kl_coef: float, kl_penalty_type: str = "kl") -> tuple[torch.Tensor, torch.Tensor]:
    """In-reward KL (algorithm.use_kl_in_reward): rewards = scores − β·KL·m.
    Returns (token_level_rewards, current_kl = mean over sequences of the per-sequence masked mean KL)."""
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * response_mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()
    return rewards, current_kl


class FixedKLController:
    """Constant KL coefficient (algorithm.kl_ctrl.type=fixed)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019): β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"`target_kl` and `horizon` must be positive, got {target_kl}, {horizon}")
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


def get_kl_controller(k: KLCtrlConfig) -> FixedKLController | AdaptiveKLController:
    """Build from algorithm.kl_ctrl {type: fixed|adaptive, kl_coef, target_kl, horizon}."""
    kind = k.type
    if kind == "fixed":
        return FixedKLController(k.kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    raise ValueError(f"unknown `kl_ctrl.type` {kind!r}; accepted: ['fixed', 'adaptive']")
