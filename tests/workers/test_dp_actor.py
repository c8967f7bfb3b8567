"""DataParallelPPOActor against independent references: per-row HF forwards and a per-token loss loop.

The reference never pads: each row's valid tokens go through the model alone, and the loss is
written token by token, so it shares no code path with the actor's batching, packing or scaling.
"""
import logging
import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.base import find_free_port
from verl_arpo.algos.core_algos import get_policy_loss_fn
from verl_arpo.utils.torch_functional import compute_position_id_with_mask
from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
from verl_arpo.workers.sharded_model import enable_activation_checkpointing
from verl_arpo.config import ActorConfig, PolicyLossConfig, RolloutCorrection
from worker_configs import actor_kwargs, gloo_rank_counting, log_probs, rank_share

P, R = 6, 8


def load_model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def make_batch(vocab, B=6, seed=0, prompt_lens=None, resp_lens=None):
    """Left-padded prompts, right-padded responses, a tool-result hole in the loss mask."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = prompt_lens or [int(x) for x in torch.randint(1, P + 1, (B,), generator=g)]
    resp_lens = resp_lens or [int(x) for x in torch.randint(2, R + 1, (B,), generator=g)]
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    for b in range(B):
        attn[b, P - prompt_lens[b]:P + resp_lens[b]] = 1
    ids = ids * attn  # pad id 0
    resp_mask = attn[:, P:].clone()
    resp_mask[0, 1] = 0  # a tool-result token inside the response
    adv = (torch.randn(B, 1, generator=g) + 0.2 * torch.randn(B, R, generator=g)) * resp_mask
    # near-uniform random model: log p ≈ −log V; the noise puts ratios on both sides of the clip
    old = -math.log(vocab) + 0.25 * torch.randn(B, R, generator=g)
    ref = old + 0.3 * torch.randn(B, R, generator=g)
    return DataProto.from_dict(
        tensors=dict(input_ids=ids, attention_mask=attn, position_ids=compute_position_id_with_mask(attn),
                     responses=ids[:, P:], response_mask=resp_mask, advantages=adv, old_log_probs=old,
                     ref_log_prob=ref))


def per_row_outputs(model, data, temperature=1.0):
    """Per row, unpadded forward: log p and entropy of each real response token (dict (b,t)→...)."""
    out = {}
    attn = data.batch["attention_mask"]
    for b in range(attn.shape[0]):
        ids = data.batch["input_ids"][b][attn[b].bool()]
        n_resp = int(attn[b, P:].sum())
        logits = model(input_ids=ids[None]).logits[0] / temperature
        start = len(ids) - n_resp
        for t in range(n_resp):
            logp = F.log_softmax(logits[start + t - 1], dim=-1)
            out[(b, t)] = (logp[ids[start + t]], -(logp.exp() * logp).sum())
    return out


def assert_matches_rows(lp, ent, rows, data):
    """Per-slot log-probs / entropies equal the per-row forward's; 0 past each response."""
    attn_r = data.batch["attention_mask"][:, P:]
    for b in range(lp.shape[0]):
        for t in range(R):
            if attn_r[b, t]:
                assert lp[b, t].item() == pytest.approx(rows[(b, t)][0].item(), abs=1e-5)
                assert ent[b, t].item() == pytest.approx(rows[(b, t)][1].item(), abs=1e-5)
            else:
                assert lp[b, t] == 0 and ent[b, t] == 0


def reference_objective(model, data, cfg):
    """The mini-batch objective, token by token (dual-clip PPO + entropy bonus + KL, AEPO advantage)."""
    eps, c = cfg.get("clip_ratio", 0.2), cfg.get("clip_ratio_c", 3.0)
    rows = per_row_outputs(model, data)
    m = data.batch["response_mask"]
    adv = data.batch["advantages"].clone()
    if cfg.get("enable_entropy_balanced_advantage"):
        hs = torch.stack([rows[k][1].detach() for k in sorted(rows) if m[k]])
        mean, std = hs.mean(), hs.std()
        for k in rows:
            adv[k] = adv[k] * (1 + cfg["entropy_advantage_alpha"] * (rows[k][1].detach() - mean) / std)
    terms = {}
    for (b, t), (lp, h) in rows.items():
        if not m[b, t]:
            continue
        a, old = adv[b, t], data.batch["old_log_probs"][b, t]
        ratio = torch.exp(lp - old)
        l1, l2 = -a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps)
        loss = torch.maximum(l1, l2)
        if a < 0:
            loss = torch.minimum(loss, -a * c)
        loss = loss - cfg.get("entropy_coeff", 0.0) * h
        if cfg.get("use_kl_loss"):
            d = torch.clamp(data.batch["ref_log_prob"][b, t] - lp, -20, 20)
            loss = loss + cfg["kl_loss_coef"] * torch.clamp(torch.exp(d) - d - 1, -10, 10)
        terms[(b, t)] = loss
    if cfg.get("loss_agg_mode", "token-mean") == "token-mean":
        return sum(terms.values()) / len(terms)
    per_seq = {}
    for (b, t), v in terms.items():
        per_seq.setdefault(b, []).append(v)
    return sum(sum(v) / len(v) for v in per_seq.values()) / len(per_seq)


class RecordingOptimizer:
    """Stands in for the optimizer: records the gradient of each step, changes nothing."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def step(self):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def actor_grad(model, data, **cfg):
    opt = RecordingOptimizer(model)
    base = dict(ppo_mini_batch_size=len(data), ppo_micro_batch_size_per_gpu=len(data), ppo_epochs=1, grad_clip=None)
    built = {k: cfg.pop(k) for k in ("use_remove_padding", "use_prefix_sharing", "on_policy", "rollout_correction",
                                     "temperature") if k in cfg}  # constructor arguments, not actor keys
    actor = DataParallelPPOActor(actor_module=model, actor_optimizer=opt, **built, **actor_kwargs(**{**base, **cfg}))
    metrics = actor.update_policy(data)
    assert len(opt.grads) == 1
    return opt.grads[0], metrics


def reference_grad(model, data, **cfg):
    model.zero_grad(set_to_none=True)
    reference_objective(model, data, cfg).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_grads_close(a, b, rtol=1e-4):
    assert a.keys() == b.keys()
    scale = max(v.abs().max().item() for v in b.values())
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=rtol * scale, rtol=rtol, msg=k)


# --------------------------------------------------------------------------------------------
def test_compute_log_prob_matches_plain_forward(model):
    data = make_batch(model.config.vocab_size, seed=1)
    for temperature in (1.0, 0.7):
        actor = DataParallelPPOActor(None, model, temperature=temperature)
        rows = per_row_outputs(model, data, temperature)
        lp, ent = actor.compute_log_prob(data, log_probs(4), calculate_entropy=True)
        assert_matches_rows(lp, ent, rows, data)
        # token-budget micro-batches come back in the input order; packing gives the same numbers
        dynamic = log_probs(4, use_dynamic_bsz=True, max_token_len=20)
        lp_dyn, ent_dyn = actor.compute_log_prob(data, dynamic, calculate_entropy=True)
        torch.testing.assert_close(lp_dyn, lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent_dyn, ent, atol=1e-5, rtol=1e-5)
        packed = DataParallelPPOActor(None, model, use_remove_padding=True, temperature=temperature)
        seen = []
        hook = model.register_forward_pre_hook(
            lambda mod, args, kw: seen.append((kw["input_ids"].shape[0], kw["attention_mask"])), with_kwargs=True)
        try:
            lp_pk, ent_pk = packed.compute_log_prob(data, dynamic, calculate_entropy=True)
        finally:
            hook.remove()
        assert seen and all(rows == 1 and mask is None for rows, mask in seen)  # really packed
        torch.testing.assert_close(lp_pk, lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent_pk, ent, atol=1e-5, rtol=1e-5)
    assert actor.compute_log_prob(data, log_probs())[1] is None
    # a caller written for verl passes the temperature with the batch: the same one is accepted,
    # another is refused (it would score the tokens under a distribution the caller did not mean)
    data.meta_info["temperature"] = 0.7
    torch.testing.assert_close(actor.compute_log_prob(data, log_probs(4))[0], lp)
    data.meta_info["temperature"] = 1.0
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\]=1.0 differs.*temperature=\.\.\."):
        actor.compute_log_prob(data, log_probs(4))
    with pytest.raises(ValueError, match="rollout.temperature must be > 0"):
        DataParallelPPOActor(None, model, temperature=0.0)


def test_remove_padding_fallbacks(model):
    from types import SimpleNamespace

    from verl_arpo.workers.training_core import _pack, packing_supported

    assert packing_supported(model) == (True, "")
    assert not packing_supported(SimpleNamespace(config=SimpleNamespace(_attn_implementation="paged_attention")))[0]
    data = make_batch(model.config.vocab_size, seed=9)
    assert _pack(data.batch, R) is not None
    shifted = data.batch.clone()
    shifted["position_ids"] = shifted["position_ids"] + 1  # rows no longer start at 0: boundaries ambiguous
    assert _pack(shifted, R) is None


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_gradient_is_the_minibatch_objective(model, mode):
    data = make_batch(model.config.vocab_size, seed=2)
    ref = reference_grad(model, data, loss_agg_mode=mode)
    whole, metrics = actor_grad(model, data, loss_agg_mode=mode)
    assert_grads_close(whole, ref)
    one, _ = actor_grad(model, data, loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=1)
    assert_grads_close(one, ref)
    dyn, metrics_dyn = actor_grad(model, data, loss_agg_mode=mode, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=18)
    assert_grads_close(dyn, ref)
    packed, _ = actor_grad(model, data, loss_agg_mode=mode, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=25,
                           use_remove_padding=True)
    assert_grads_close(packed, ref)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/grad_norm"):
        assert metrics[key][0] == pytest.approx(metrics_dyn[key][0], rel=1e-4, abs=1e-6)
    with torch.no_grad():
        objective = reference_objective(model, data, {"loss_agg_mode": mode}).item()
    assert metrics["actor/pg_loss"][0] == pytest.approx(objective, rel=1e-4, abs=1e-6)


def test_on_policy_update_without_old_log_probs(model):
    """No old_log_probs (the trainer skipped the pass): π_old is the update's own forward, detached —
    the gradient equals the reference objective with old = the plain per-row forward's log-probs."""
    data = make_batch(model.config.vocab_size, seed=5)
    with torch.no_grad():
        rows = per_row_outputs(model, data)
    old = torch.zeros_like(data.batch["old_log_probs"])
    for (b, t), (lp, _) in rows.items():
        old[b, t] = lp
    data.batch["old_log_probs"] = old
    ref = reference_grad(model, data)
    data.batch.pop("old_log_probs")
    got, metrics = actor_grad(model, data, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=25, on_policy=True)
    assert_grads_close(got, ref)
    assert metrics["actor/ppo_kl"][0] == 0.0 and metrics["actor/pg_clipfrac"][0] == 0.0  # ratio is exactly 1
    m = data.batch["response_mask"].bool()
    hs = torch.stack([rows[k][1] for k in sorted(rows) if m[k]])
    assert metrics["actor/update_entropy"][0] == pytest.approx(hs.mean().item(), rel=1e-4)  # the metric survives
    # the update's forward is π_old: its entropy is the rollout policy's, reported as actor/entropy
    assert metrics["actor/entropy"] == metrics["actor/update_entropy"]
    with pytest.raises(ValueError, match="built on-policy"):  # two mini-batches: the second is off-policy
        actor_grad(model, data, ppo_mini_batch_size=len(data) // 2, on_policy=True)
    with pytest.raises(ValueError, match="built on-policy"):
        actor_grad(model, data, ppo_epochs=2, on_policy=True)
    with pytest.raises(KeyError, match="old_log_probs"):  # built off-policy: π_old must come with the batch
        actor_grad(model, data)
    data.batch["old_log_probs"] = old  # off-policy with π_old given: no actor/entropy (the log-prob pass has it)
    assert "actor/entropy" not in actor_grad(model, data)[1]


def test_entropy_bonus_and_kl_loss(model):
    data = make_batch(model.config.vocab_size, seed=3)
    cfg = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    ref = reference_grad(model, data, **cfg)
    got, metrics = actor_grad(model, data, ppo_micro_batch_size_per_gpu=2, **cfg)
    assert_grads_close(got, ref)
    assert {"actor/update_entropy", "actor/kl_loss"} <= metrics.keys() and metrics["actor/kl_coef"] == 0.1


def test_aepo_entropy_advantage_is_computed_without_entropy_coeff(model):
    data = make_batch(model.config.vocab_size, seed=4)
    # A sharper copy of the model: the random one is near-uniform (H ≈ log V everywhere), whose
    # tiny entropy spread would make z-scores amplify float32 noise.
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3)  # H spread ≈ 0.06 instead of ≈ 0.001
    cfg = dict(enable_entropy_balanced_advantage=True, entropy_advantage_alpha=0.5, entropy_coeff=0.0)
    vanilla, _ = actor_grad(model, data)
    aepo, metrics = actor_grad(model, data, **cfg)
    assert "actor/update_entropy" in metrics
    diff = max((aepo[k] - vanilla[k]).abs().max().item() for k in aepo)
    assert diff > 1e-4 * max(v.abs().max().item() for v in vanilla.values())
    assert_grads_close(aepo, reference_grad(model, data, **cfg))  # z-scores over the (single) micro-batch


def test_entropy_balanced_clipping_flag(model):
    data = make_batch(model.config.vocab_size, seed=5)
    lp, _ = DataParallelPPOActor(None, model).compute_log_prob(DataProto(batch=data.batch), log_probs(8))
    data.batch["old_log_probs"] = lp - 0.5  # r ≈ 1.65 > 1 + ε: clipped for A > 0
    data.batch["advantages"] = data.batch["advantages"].abs()
    actor = DataParallelPPOActor(ActorConfig(enable_entropy_balanced_clipping=True), model, RecordingOptimizer(model))
    assert actor._policy_loss_fn() is get_policy_loss_fn("entropy_balanced")
    with pytest.raises(ValueError):
        DataParallelPPOActor(ActorConfig(enable_entropy_balanced_clipping=True, policy_loss=PolicyLossConfig(loss_mode="x")),
                             model)._policy_loss_fn()
    vanilla, _ = actor_grad(model, data)
    balanced, _ = actor_grad(model, data, enable_entropy_balanced_clipping=True)
    # all positive-advantage tokens are clipped: vanilla has (almost) no gradient, the AEPO loss keeps it
    norm = lambda g: math.sqrt(sum(v.square().sum().item() for v in g.values()))  # noqa: E731
    assert norm(balanced) > 10 * norm(vanilla)


def test_nonfinite_grad_skips_step(model, caplog):
    data = make_batch(model.config.vocab_size, seed=6)
    data.batch["advantages"][0, 0] = float("nan")
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = {"ppo_mini_batch_size": 6, "ppo_micro_batch_size_per_gpu": 3, "grad_clip": 1.0}
    actor = DataParallelPPOActor(actor_module=model, actor_optimizer=opt, **actor_kwargs(**cfg))
    with caplog.at_level(logging.WARNING, logger="verl_arpo"):
        metrics = actor.update_policy(data)
    assert not math.isfinite(metrics["actor/grad_norm"][0])
    assert "skipping" in caplog.text
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_minibatches_epochs_and_clip(model):
    data = make_batch(model.config.vocab_size, B=8, seed=7)
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    actor = DataParallelPPOActor(actor_module=m, actor_optimizer=opt, **actor_kwargs(
        ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, ppo_epochs=2, shuffle=True, grad_clip=1e-3))
    metrics = actor.update_policy(data)
    assert len(metrics["actor/pg_loss"]) == 4 and len(metrics["actor/grad_norm"]) == 4
    # clipped to 1e-3: the parameters moved by at most lr * 1e-3 in norm per step
    moved = math.sqrt(sum((a - b).square().sum().item() for a, b in zip(m.parameters(), model.parameters())))
    assert 0 < moved <= 4 * 0.1 * 1e-3 * 1.01


# --------------------------------------------------------------------------------------------
# 2-process FSDP2 on gloo: DP=2 with half the mini-batch each equals one process on the whole
# --------------------------------------------------------------------------------------------
def _free_port():
    return find_free_port("127.0.0.1")


def _fsdp_rank(rank, world, port, model_dir, data_path, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.load(data_path, weights_only=False)
        results = {}
        for name, cfg in _fsdp_cases().items():
            model = load_model(model_dir)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            half = len(full) // world
            data = full.slice(rank * half, (rank + 1) * half)
            cfg = dict(cfg)
            kw = {k: cfg.pop(k) for k in ("use_remove_padding", "use_prefix_sharing") if k in cfg}
            actor = DataParallelPPOActor(actor_module=model, actor_optimizer=opt, **kw,
                                         **actor_kwargs(**{**cfg, "ppo_mini_batch_size": half}))
            lp, _ = actor.compute_log_prob(DataProto(batch=data.batch), log_probs(use_dynamic_bsz=True, max_token_len=15))
            metrics = actor.update_policy(data)
            params = {k: v.full_tensor() for k, v in model.state_dict().items()}
            results[name] = dict(params=params, metrics=metrics, lp=lp)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def _fsdp_cases():
    return {
        "token-mean-dynamic": dict(loss_agg_mode="token-mean", use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20,
                                   grad_clip=0.05),
        "seq-mean-fixed": dict(loss_agg_mode="seq-mean-token-mean", ppo_micro_batch_size_per_gpu=2, grad_clip=None),
        # rows 0, 2 and 4, 6 share prompts; the two ranks need different micro-batch counts
        "token-mean-prefix-sharing": dict(loss_agg_mode="token-mean", use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20,
                                          grad_clip=None, use_remove_padding=True, use_prefix_sharing=True),
    }


def test_fsdp2_two_ranks_equal_single_process(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    # Unequal token counts on the two halves, so local normalisation would be wrong.
    data = make_batch(load_model(tiny_model_dir).config.vocab_size, B=8, seed=8,
                      prompt_lens=[6, 5, 6, 4, 1, 2, 1, 3], resp_lens=[8, 7, 8, 6, 2, 3, 2, 4])
    for a, b in ((0, 2), (4, 6)):  # shared prompts (equal lengths) for the prefix-sharing case
        data.batch["input_ids"][b, :P] = data.batch["input_ids"][a, :P]
    data_path, out_path = tmp_path / "data.pt", tmp_path / "out.pt"
    torch.save(data, data_path)
    mp.start_processes(_fsdp_rank, args=(2, _free_port(), tiny_model_dir, str(data_path), str(out_path)),
                       nprocs=2, join=True, start_method="spawn")
    dp = torch.load(out_path, weights_only=False)
    for name, cfg in _fsdp_cases().items():
        model = load_model(tiny_model_dir)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        single = {k: v for k, v in cfg.items() if k not in ("use_remove_padding", "use_prefix_sharing")}
        single.update(ppo_mini_batch_size=8, use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=8)
        metrics = DataParallelPPOActor(actor_module=model, actor_optimizer=opt, **actor_kwargs(**single)).update_policy(data)
        assert dp[name]["metrics"]["actor/grad_norm"][0] == pytest.approx(metrics["actor/grad_norm"][0], rel=1e-4)
        max_delta = max((v - before[k]).abs().max().item() for k, v in model.state_dict().items())
        assert max_delta > 1e-3
        for k, v in model.state_dict().items():
            torch.testing.assert_close(dp[name]["params"][k] - before[k], v - before[k],
                                       atol=1e-4 * max_delta, rtol=1e-3, msg=f"{name}: {k}")
    # the FSDP forward (rank 0's half, dynamic micro-batches) equals a plain forward
    ref_lp, _ = DataParallelPPOActor(None, load_model(tiny_model_dir)).compute_log_prob(
        DataProto(batch=data.batch[:4]), log_probs(4))
    torch.testing.assert_close(dp["seq-mean-fixed"]["lp"], ref_lp, atol=1e-5, rtol=1e-5)


def test_kl_loss_with_zero_weight_is_off(model):
    """[issue 15] The seeds' scripts set use_kl_loss=True with kl_loss_coef=0: the update must not read
    ref_log_prob (the trainer skipped the reference forward), give exactly the use_kl_loss=False
    gradient, and log no KL metrics. The same rule decides JobConfig.derived.kl_loss_active."""
    from verl_arpo.algos.core_algos import kl_term_active

    data = make_batch(model.config.vocab_size, seed=6)
    data.batch.pop("ref_log_prob")
    off, off_metrics = actor_grad(model, data, use_kl_loss=False)
    zero, zero_metrics = actor_grad(model, data, use_kl_loss=True, kl_loss_coef=0.0, kl_loss_type="low_var_kl")
    for k in off:
        assert torch.equal(off[k], zero[k]), k
    assert not {"actor/kl_loss", "actor/kl_coef"} & zero_metrics.keys()
    assert zero_metrics.keys() == off_metrics.keys()
    # a KL loss with weight still needs the reference log-probs, and says so
    with pytest.raises(KeyError, match="compute_ref_log_prob"):
        actor_grad(model, data, use_kl_loss=True, kl_loss_coef=0.1)
    assert [kl_term_active(*a) for a in [(True, 0.0), (True, "0"), (False, 0.1), (True, None), (True, 1e-3)]] == \
        [False, False, False, False, True]


@pytest.mark.parametrize("apply", [True, False])
def test_rollout_correction_weights_the_update_and_logs_the_mismatch(model, apply):
    """[issue 17, item 11] With the engine's log-probs in the batch the mismatch is logged; with
    algorithm.rollout_is the update equals the plain update with advantages × min(π_old/π_rollout, cap)."""
    data = make_batch(model.config.vocab_size, seed=8)
    g = torch.Generator().manual_seed(1)
    old, mask = data.batch["old_log_probs"], data.batch["response_mask"]
    data.batch["rollout_log_probs"] = old + 0.3 * torch.randn(old.shape, generator=g)
    got, metrics = actor_grad(model, data, rollout_correction=RolloutCorrection(1.2, "token", "truncate", apply))
    delta = (old - data.batch["rollout_log_probs"])[mask.bool()]
    assert metrics["mismatch/log_prob_abs_diff"][0] == pytest.approx(delta.abs().mean().item(), rel=1e-5)
    assert metrics["mismatch/kl"][0] == pytest.approx((-delta).mean().item(), rel=1e-5, abs=1e-7)
    plain = copy.deepcopy(data)
    if apply:
        w = torch.exp(old - data.batch["rollout_log_probs"]).clamp(max=1.2) * mask
        plain.batch["advantages"] = plain.batch["advantages"] * w
    want, plain_metrics = actor_grad(model, plain)
    assert "mismatch/rollout_is_mean" in metrics and "mismatch/rollout_is_mean" not in plain_metrics
    assert_grads_close(got, want)


def test_update_reports_progress_per_micro_batch_and_its_step_counts(model, monkeypatch, capsys):
    """VERL_ARPO_PROGRESS_S=0: one `[update]` line per micro-batch, numbered as the actor splits
    the batch; the update's counts say one optimizer step, none skipped."""
    monkeypatch.setenv("VERL_ARPO_PROGRESS_S", "0")
    monkeypatch.setenv("RANK", "0")
    data = make_batch(model.config.vocab_size, seed=2)
    _, metrics = actor_grad(model, data, ppo_micro_batch_size_per_gpu=1)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[update]")]
    n = len(data)
    assert [ln.rsplit(" (", 1)[0] for ln in lines] == [
        f"[update] epoch 1/1, mini-batch 1/1, micro-batch {i}/{n}" for i in range(1, n + 1)]
    assert (metrics["actor/optimizer_steps"], metrics["actor/skipped_optimizer_steps"],
            metrics["actor/non_finite_losses"]) == (1.0, 0.0, 0.0)


def test_every_training_forward_runs_without_cudnn_attention_on_cuda(model, monkeypatch):
    """cuDNN attention plans every new shape; on an H200 a training micro-batch with new lengths took
    3.2-3.6x longer with it (docs/gpu.md, benchmarks/bench_train_attention.py). The log-prob pass, the
    update's forward, and the forward that activation checkpointing re-runs inside backward all run
    with cuDNN's kernel off (the guard run as on CUDA: it only sets flags, which a CPU build has),
    and the flag is back on afterwards."""
    from verl_arpo.workers import training_core
    from verl_arpo.workers.actor import dp_actor

    real = training_core.without_cudnn_attention
    devices = []   # the guard must be asked about the device the model computes on

    def as_on_cuda(device):
        devices.append(torch.device(device))
        return real(torch.device("cuda"))

    for mod in (training_core, dp_actor):
        monkeypatch.setattr(mod, "without_cudnn_attention", as_on_cuda)
    m = copy.deepcopy(model)
    enable_activation_checkpointing(m)
    m.train()
    seen = []
    attention = m.model.layers[0].self_attn   # inside the checkpointed region: it runs again in backward
    attention.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    data = make_batch(m.config.vocab_size, seed=2)
    DataParallelPPOActor(None, m, use_remove_padding=True).compute_log_prob(data, log_probs(2))
    n_log_prob = len(seen)
    actor_grad(m, data, ppo_micro_batch_size_per_gpu=2)
    micro = math.ceil(len(data) / 2)
    assert n_log_prob == micro
    assert len(seen) == n_log_prob + 2 * micro   # the update's forward and its re-run in backward
    assert not any(seen), seen
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert devices and set(devices) == {next(m.parameters()).device}


def run_two_ranks(rank_fn, model_dir, tmp_path) -> dict:
    """`rank_fn(rank, 2, port, model_dir, data_path, out_path)` on two spawned gloo ranks over an 8-row batch
    of uneven rows (several token-budget micro-batches a rank); what rank 0 saved at out_path."""
    import torch.multiprocessing as mp

    data = make_batch(load_model(model_dir).config.vocab_size, B=8, seed=8,
                      prompt_lens=[6, 5, 6, 4, 1, 2, 1, 3], resp_lens=[8, 7, 8, 6, 2, 3, 2, 4])
    data_path, out_path = tmp_path / "data.pt", tmp_path / "out.pt"
    torch.save(data, data_path)
    mp.start_processes(rank_fn, args=(2, _free_port(), model_dir, str(data_path), str(out_path)),
                       nprocs=2, join=True, start_method="spawn")
    return torch.load(out_path, weights_only=False)


def _gather_once_rank(rank, world, port, model_dir, data_path, out_path):
    """One update of the dynamic case per setting, counting FSDP2's all-gathers."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group   # where FSDP2 all-gathers

    from verl_arpo.workers.sharded_model import shard_fsdp2

    with gloo_rank_counting(rank, world, port, param_group, "foreach_all_gather") as calls:
        mesh, data, half = rank_share(data_path, rank, world)
        results = {}
        for gather_once in (False, True):
            model = shard_fsdp2(load_model(model_dir), mesh, reshard_after_forward=not gather_once)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            actor = DataParallelPPOActor(actor_module=model, actor_optimizer=opt, gather_once=gather_once,
                                         **actor_kwargs(loss_agg_mode="token-mean", use_dynamic_bsz=True,
                                                        ppo_max_token_len_per_gpu=20, ppo_mini_batch_size=half))
            calls["n"] = 0
            metrics = actor.update_policy(data)
            gathers = calls["n"]
            units = sum(1 for m in model.modules() if hasattr(m, "reshard"))
            # after the step the next forward gathers the new weights: the same log-probs either way
            lp, _ = actor.compute_log_prob(DataProto(batch=data.batch), log_probs(use_dynamic_bsz=True, max_token_len=15))
            results[gather_once] = dict(params={k: v.full_tensor() for k, v in model.state_dict().items()},
                                        metrics=metrics, gathers=gathers, units=units, lp=lp)
        if rank == 0:
            torch.save(results, out_path)


def test_parameters_gathered_once_a_mini_batch_give_the_same_update(tiny_model_dir, tmp_path):
    """fsdp_config.reshard_after_forward=false: each FSDP unit all-gathers once a mini-batch (here one,
    of several micro-batches) instead of twice a micro-batch, and the update is the same bit for bit,
    as are the log-probs the next pass computes with the new weights."""
    base, once = (r := run_two_ranks(_gather_once_rank, tiny_model_dir, tmp_path))[False], r[True]
    for k, v in base["params"].items():
        assert torch.equal(v, once["params"][k]), k
    assert base["metrics"]["actor/pg_loss"] == once["metrics"]["actor/pg_loss"]
    assert base["metrics"]["actor/grad_norm"] == once["metrics"]["actor/grad_norm"]
    assert torch.equal(base["lp"], once["lp"])
    units = once["units"]
    assert once["gathers"] == units                       # one all-gather per unit for the whole mini-batch
    assert base["gathers"] >= 2 * units                    # at least two micro-batches, each gathering
