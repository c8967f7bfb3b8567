"""Policy/value/KL losses against plain per-token reference loops and autograd checks."""
import math

import pytest
import torch

from verl_arpo.algos import core_algos as ca


def _agg_reference(L, m, mode):
    B, T = len(L), len(L[0])
    if mode == "token-mean":
        num = sum(L[b][t] for b in range(B) for t in range(T) if m[b][t])
        return num / max(1, sum(m[b][t] for b in range(B) for t in range(T)))
    per_seq = []
    for b in range(B):
        toks = [L[b][t] for t in range(T) if m[b][t]]
        if not toks:
            continue
        if mode == "seq-mean-token-sum":
            per_seq.append(sum(toks))
        elif mode == "seq-mean-token-mean":
            per_seq.append(sum(toks) / len(toks))
        else:
            per_seq.append(sum(toks) / T)
    return sum(per_seq) / len(per_seq)


def _pg_reference(old, new, adv, mask, eps_l, eps_h, c, mode):
    """Per-token loop of the dual-clip PPO loss."""
    B, T = old.shape
    L = [[0.0] * T for _ in range(B)]
    clipped_hi = lower = n = kl = 0
    for b in range(B):
        for t in range(T):
            a = adv[b, t].item()
            d = max(-20.0, min(20.0, new[b, t].item() - old[b, t].item()))
            r = math.exp(d)
            l1 = -a * r
            l2 = -a * min(max(r, 1 - eps_l), 1 + eps_h)
            lc = max(l1, l2)
            loss = min(-a * c, lc) if a < 0 else lc
            L[b][t] = loss
            if mask[b, t]:
                n += 1
                kl += -d
                clipped_hi += l2 > l1
                lower += (lc > -a * c) and a < 0
    m = mask.tolist()
    return _agg_reference(L, m, mode), clipped_hi / n, kl / n, lower / n


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    B, T = 4, 7
    old = torch.randn(B, T, generator=g) - 2
    new = old + torch.randn(B, T, generator=g) * 0.6  # ratios well outside [0.8, 1.2] too
    adv = torch.randn(B, T, generator=g) * 2
    mask = torch.ones(B, T)
    mask[0, 5:] = 0
    mask[2, 2:4] = 0
    mask[3, :] = 0
    mask[3, 0] = 1
    return old, new, adv, mask


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_policy_loss_matches_reference_loop(batch, mode):
    old, new, adv, mask = batch
    got = ca.compute_policy_loss(old, new, adv, mask, cliprange_low=0.2, cliprange_high=0.28,
                                 clip_ratio_c=3.0, loss_agg_mode=mode)
    want = _pg_reference(old, new, adv, mask, 0.2, 0.28, 3.0, mode)
    for g_, w_ in zip(got, want):
        assert g_.item() == pytest.approx(w_, rel=1e-5, abs=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 2)
    new = torch.tensor([[3.0, 3.0]])  # r = e^3 ≈ 20
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    pg, _, _, lower = ca.compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    # token 0: A<0, L1 = e^3 ≈ 20.09 > c·|A| = 3 → 3 ; token 1: A>0 → −1.2
    assert pg.item() == pytest.approx((3.0 - 1.2) / 2)
    assert lower.item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(old, new, adv, mask, clip_ratio_c=1.0)


def test_agg_loss_modes_and_dp_arguments():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert ca.agg_loss(L, m, "token-mean").item() == pytest.approx(10 / 4)
    assert ca.agg_loss(L, m, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert ca.agg_loss(L, m, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert ca.agg_loss(L, m, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    # Two ranks each holding one row: Σ_ranks(loss)/dp equals the single-rank global loss.
    halves = [ca.agg_loss(L[i:i + 1], m[i:i + 1], "token-mean", dp_size=2, batch_num_tokens=4) for i in (0, 1)]
    assert (sum(halves) / 2).item() == pytest.approx(10 / 4)
    halves = [ca.agg_loss(L[i:i + 1], m[i:i + 1], "seq-mean-token-mean", dp_size=2, global_batch_size=2)
              for i in (0, 1)]
    assert (sum(halves) / 2).item() == pytest.approx(3.0)
    assert ca.agg_loss(L, torch.zeros_like(m), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="loss_agg_mode.*accepted"):
        ca.agg_loss(L, m, "mean")
    with pytest.raises(ValueError, match="loss_mask"):
        ca.agg_loss(L, m[:, :2], "token-mean")


def test_aepo_clipping_same_forward_and_gradient_rule():
    eps = 0.2
    old = torch.zeros(1, 6)
    # ratios: 1.5 (above 1+ε), 1.0 (inside), 0.5 (below 1−ε) for A>0 and A<0
    log_r = torch.log(torch.tensor([[1.5, 1.0, 0.5, 1.5, 1.0, 0.5]]))
    adv = torch.tensor([[2.0, 2.0, 2.0, -3.0, -3.0, -3.0]])
    mask = torch.ones(1, 6)
    grads, losses = [], []
    for balanced in (False, True):
        new = log_r.clone().requires_grad_(True)
        loss, *_ = ca.compute_policy_loss(old, new, adv, mask, cliprange=eps, clip_ratio_c=10.0,
                                          loss_agg_mode="seq-mean-token-sum", entropy_balanced_clipping=balanced)
        loss.backward()
        grads.append(new.grad[0].clone())
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1])  # same forward value
    std, bal = grads
    # d/dlogπ of −A·r is −A·r. Standard: clipped tokens have zero gradient.
    assert std.tolist() == pytest.approx([0.0, -2.0, -1.0, 4.5, 3.0, 0.0])
    # Balanced: A>0 and r>1+ε gets −A·(1+ε)·∇logπ; everything else unchanged.
    assert bal[0].item() == pytest.approx(-2.0 * (1 + eps))
    assert bal[1:].tolist() == pytest.approx(std[1:].tolist())
    assert ca.get_policy_loss_fn("entropy_balanced") is ca.compute_policy_loss_entropy_balanced
    with pytest.raises(ValueError, match="loss_mode.*vanilla"):
        ca.get_policy_loss_fn("ppo2")


def test_registered_policy_losses_read_config(batch):
    old, new, adv, mask = batch
    cfg = ca.ActorConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=2.5)
    got = ca.get_policy_loss_fn("vanilla")(old, new, adv, mask, "token-mean", cfg)
    want = _pg_reference(old, new, adv, mask, 0.1, 0.3, 2.5, "token-mean")
    assert got[0].item() == pytest.approx(want[0], rel=1e-5)


def test_kl_penalty_variants():
    lp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = [0.5, -1.0, 0.0]
    assert ca.kl_penalty(lp, ref, "kl").tolist() == pytest.approx(d)
    assert ca.kl_penalty(lp, ref, "k1").tolist() == pytest.approx(d)
    assert ca.kl_penalty(lp, ref, "abs").tolist() == pytest.approx([abs(x) for x in d])
    assert ca.kl_penalty(lp, ref, "mse").tolist() == pytest.approx([0.5 * x * x for x in d])
    k3 = [math.exp(-x) + x - 1 for x in d]  # exp(ref−lp) − (ref−lp) − 1
    assert ca.kl_penalty(lp, ref, "low_var_kl").tolist() == pytest.approx(k3)
    assert ca.kl_penalty(lp, ref, "k3").tolist() == pytest.approx(k3)
    big = ca.kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3")
    assert big.item() == 10.0  # clamped
    with pytest.raises(NotImplementedError, match="low_var_kl"):
        ca.kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match="kl_penalty.*accepted"):
        ca.kl_penalty(lp, ref, "k9")


def test_value_loss_and_entropy_loss():
    vpreds = torch.tensor([[1.0, 2.0, 0.0]])
    values = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, frac = ca.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    # t0: unclipped (1−0)²=1, clipped (0.5−0)²=0.25 → 1 ; t1: (2−1)²=1 both → 1
    assert loss.item() == pytest.approx(0.5 * (1 + 1) / 2)
    assert frac.item() == 0.0
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    ent = ca.compute_entropy_loss(logits, torch.tensor([[1, 1]]))
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert ent.item() == pytest.approx((math.log(2) + h2) / 2)


def test_kl_controllers():
    from verl_arpo.config import KLCtrlConfig

    fixed = ca.get_kl_controller(KLCtrlConfig(type="fixed", kl_coef=0.1))
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    ad = ca.get_kl_controller(KLCtrlConfig(type="adaptive", kl_coef=0.1, target_kl=0.5, horizon=100))
    ad.update(current_kl=1.0, n_steps=10)  # error clipped to 0.2 → ×1.02
    assert ad.value == pytest.approx(0.1 * 1.02)
    ad.update(current_kl=0.45, n_steps=10)  # error −0.1 → ×0.99
    assert ad.value == pytest.approx(0.1 * 1.02 * 0.99)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        ca.get_kl_controller(KLCtrlConfig(type="pid"))
