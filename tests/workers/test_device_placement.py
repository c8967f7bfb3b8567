"""Device placement with a non-CPU worker device, on a machine without a GPU (docs/gpu.md, "Placement").

The worker's model lives on the `meta` device — a device that is not the host and holds no data —
and every aten op runs under `SameDevice`, a dispatch mode that enforces CUDA's rule: all tensor
operands of an op on one device, except 0-dim host tensors (which CUDA kernels accept as
scalars) and the copy ops that move data between devices. So a label, mask or advantage left on the
host while the logits are on the device raises here as it would on a GPU. Meta tensors have no
values: `.item()` answers 1, a boolean mask selects every element and a copy back to the host gives
zeros (the checks are about where tensors are, not what they hold; the numerics are tested on CPU
elsewhere).

Covered: the actor's log-prob and update paths (KL loss, AEPO advantage, rollout importance weights,
dynamic and fixed micro-batches, padded and packed (`use_remove_padding`, as the 7B script trains)), the critic's value and update paths, and the driver-side
advantage computation on what the workers return. A direct forward that skips the boundary
raises, which is what the code did before the boundary existed.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from verl_arpo.protocol import DataProto
from worker_configs import actor_kwargs, critic_kwargs, log_probs

aten = torch.ops.aten
DEVICE = torch.device("meta")
_MOVES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}


class DeviceMismatch(RuntimeError):
    pass


@pytest.fixture(autouse=True)
def _meta_masks():
    """Boolean-mask indexing has a data-dependent size; on meta, assume every element selected."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


class SameDevice(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.equals = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if func is aten._local_scalar_dense.default and tensors[0].is_meta:
            t = tensors[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if func is aten.equal.default and any(t.is_meta for t in tensors):
            # aten::equal has no meta kernel; the packed path asks whether position_ids restart at
            # each row (a question about values): answer yes, as .item() answers 1 (issue 31, item 8)
            if len({t.device.type for t in tensors}) > 1:
                raise DeviceMismatch(f"{func}: operands on {sorted({t.device.type for t in tensors})}")
            self.equals += 1
            return True
        if func in _MOVES:
            if func is aten._to_copy.default and tensors[0].is_meta and kwargs.get("device") == torch.device("cpu"):
                return torch.zeros(tensors[0].shape, dtype=kwargs.get("dtype") or tensors[0].dtype)
            return func(*args, **kwargs)
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            raise DeviceMismatch(f"{func}: operands on {sorted(devices)}")
        return func(*args, **kwargs)


def _batch(vocab: int, B: int = 4, P: int = 5, R: int = 6, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    prompt_lens, resp_lens = [5, 3, 4, 2][:B], [6, 4, 5, 3][:B]
    input_ids = torch.randint(3, vocab, (B, P + R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        attn[i, P - p:P + r] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    resp_mask = attn[:, P:].float()
    lp = -torch.rand(B, R, generator=g) * resp_mask
    return DataProto.from_dict(tensors=dict(
        input_ids=input_ids, attention_mask=attn, position_ids=pos, responses=input_ids[:, P:],
        response_mask=resp_mask, old_log_probs=lp, ref_log_prob=lp - 0.1, rollout_log_probs=lp + 0.05,
        advantages=torch.randn(B, R, generator=g) * resp_mask, values=torch.randn(B, R, generator=g) * resp_mask,
        returns=torch.randn(B, R, generator=g) * resp_mask, token_level_rewards=torch.zeros(B, R)))


@pytest.fixture()
def causal_lm(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").to(DEVICE)


@pytest.mark.parametrize("use_dynamic_bsz", [False, True])
@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_actor_runs_with_a_device_model_and_returns_host_tensors(causal_lm, use_dynamic_bsz, use_remove_padding):
    from verl_arpo.config import RolloutCorrection
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

    data = _batch(causal_lm.config.vocab_size)
    cfg = dict(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=use_dynamic_bsz,
               ppo_max_token_len_per_gpu=16, use_kl_loss=True, kl_loss_coef=0.1,
               enable_entropy_balanced_advantage=True, entropy_coeff=0.01, grad_clip=1.0)
    opt = torch.optim.AdamW(causal_lm.parameters(), lr=1e-3)
    kw = actor_kwargs(**cfg)
    actor = DataParallelPPOActor(actor_module=causal_lm, actor_optimizer=opt, use_remove_padding=use_remove_padding,
                                 device=DEVICE, temperature=0.7,
                                 rollout_correction=RolloutCorrection(2.0, "token", "truncate", apply=True), **kw)
    mode = SameDevice()
    with mode:
        log_probs, entropy = actor.compute_log_prob(data, kw["update"], calculate_entropy=True)
        metrics = actor.update_policy(data)
    assert mode.ops > 100  # the forward, backward and step all went through the checks
    assert (mode.equals > 0) == use_remove_padding  # the packed path ran (it checks position_ids first)
    assert log_probs.device.type == entropy.device.type == "cpu"
    assert log_probs.shape == entropy.shape == data.batch["responses"].shape
    assert {"actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "mismatch/log_prob_abs_diff",
            "mismatch/rollout_is_mean"} <= set(metrics)
    assert all(p.device == DEVICE for p in causal_lm.parameters())


def test_critic_runs_with_a_device_model_and_returns_host_tensors(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForTokenClassification

    from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic

    cfg = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, config=cfg).to(DEVICE)
    data = _batch(cfg.vocab_size)
    critic = DataParallelPPOCritic(critic_module=model, critic_optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                   device=DEVICE, **critic_kwargs(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1))
    with SameDevice():
        values = critic.compute_values(data)
        metrics = critic.update_critic(data)
    assert values.device.type == "cpu" and values.shape == data.batch["responses"].shape
    assert {"critic/vf_loss", "critic/grad_norm"} <= set(metrics)


def test_driver_side_advantages_on_what_the_workers_return(causal_lm):
    """The driver computes advantages from worker outputs and its own masks: all on the host."""
    from verl_arpo.algos import core_algos
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

    data = _batch(causal_lm.config.vocab_size)
    actor = DataParallelPPOActor(None, causal_lm, device=DEVICE)
    with SameDevice():
        old_log_probs, _ = actor.compute_log_prob(data, log_probs(2))
        mask = data.batch["response_mask"]
        rewards = torch.zeros_like(mask)
        rewards[:, 0] = 1.0
        adv, ret = core_algos.compute_gae_advantage_return(rewards, data.batch["values"], mask, gamma=1.0, lam=1.0)
        kl = core_algos.kl_penalty(old_log_probs, data.batch["ref_log_prob"], "low_var_kl") * mask
    assert adv.device.type == ret.device.type == kl.device.type == "cpu"


def test_a_forward_that_skips_the_boundary_is_caught(causal_lm):
    """The checker sees the bug the boundary fixed: host tensors meeting device logits."""
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

    data = _batch(causal_lm.config.vocab_size)
    actor = DataParallelPPOActor(None, causal_lm, device=DEVICE)
    host_micro = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]).batch
    with SameDevice(), pytest.raises(DeviceMismatch):
        actor._forward_micro_batch(host_micro, 1.0)
