"""The statistics every report uses, as pure functions: pass@k and the Wilson interval (main_eval,
validation), the paired gain over questions (the quickstart's summary) and the intervals of the
algorithm comparison (docs/results.md, "How the comparison runs"). One source, so the README, the
quickstart's summary and the comparison quote the same interval for the same numbers.

A comparison has K seed pairs; in pair k both arms trained on the same prompts in the same order and
answered the same Q questions, so `diff[k, q]` = score of A − score of B on question q in pair k.

- `seed_t_interval` (the primary one): the mean of the K per-pair mean differences d_k, ± t_{0.975,
  K−1}·sd(d)/√K. The unit of replication is the seed pair, the thing an experimenter can repeat;
  its width carries the variance between seeds, which dominates with few pairs.
- `paired_bootstrap`: resample pairs, then questions (the same questions in every drawn pair). With
  few pairs it understates the variance between seeds (a resample of 4 values has few distinct
  means), so it is reported beside the primary interval, never instead of it. With K = 1 (one run,
  the quickstart) it is the ordinary paired bootstrap over questions: `paired_gain`.
- `cluster_bootstrap`: as paired_bootstrap, but questions are resampled by template (the generator's
  25 question templates), since questions made from one template are not independent.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["pass_at_k", "wilson_interval", "paired_gain", "t975", "seed_t_interval", "paired_bootstrap",
           "cluster_bootstrap", "mean_interval", "N_BOOT"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 − C(n−c, k)/C(n, k) for n samples with c correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def wilson_interval(p_hat: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion p_hat observed over n trials."""
    if n == 0:
        return (0.0, 1.0)
    denom = 1 + z * z / n
    centre = (p_hat + z * z / (2 * n)) / denom
    half = z * math.sqrt(p_hat * (1 - p_hat) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_gain(before: list[float], after: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean gain of `after` over `before` on the same questions and its 95% interval: the paired
    bootstrap over questions of one run (`paired_bootstrap` with K = 1), the interval the comparison
    reports for a single seed pair."""
    if len(before) != len(after) or not before:
        raise ValueError(f"a paired gain needs the same questions on both sides, got {len(before)} and {len(after)}")
    return paired_bootstrap(np.asarray(after, dtype=float) - np.asarray(before, dtype=float), seed=seed)


N_BOOT = 4000

# two-sided 95% quantiles of Student's t, t_{0.975, df}, df = 1..30 (the standard table)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """t_{0.975, df}: the table up to 30, then the normal quantile plus its first correction."""
    if df < 1:
        raise ValueError(f"a t-interval needs df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.95996 + 2.4 / df


def seed_t_interval(diff: np.ndarray) -> tuple[float, float, float]:
    """Mean and 95% t-interval over seed pairs of the per-pair mean difference:
    d_k = mean_q diff[k, q];  d̄ ± t_{0.975, K−1}·s_d/√K.  K = 1 has no interval (nan bounds)."""
    per_pair = np.atleast_2d(np.asarray(diff, dtype=float)).mean(axis=1)
    k, m = len(per_pair), float(per_pair.mean())
    if k < 2:
        return m, float("nan"), float("nan")
    half = t975(k - 1) * float(per_pair.std(ddof=1)) / math.sqrt(k)
    return m, m - half, m + half


def paired_bootstrap(diff: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """Mean and 95% percentile interval of a paired difference over questions x seed pairs.

    One replicate draws K pairs with replacement, then Q questions with replacement (the same
    questions in every drawn pair: a question's difficulty is shared by all runs), and takes the
    mean of diff over that K x Q grid. With K = 1 this is the ordinary paired bootstrap over questions.
    """
    diff = np.atleast_2d(np.asarray(diff, dtype=float))
    k, q = diff.shape
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for start in range(0, n_boot, 500):  # chunks bound memory at 500 x K x Q
        r = min(500, n_boot - start)
        ks = rng.integers(0, k, size=(r, k))
        qs = rng.integers(0, q, size=(r, q))
        means[start:start + r] = diff[ks[:, :, None], qs[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(lo), float(hi)


def cluster_bootstrap(diff: np.ndarray, clusters, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """As paired_bootstrap, with questions drawn by cluster: one replicate draws K pairs and C of the
    C clusters (templates) with replacement and averages diff over every question of the drawn
    clusters (a cluster drawn twice counts twice), i.e. the ratio estimator of a cluster sample."""
    diff = np.atleast_2d(np.asarray(diff, dtype=float))
    labels = np.asarray(clusters)
    names = sorted(set(labels.tolist()))
    k = diff.shape[0]
    sums = np.stack([diff[:, labels == c].sum(axis=1) for c in names], axis=1)   # K x C
    sizes = np.array([(labels == c).sum() for c in names], dtype=float)           # C
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for i in range(n_boot):
        ks = rng.integers(0, k, size=k)
        cs = rng.integers(0, len(names), size=len(names))
        means[i] = sums[np.ix_(ks, cs)].sum() / (k * sizes[cs].sum())
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(lo), float(hi)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean of per-seed-pair values and the range over pairs (a count per run, not a per-question
    score, so there is nothing to resample within a run)."""
    return float(np.mean(values)), float(np.min(values)), float(np.max(values))
