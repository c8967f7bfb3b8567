"""Numerical parity with verl itself: the reference verl 0.9.1, which `scripts/test.sh` installs
(`--no-deps`, scripts/setup_env.sh `setup_reference_verl`), never vendored. Under test.sh it runs in the
default suite (`VERL_ARPO_REQUIRE_VERL=1`: a missing verl fails instead of skipping); a bare pytest in
an environment without verl skips it.

Only cases where we promise identical numerics are compared: contiguous response masks (verl's
REINFORCE++ resets at interior masked positions; we carry across them, see core_algos).
"""
import os

import numpy as np
import pytest
import torch

if os.environ.get("VERL_ARPO_REQUIRE_VERL") == "1":
    import verl.trainer.ppo.core_algos as verl_algos
else:
    verl_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

from verl_arpo.algos import core_algos as ours  # noqa: E402


def _inputs(seed=0, B=6, T=10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, generator=g)
    index = np.array([i // 3 for i in range(B)], dtype=object)
    return g, rewards, mask, index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_and_gae_equal_verl(seed):
    g, rewards, mask, index = _inputs(seed)
    a, _ = ours.compute_grpo_outcome_advantage(rewards, mask, index)
    b, _ = verl_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    assert torch.allclose(a, b, atol=1e-5)
    values = torch.randn(rewards.shape, generator=g)
    a, ra = ours.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    b, rb = verl_algos.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    assert torch.allclose(a * mask, b * mask, atol=1e-4)
    assert torch.allclose(ra * mask, rb * mask, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_policy_loss_and_kl_equal_verl(seed):
    g, _, mask, _ = _inputs(seed)
    old = torch.randn(mask.shape, generator=g)
    new = old + 0.3 * torch.randn(mask.shape, generator=g)
    adv = torch.randn(mask.shape, generator=g)
    mine = ours.compute_policy_loss(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    fn = getattr(verl_algos, "compute_policy_loss", None)
    if fn is None:
        pytest.skip("this verl has no 4-tuple compute_policy_loss")
    theirs = fn(old, new, adv, mask, cliprange=0.2, clip_ratio_c=3.0)
    for x, y in zip(mine, theirs):
        assert torch.allclose(torch.as_tensor(x), torch.as_tensor(y), atol=1e-5)
    for kind in ("kl", "abs", "mse", "low_var_kl"):
        assert torch.allclose(ours.kl_penalty(new, old, kind), verl_algos.kl_penalty(new, old, kind), atol=1e-6)
