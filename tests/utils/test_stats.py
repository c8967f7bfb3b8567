"""verl_arpo/utils/stats.py, the one source of the reports' statistics: the quickstart's paired gain
against a plain reference loop and the normal approximation it replaced; the names main_eval and the
validation metrics re-export are the same functions."""
import math
import random

import numpy as np
import pytest

from verl_arpo.utils import stats


def _reference_paired_bootstrap(diff, n_boot, seed):
    """Resample questions with replacement, mean of each resample, 2.5 / 97.5 percentiles (numpy's
    default linear interpolation), drawing exactly as stats.paired_bootstrap does with one pair."""
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, n_boot, 500):
        r = min(500, n_boot - start)
        rng.integers(0, 1, size=(r, 1))   # the pair draw (one pair: always 0)
        qs = rng.integers(0, len(diff), size=(r, len(diff)))
        means += [sum(diff[q] for q in row) / len(row) for row in qs.tolist()]
    lo, hi = np.percentile(means, [2.5, 97.5])
    return lo, hi


def test_paired_gain_is_the_one_pair_bootstrap_and_close_to_the_normal_interval():
    g = random.Random(7)
    before = [float(g.random() < 0.8) for _ in range(600)]
    after = [float(b if g.random() < 0.9 else 1 - b) for b in before]
    diff = [a - b for a, b in zip(after, before)]
    mean, lo, hi = stats.paired_gain(before, after)
    assert mean == pytest.approx(sum(diff) / len(diff), abs=1e-12)
    want_lo, want_hi = _reference_paired_bootstrap(diff, stats.N_BOOT, 0)
    assert (lo, hi) == pytest.approx((want_lo, want_hi), abs=1e-12)
    # the normal approximation the quickstart used before: the same interval to within a few percent
    sd = math.sqrt(sum((d - mean) ** 2 for d in diff) / (len(diff) - 1))
    half = 1.96 * sd / math.sqrt(len(diff))
    assert (hi - lo) / (2 * half) == pytest.approx(1.0, abs=0.1)
    with pytest.raises(ValueError, match="same questions"):
        stats.paired_gain(before, after[:-1])


def test_the_reexported_names_are_the_same_functions():
    from verl_arpo.trainer import main_eval
    from verl_arpo.trainer.ppo import metrics

    assert main_eval.pass_at_k is stats.pass_at_k is metrics.pass_at_k
    assert main_eval.wilson_interval is stats.wilson_interval
