"""Advantage estimators against hand-computed values and plain Python reference loops."""
import math

import numpy as np
import pytest
import torch

from verl_arpo.algos import core_algos as ca


def _outcome(scores, length=4, valid=None):
    """token_level_rewards with each score on the last valid token; mask of `valid` lengths."""
    valid = valid or [length] * len(scores)
    r = torch.zeros(len(scores), length)
    m = torch.zeros(len(scores), length)
    for i, (s, v) in enumerate(zip(scores, valid)):
        r[i, v - 1] = s
        m[i, :v] = 1
    return r, m


def test_grpo_matches_hand_values_std_and_drgrpo():
    r, m = _outcome([1, 0, 1, 1, 0, 0.5])
    index = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    adv, ret = ca.compute_grpo_outcome_advantage(r, m, index)
    # group a: mean 2/3, unbiased std sqrt(1/3); group b: mean 0.5, std 0.5
    want = [0.57735, -1.15470, 0.57735, 1.0, -1.0, 0.0]
    assert adv[:, 0].tolist() == pytest.approx(want, abs=1e-4)
    assert torch.equal(adv, ret)
    adv_dr, _ = ca.compute_grpo_outcome_advantage(r, m, index, norm_adv_by_std_in_grpo=False)
    assert adv_dr[:, 0].tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.5, -0.5, 0.0], abs=1e-6)


def test_grpo_broadcasts_over_valid_tokens_only_and_singletons():
    r, m = _outcome([2.0, 1.0, 3.0], length=5, valid=[5, 2, 3])
    index = np.array([0, 0, 7], dtype=object)  # uid 7 is a group of one: mean 0, std 1
    adv, _ = ca.compute_grpo_outcome_advantage(r, m, index, epsilon=0.0)
    std01 = math.sqrt(((2 - 1.5) ** 2 + (1 - 1.5) ** 2) / 1)
    assert adv[0].tolist() == pytest.approx([0.5 / std01] * 5)
    assert adv[1].tolist() == pytest.approx([-0.5 / std01] * 2 + [0, 0, 0])
    assert adv[2].tolist() == pytest.approx([3.0] * 3 + [0, 0])


def test_grpo_bad_index_length_names_argument():
    r, m = _outcome([1, 0])
    with pytest.raises(ValueError, match="index"):
        ca.compute_grpo_outcome_advantage(r, m, np.array(["a"], dtype=object))
    with pytest.raises(ValueError, match="response_mask"):
        ca.compute_grpo_outcome_advantage(r, m[:, :2], np.array(["a", "a"], dtype=object))


def test_rloo_leave_one_out():
    r, m = _outcome([1.0, 0.0, 2.0, 5.0])
    index = np.array([0, 0, 0, 1], dtype=object)
    adv, _ = ca.compute_rloo_outcome_advantage(r, m, index)
    # A_i = s_i - mean of the others; singleton keeps its score
    assert adv[:, 0].tolist() == pytest.approx([1 - 1.0, 0 - 1.5, 2 - 0.5, 5.0])


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain loop over the valid positions of each row only (masked positions removed)."""
    B, T = rewards.shape
    adv = torch.zeros(B, T)
    ret = torch.zeros(B, T)
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t] > 0]
        last = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            nv = values[b, pos[k + 1]].item() if k + 1 < len(pos) else 0.0
            delta = rewards[b, t].item() + gamma * nv - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t] = last
            ret[b, t] = last + values[b, t].item()
    valid = [adv[b, t].item() for b in range(B) for t in range(T) if mask[b, t] > 0]
    mu = sum(valid) / len(valid)
    var = sum((v - mu) ** 2 for v in valid) / (len(valid) - 1)
    white = (adv - mu) / math.sqrt(var + 1e-8) * mask
    return white, ret


def test_gae_matches_reference_loop_with_tool_result_gaps():
    g = torch.Generator().manual_seed(0)
    B, T = 3, 9
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[0, 3:6] = 0  # a <result> block in the middle
    mask[1, 7:] = 0  # padding
    mask[2, 1:3] = 0
    mask[2, 6:] = 0
    adv, ret = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    want_adv, want_ret = _gae_reference(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(adv, want_adv, atol=1e-5)
    assert torch.allclose(ret * mask, want_ret * mask, atol=1e-5)


def test_gae_masked_positions_do_not_change_advantages():
    g = torch.Generator().manual_seed(1)
    T = 6
    rewards = torch.randn(2, T, generator=g)
    values = torch.randn(2, T, generator=g)
    mask = torch.ones(2, T)
    # Insert a 3-token tool result with arbitrary rewards/values: advantages on the model's tokens
    # must equal those of the sequence without it.
    ins_r, ins_v = torch.randn(2, 3, generator=g) * 10, torch.randn(2, 3, generator=g) * 10
    r2 = torch.cat([rewards[:, :2], ins_r, rewards[:, 2:]], dim=1)
    v2 = torch.cat([values[:, :2], ins_v, values[:, 2:]], dim=1)
    m2 = torch.cat([mask[:, :2], torch.zeros(2, 3), mask[:, 2:]], dim=1)
    a1, _ = ca.compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.9)
    a2, _ = ca.compute_gae_advantage_return(r2, v2, m2, gamma=0.95, lam=0.9)
    keep = m2.bool()
    assert torch.allclose(a2[keep].view(2, T), a1, atol=1e-5)
    assert torch.all(a2[~keep] == 0)


def test_reinforce_plus_plus_carries_return_across_tool_results():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float)
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # row 0 valid tokens t=0,1,4 with reward 1 at t=4: G = [0.25, 0.5, 1]; row 1: [0.5, 1, 2]
    assert ret[0].tolist() == pytest.approx([0.25, 0.5, 0, 0, 1.0, 0])
    assert ret[1].tolist() == pytest.approx([0.5, 1.0, 2.0, 0, 0, 0])
    vals = [0.25, 0.5, 1.0, 0.5, 1.0, 2.0]
    mu = sum(vals) / 6
    sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / 5)
    assert adv[0, 4].item() == pytest.approx((1.0 - mu) / sd, rel=1e-4)
    assert adv[0, 2].item() == 0.0


def test_registries_and_unknown_names():
    assert ca.get_adv_estimator_fn("grpo") is ca.compute_grpo_outcome_advantage
    assert ca.get_adv_estimator_fn("gae") is ca.compute_gae_advantage_return
    with pytest.raises(ValueError, match="adv_estimator.*accepted.*grpo"):
        ca.get_adv_estimator_fn("nope")

    @ca.register_adv_est("test_const")
    def const(token_level_rewards, response_mask, **kw):
        return response_mask, response_mask

    try:
        assert ca.get_adv_estimator_fn("test_const") is const
        with pytest.raises(ValueError, match="already registered"):
            ca.register_adv_est("test_const")(lambda: None)
    finally:
        ca.ADV_ESTIMATOR_REGISTRY.pop("test_const")


def test_entropy_aware_advantage():
    adv = torch.tensor([[1.0, 1.0, 1.0, 5.0], [-2.0, -2.0, 0.0, 0.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out = ca.compute_entropy_aware_advantage(adv, ent, mask, alpha=0.5)
    h = [1.0, 2.0, 3.0, 4.0, 5.0]  # only masked tokens enter the statistics
    mu = 3.0
    sd = math.sqrt(sum((x - mu) ** 2 for x in h) / 4)
    assert out[0, 0].item() == pytest.approx(1.0 * (1 + 0.5 * (1 - mu) / sd))
    assert out[1, 1].item() == pytest.approx(-2.0 * (1 + 0.5 * (5 - mu) / sd))
    assert out[0, 3].item() == pytest.approx(5.0 * (1 + 0.5 * (100 - mu) / sd))  # formula applies everywhere
    # std == 0 → std treated as 1 → z = 0 → unchanged
    same = ca.compute_entropy_aware_advantage(adv, torch.full_like(ent, 2.0), mask, alpha=0.5)
    assert torch.equal(same, adv)
    # alpha is configurable: alpha 0 is the identity
    assert torch.equal(ca.compute_entropy_aware_advantage(adv, ent, mask, alpha=0.0), adv)
    # empty mask → unchanged
    assert torch.equal(ca.compute_entropy_aware_advantage(adv, ent, torch.zeros_like(mask)), adv)
