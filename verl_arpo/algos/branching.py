"""Entropy measures and branch rules of ARPO and AEPO, in the order they act (docs/algorithms.md,
"ARPO: entropy-based adaptive rollout" and "AEPO 1: dynamic entropy-balanced rollout").

Symbols follow the papers (ARPO arXiv 2507.19849, AEPO arXiv 2510.14545):
    H_k      round entropy of trajectory k: entropy of the first ≤ `window` tokens it generated this
             round (right after the previous `</result>`, or at the response start)
    H0_k     base entropy (H_initial): the first round entropy of trajectory k. Under after_result a
             branch inherits it; under before_call a branch records its own, so its first ΔH is 0.
    ΔH_k     H_k − H0_k
    n        rollout.n, trajectories per prompt at the end
    m0       initial trajectories per prompt: min(initial_rollouts, n), or m_i under AEPO's
             pre-monitoring. GRPO is the case initial_rollouts = n (never a free slot, never a branch).

When ΔH is measured (`rollout.entropy_timing`, docs/algorithms.md "When the entropy is measured"):
    after_result  (default, the paper's timing) the draw for tool step t uses H_t, the entropy of the
                  first `window` tokens generated *after* tool result t, against H_initial, the first
                  round's; branches fork at the tool-result boundary and sample their own continuation.
                  A branch inherits H_initial (its first round is its parent's).
    before_call   (the reference's) the draw after call t uses the round that *ended* in call t, so
                  every first-call draw has ΔH = 0; a branch records its own H0.

Branch rules (`rollout.branch_rule`, one draw each; `rng` is the rollout's seeded numpy Generator;
each returns a `BranchDraw`: whether it fired, the probability that it fires at this ΔH, the uniform):
    arpo:  p = clip(branch_probability + entropy_weight·ΔH, 0, 1);   branch iff U < p
    aepo:  p = clip((U + entropy_weight·ΔH)·max(0, 1 − γ·c_i), 0, 1); branch iff p ≥ branch_probability
           c_i = consecutive rounds in which prompt i gained a new trajectory (branch penalty).
           Here branch_probability is a *threshold* (≈ 1 − a probability); at ΔH = 0, c_i = 0 the
           two rules branch equally often only when branch_probability = 0.5.
    none:  never (GRPO; chosen by the loop when no slot can be free).
AEPO pre-monitoring (`rollout.enable_dynamic_rollouts`, independent of the rule):
    m_i = clamp(floor(n·σ(β·(H_root − H̄))) + 1, 1, n), H_root measured like a round entropy
    (same measure, same 20-token window) on a short generation, as in the reference.

Fixes against the reference code: base entropies live on each trajectory and so reset on every
generate call (the reference kept a dict across batches, comparing later steps with unrelated
samples); every draw comes from a seeded generator, so a tree is reproducible from `rollout.seed`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from verl_arpo.config.rollout import EntropyMode
from verl_arpo.config.typed import choices

ENTROPY_MODES = choices(EntropyMode)   # the config's Literal: one list of accepted names


class BranchDraw(NamedTuple):
    """One draw of a branch rule: `fired`, `p` = P(fire | ΔH, c_i) under the rule, `u` its uniform."""

    fired: bool
    p: float
    u: float


# --------------------------------------------------------------------------------------------
# Entropy of one round
# --------------------------------------------------------------------------------------------
def topk_proxy_entropy(topk_logprobs: Sequence[Sequence[float]], vocab_size: int, window: int = 20) -> float:
    """The reference's measure: Σ_{t<window} (−Σ_{j∈S_t} p_tj·log p_tj) / ln|V|.

    S_t is the row the engine reports at position t: the top-k log-probs plus the sampled token's
    when it is not among them (engines.base.topk_with_sampled), as the reference's vLLM log-prob
    dicts were. Sums (does not average) over positions, so longer windows give larger values;
    kept for comparability with published ARPO numbers.
    """
    total = 0.0
    for row in topk_logprobs[:window]:
        total += -sum(math.exp(lp) * lp for lp in row if lp > -math.inf)
    return total / math.log(vocab_size)


def full_entropy(entropies: Sequence[float] | None, window: int = 20) -> float:
    """Mean exact full-vocabulary entropy over the first ≤ window positions (0.0 for none)."""
    if entropies is None:
        raise ValueError("actor_rollout_ref.rollout.entropy_mode=full needs exact entropies, which this engine "
                         "does not return; use entropy_mode=topk_proxy")
    head = list(entropies[:window])
    return float(sum(head) / len(head)) if head else 0.0


def round_entropy(output, mode: str, vocab_size: int, window: int = 20) -> float:
    """H_k of one engine output (`GenOutput`) under `mode` (`topk_proxy` or `full`)."""
    if mode == "topk_proxy":
        return topk_proxy_entropy(output.topk_logprobs, vocab_size, window)
    if mode == "full":
        return full_entropy(output.entropy, window)
    raise ValueError(f"unknown actor_rollout_ref.rollout.entropy_mode={mode!r}; accepted: {list(ENTROPY_MODES)}")


# --------------------------------------------------------------------------------------------
# Branch rules (a registry: a new rule is one registered function)
# --------------------------------------------------------------------------------------------
BRANCH_RULES: dict[str, Callable[..., BranchDraw]] = {}


def register_branch_rule(name: str) -> Callable:
    def deco(fn: Callable[..., BranchDraw]) -> Callable[..., BranchDraw]:
        BRANCH_RULES[name] = fn
        return fn

    return deco


def get_branch_rule(name: str) -> Callable[..., BranchDraw]:
    if name not in BRANCH_RULES:
        raise ValueError(f"unknown branching policy {name!r}; accepted: {sorted(BRANCH_RULES)}")
    return BRANCH_RULES[name]


@register_branch_rule("none")
def no_branch(rng: np.random.Generator, delta_h: float, consecutive: int, *, branch_probability: float,
              entropy_weight: float, penalty_gamma: float) -> BranchDraw:
    """GRPO: trajectories never branch (no uniform is consumed)."""
    return BranchDraw(False, 0.0, float("nan"))


def arpo_branch_probability(delta_h: float, branch_probability: float, entropy_weight: float) -> float:
    """p = clip(branch_probability + entropy_weight·ΔH, 0, 1)."""
    return min(1.0, max(0.0, branch_probability + entropy_weight * delta_h))


@register_branch_rule("arpo")
def arpo_branch(rng: np.random.Generator, delta_h: float, consecutive: int, *, branch_probability: float,
                entropy_weight: float, penalty_gamma: float) -> BranchDraw:
    """ARPO: branch with probability clip(branch_probability + entropy_weight·ΔH, 0, 1)."""
    u, p = float(rng.random()), arpo_branch_probability(delta_h, branch_probability, entropy_weight)
    return BranchDraw(u < p, p, u)


def aepo_branch_score(u: float, delta_h: float, consecutive: int, entropy_weight: float, penalty_gamma: float) -> float:
    """p = clip((U + entropy_weight·ΔH)·max(0, 1 − γ·c_i), 0, 1)."""
    penalty = max(0.0, 1.0 - penalty_gamma * consecutive)
    return min(1.0, max(0.0, (u + entropy_weight * delta_h) * penalty))


def aepo_fire_probability(delta_h: float, consecutive: int, threshold: float, entropy_weight: float,
                          penalty_gamma: float) -> float:
    """P(aepo_branch_score(U, …) ≥ threshold) for U ~ U[0, 1).

    With q = max(0, 1 − γ·c_i): score ≥ τ ⟺ U ≥ τ/q − w·ΔH (for τ ≤ 1; the clip at 1 changes nothing
    then), so P = clip(1 − τ/q + w·ΔH, 0, 1); q = 0 fires only when τ ≤ 0.
    """
    q = max(0.0, 1.0 - penalty_gamma * consecutive)
    if q == 0.0:
        return 1.0 if threshold <= 0.0 else 0.0
    return min(1.0, max(0.0, 1.0 - threshold / q + entropy_weight * delta_h))


@register_branch_rule("aepo")
def aepo_branch(rng: np.random.Generator, delta_h: float, consecutive: int, *, branch_probability: float,
                entropy_weight: float, penalty_gamma: float) -> BranchDraw:
    """AEPO: branch iff clip((U + w·ΔH)·max(0, 1 − γ·c_i), 0, 1) ≥ branch_probability (a threshold)."""
    u = float(rng.random())
    score = aepo_branch_score(u, delta_h, consecutive, entropy_weight, penalty_gamma)
    p = aepo_fire_probability(delta_h, consecutive, branch_probability, entropy_weight, penalty_gamma)
    return BranchDraw(score >= branch_probability, p, u)


# --------------------------------------------------------------------------------------------
# Initial budget
# --------------------------------------------------------------------------------------------
def initial_rollout_count(n: int, initial_rollouts: int | None) -> int:
    """m0 = min(initial_rollouts, n) (initial_rollouts None or ≤ 0 means n: plain GRPO)."""
    if initial_rollouts is None or initial_rollouts <= 0:
        return n
    return min(initial_rollouts, n)


def dynamic_initial_rollouts(n: int, h_root: float, h_mean: float, beta: float = 0.5) -> int:
    """AEPO: m_i = clamp(floor(n·σ(β·(H_root − H̄))) + 1, 1, n).

    A prompt whose first tokens are more uncertain than its tool-using rounds gets more independent
    samples (global exploration); one whose rounds are the uncertain part keeps slots for branching.
    """
    sig = 1.0 / (1.0 + math.exp(-beta * (h_root - h_mean)))
    return int(min(n, max(1, math.floor(n * sig) + 1)))
