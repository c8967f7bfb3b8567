"""Rollout–training mismatch metrics and truncated importance weights against hand computation."""
import math

import pytest
import torch

from verl_arpo.algos.core_algos import compute_policy_loss
from verl_arpo.algos.rollout_mismatch import mismatch_metrics, rollout_is_weights

OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.3, -4.0, 0.0]])
ROLL = torch.tensor([[-1.2, -1.0, -0.5, -9.0], [-0.3, -0.1, -1.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_metrics_by_hand():
    deltas = [0.2, -1.0, 0.0, 0.0, -0.2]  # old − rollout over the valid tokens
    m = mismatch_metrics(OLD, ROLL, MASK)
    assert m["mismatch/log_prob_abs_diff"] == pytest.approx(sum(abs(d) for d in deltas) / 5)
    assert m["mismatch/kl"] == pytest.approx(sum(-d for d in deltas) / 5)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in deltas) / 5)


def test_token_and_sequence_weights_are_capped_ratios():
    w, stats = rollout_is_weights(OLD, ROLL, MASK, threshold=1.1, level="token")
    want = [[min(math.exp(0.2), 1.1), math.exp(-1.0), 1.0, 0.0], [1.0, math.exp(-0.2), 0.0, 0.0]]
    torch.testing.assert_close(w, torch.tensor(want), rtol=1e-6, atol=1e-7)
    assert stats["mismatch/rollout_is_fraction_high"] == pytest.approx(1 / 5)
    assert stats["mismatch/rollout_is_mean"] == pytest.approx(sum(sum(r) for r in want) / 5)
    w, _ = rollout_is_weights(OLD, ROLL, MASK, threshold=10.0, level="sequence")
    row0, row1 = math.exp(0.2 - 1.0 + 0.0), math.exp(0.0 - 0.2)  # exp of the summed log-ratio per sequence
    torch.testing.assert_close(w, torch.tensor([[row0] * 3 + [0.0], [row1] * 2 + [0.0, 0.0]]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="rollout_is_mode"):
        rollout_is_weights(OLD, ROLL, MASK, threshold=2.0, mode="mask")


def test_weights_scale_each_token_of_the_surrogate():
    torch.manual_seed(0)
    old = torch.randn(2, 4)
    new = (old + 0.1 * torch.randn(2, 4)).requires_grad_()
    adv = torch.randn(2, 4)
    w, _ = rollout_is_weights(old, ROLL, MASK, threshold=1.1)
    weighted, *_ = compute_policy_loss(old, new, adv, MASK, cliprange=0.2, rollout_is_weights=w)
    # for w > 0 every branch of the clipped surrogate is linear in A: L(A)·w = L(A·w)
    plain, *_ = compute_policy_loss(old, new, adv * w, MASK, cliprange=0.2)
    torch.testing.assert_close(weighted, plain)
