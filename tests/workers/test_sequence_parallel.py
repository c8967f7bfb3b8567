"""Ulysses sequence parallelism on gloo: S = 2 against S = 1 (docs/sequence_parallel.md).

The references are this repository's S = 1 actor and critic in one process, on the whole batch, with
no FSDP: its own tests (test_dp_actor, test_dp_critic) check them against per-row forwards and
per-token loss loops. The sequence-parallel runs are real process groups: FSDP2 over all ranks, the
(dp, sp) mesh, all-to-all inside every attention layer, the per-slot gather, and the dispatcher's
shares gathered per sp group.
"""
import copy
import os

import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic
from verl_arpo.workers.sharded_model import enable_activation_checkpointing
from test_dp_actor import P, _free_port, make_batch
from worker_configs import actor_kwargs, critic_kwargs, log_probs

# (model shape, actor keys, extra flags): every case runs S = 2 on 2 ranks and S = 1 in one process
ACTOR_CASES = {
    # 2 query heads, 1 kv head: the kv head is repeated to split over 2 ranks; 2 fixed micro-batches
    "packed": ("kv1", dict(loss_agg_mode="token-mean", ppo_micro_batch_size_per_gpu=3), {}),
    # shared prompts as a prefix tree (its N x N mask, padded), token-budget micro-batches, KL loss
    "prefix-sharing-dynamic": ("kv1", dict(loss_agg_mode="token-mean", use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24,
                                           use_kl_loss=True, kl_loss_coef=0.1), {"use_prefix_sharing": True}),
    # recomputation in the backward re-runs the all-to-alls; the entropy bonus gathers with grad
    "checkpointing-seq-mean-entropy": ("kv1", dict(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01,
                                                   ppo_micro_batch_size_per_gpu=6), {"checkpointing": True}),
    # 3 query heads do not split over 2 ranks: a zero head pads them
    "odd-heads": ("q3", dict(loss_agg_mode="token-mean", ppo_micro_batch_size_per_gpu=6), {}),
    # 4 query heads over 2 kv heads: both split as they are (grouped-query attention kept)
    "gqa-split": ("q4kv2", dict(loss_agg_mode="token-mean", ppo_micro_batch_size_per_gpu=6), {}),
}
MODEL_SHAPES = {"kv1": dict(), "q3": dict(hidden_size=96, num_attention_heads=3, num_key_value_heads=1),
                "q4kv2": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)}
LR = 0.5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from verl_arpo.utils.tiny_model import make_tiny_model

    return {k: make_tiny_model(tmp_path_factory.mktemp(k), seed=0, **kw) for k, kw in MODEL_SHAPES.items()}


def load(model_dir, checkpointing=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    if checkpointing:
        enable_activation_checkpointing(model)
    return model


def load_critic(model_dir):
    from transformers import AutoConfig, AutoModelForTokenClassification

    cfg = AutoConfig.from_pretrained(model_dir, num_labels=1)
    cfg.classifier_dropout = 0.0
    torch.manual_seed(1)  # the value head's init, the same in every process
    return AutoModelForTokenClassification.from_pretrained(model_dir, config=cfg, attn_implementation="sdpa",
                                                           dtype=torch.float32)


def shared_prompt_batch(vocab, seed):
    data = make_batch(vocab, B=6, seed=seed, prompt_lens=[6, 4, 6, 3, 4, 2], resp_lens=[8, 5, 7, 3, 6, 8])
    for a, b in ((0, 2), (1, 4)):  # a group's rows share their prompt: a prefix tree to share
        data.batch["input_ids"][b, :P] = data.batch["input_ids"][a, :P]
    return data


def critic_batch(data):
    g = torch.Generator().manual_seed(5)
    m = data.batch["response_mask"].float()
    data = copy.deepcopy(data)
    data.batch["values"] = torch.randn(m.shape, generator=g) * m * 0.1
    data.batch["returns"] = torch.randn(m.shape, generator=g) * m
    return data


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(model):
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _init(rank, world, port):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


# --------------------------------------------------------------------------------------------
# 2 ranks, one sp group (dp 1 x sp 2): the same micro-batches as S = 1 in one process
# --------------------------------------------------------------------------------------------
def _sp2_rank(rank, world, port, dirs, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl_arpo.utils.ulysses import build_sequence_parallel

    _init(rank, world, port)
    try:
        sp = build_sequence_parallel(2)
        assert (sp.size, sp.rank, sp.dp_size) == (2, rank, 1)
        mesh = init_device_mesh("cpu", (world,))
        results = {}
        for name, (shape, cfg, flags) in ACTOR_CASES.items():
            model = _shard(load(dirs[shape], flags.get("checkpointing", False)), mesh)
            data = shared_prompt_batch(model.config.vocab_size, seed=11)
            actor = DataParallelPPOActor(actor_module=model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                         use_remove_padding=True, use_prefix_sharing=flags.get("use_prefix_sharing", False),
                                         sp=sp, temperature=0.7, **actor_kwargs(**{**cfg, "ppo_mini_batch_size": 6}))
            lp, ent = actor.compute_log_prob(DataProto(batch=data.batch),
                                             log_probs(4), calculate_entropy=True)
            metrics = actor.update_policy(data)
            results[name] = dict(lp=lp, ent=ent, metrics=metrics, params=_full(model))
        critic = _shard(load_critic(dirs["kv1"]), mesh)
        data = critic_batch(shared_prompt_batch(critic.config.vocab_size, seed=12))
        dpc = DataParallelPPOCritic(critic_module=critic, critic_optimizer=torch.optim.SGD(critic.parameters(), lr=LR),
                                    sp=sp, **critic_kwargs(model={"use_remove_padding": True}, ppo_mini_batch_size=6,
                                                           ppo_micro_batch_size_per_gpu=3))
        values = dpc.compute_values(data)
        metrics = dpc.update_critic(data)
        results["critic"] = dict(values=values, metrics=metrics, params=_full(critic))
        torch.save(results, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sp2_equals_one_process(model_dirs, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "sp2"
    mp.start_processes(_sp2_rank, args=(2, _free_port(), model_dirs, str(out)), nprocs=2, join=True,
                       start_method="spawn")
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    for name, (shape, cfg, flags) in ACTOR_CASES.items():
        model = load(model_dirs[shape], flags.get("checkpointing", False))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        data = shared_prompt_batch(model.config.vocab_size, seed=11)
        actor = DataParallelPPOActor(actor_module=model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                     use_remove_padding=True, use_prefix_sharing=flags.get("use_prefix_sharing", False),
                                     temperature=0.7, **actor_kwargs(**{**cfg, "ppo_mini_batch_size": 6}))
        lp, ent = actor.compute_log_prob(DataProto(batch=data.batch), log_probs(4),
                                         calculate_entropy=True)
        metrics = actor.update_policy(data)
        for r in range(2):  # every rank of the group has every slot's log-prob and entropy
            torch.testing.assert_close(got[r][name]["lp"], lp, atol=1e-5, rtol=1e-5, msg=f"{name} rank {r}")
            torch.testing.assert_close(got[r][name]["ent"], ent, atol=1e-5, rtol=1e-5, msg=f"{name} rank {r}")
            # the loss on each rank is the objective (dp = 1), the gradient norm the global one
            assert got[r][name]["metrics"]["actor/pg_loss"][0] == pytest.approx(metrics["actor/pg_loss"][0], abs=1e-6)
            assert got[r][name]["metrics"]["actor/grad_norm"][0] == pytest.approx(metrics["actor/grad_norm"][0], rel=1e-4)
        max_delta = max((v - before[k]).abs().max().item() for k, v in model.state_dict().items())
        assert max_delta > 1e-4, name
        for k, v in model.state_dict().items():  # SGD: the parameter change is -lr x the gradient
            torch.testing.assert_close(got[0][name]["params"][k] - before[k], v - before[k], atol=1e-4 * max_delta,
                                       rtol=1e-3, msg=f"{name}: {k}")
    critic = load_critic(model_dirs["kv1"])
    before = {k: v.clone() for k, v in critic.state_dict().items()}
    data = critic_batch(shared_prompt_batch(critic.config.vocab_size, seed=12))
    dpc = DataParallelPPOCritic(critic_module=critic, critic_optimizer=torch.optim.SGD(critic.parameters(), lr=LR),
                                **critic_kwargs(model={"use_remove_padding": True}, ppo_mini_batch_size=6,
                                                ppo_micro_batch_size_per_gpu=3))
    values = dpc.compute_values(data)
    metrics = dpc.update_critic(data)
    for r in range(2):
        torch.testing.assert_close(got[r]["critic"]["values"], values, atol=1e-5, rtol=1e-5)
        assert got[r]["critic"]["metrics"]["critic/vf_loss"][0] == pytest.approx(metrics["critic/vf_loss"][0], abs=1e-6)
    max_delta = max((v - before[k]).abs().max().item() for k, v in critic.state_dict().items())
    assert max_delta > 1e-4
    for k, v in critic.state_dict().items():
        torch.testing.assert_close(got[0]["critic"]["params"][k] - before[k], v - before[k], atol=1e-4 * max_delta,
                                   rtol=1e-3, msg=k)


# --------------------------------------------------------------------------------------------
# 4 ranks, dp 2 x sp 2, against 2 ranks, dp 2 x sp 1: the dispatcher's shares, two updates
# --------------------------------------------------------------------------------------------
def _dp_rank(rank, world, port, sp_size, model_dir, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl_arpo.utils.ulysses import build_sequence_parallel
    from verl_arpo.workers.sequence_parallel import gather_group_data, local_rows

    _init(rank, world, port)
    try:
        sp = build_sequence_parallel(sp_size)
        model = _shard(load(model_dir), init_device_mesh("cpu", (world,)))
        batches = [shared_prompt_batch(model.config.vocab_size, seed=s) for s in (21, 22)]
        for b in batches:  # 12 trajectories a step: 3 per rank at dp 2 x sp 2, 6 at dp 2 x sp 1
            b.batch = torch.cat([b.batch, shared_prompt_batch(model.config.vocab_size, seed=30).batch])
        dp = world // sp_size
        actor = DataParallelPPOActor(actor_module=model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                     use_remove_padding=True, sp=sp,
                                     **actor_kwargs(loss_agg_mode="token-mean", use_dynamic_bsz=True,
                                                    ppo_max_token_len_per_gpu=20 * sp_size, ppo_mini_batch_size=12 // dp))
        rows = {}
        for step, full in enumerate(batches):
            share = full.chunk(world)[rank]  # what DP_COMPUTE_PROTO gives this rank
            data, shares = gather_group_data(share, sp)
            assert len(data) == 12 // dp
            lp, _ = actor.compute_log_prob(DataProto(batch=data.batch), log_probs(4))
            mine = local_rows(DataProto.from_dict(tensors={"lp": lp}), shares, sp)
            rows[step] = mine.batch["lp"]
            actor.update_policy(data)
        torch.save(dict(params=_full(model), rows=rows), f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_dp2_sp2_updates_equal_dp2_sp1(model_dirs, tmp_path):
    import torch.multiprocessing as mp

    for world, sp_size in ((4, 2), (2, 1)):
        mp.start_processes(_dp_rank, args=(world, _free_port(), sp_size, model_dirs["kv1"], str(tmp_path / f"w{world}")),
                           nprocs=world, join=True, start_method="spawn")
    sp2 = [torch.load(tmp_path / f"w4.{r}", weights_only=False) for r in range(4)]
    sp1 = [torch.load(tmp_path / f"w2.{r}", weights_only=False) for r in range(2)]
    before = load(model_dirs["kv1"]).state_dict()
    max_delta = max((v - before[k]).abs().max().item() for k, v in sp1[0]["params"].items())
    assert max_delta > 1e-4
    for k, v in sp1[0]["params"].items():
        torch.testing.assert_close(sp2[0]["params"][k], v, atol=1e-4 * max_delta, rtol=1e-4, msg=k)
    for step in (0, 1):  # each rank got back the log-probs of its own share, in the dispatcher's order
        torch.testing.assert_close(torch.cat([sp2[r]["rows"][step] for r in range(4)]),
                                   torch.cat([sp1[r]["rows"][step] for r in range(2)]), atol=1e-5, rtol=1e-5)


def test_sequence_parallelism_refuses_padded_batches(model_dirs):
    """S ranks split a packed row: the actor and the critic say which key to set when packing is off
    (the config check says it first, tests/trainer/test_config.py; this is the worker's own guard)."""
    from verl_arpo.utils.ulysses import SequenceParallel

    sp = SequenceParallel(size=2, rank=0)  # the check comes before any collective
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.model\.use_remove_padding=true"):
        DataParallelPPOActor(None, load(model_dirs["kv1"]), use_remove_padding=False, sp=sp)
    with pytest.raises(ValueError, match=r"critic\.model\.use_remove_padding=true"):
        DataParallelPPOCritic(critic_module=load_critic(model_dirs["kv1"]), sp=sp,
                              **critic_kwargs(model={"use_remove_padding": False}))


# --------------------------------------------------------------------------------------------
# [issue 48] the flash branch: transformers' flash path loads the kernel its module's config names
# --------------------------------------------------------------------------------------------
def _stand_in_flash(query, key, value, attention_mask, query_length=None, is_causal=True, dropout=0.0,
                    softmax_scale=None, attn_implementation=None, position_ids=None, **kwargs):
    """Stands in for flash-attn's varlen kernel (q, k, v [B, N, H, D]): causal attention within each
    packed sequence, whose starts are where position_ids is 0. Like the real loader, it refuses an
    implementation name that is no flash kernel."""
    if attn_implementation not in ("flash_attention_2", "flash_attention_3"):
        raise ValueError("Could not find the currently requested flash attention implementation at "
                         f"`{attn_implementation}`")
    import torch.nn.functional as F

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))     # [B, H, N, D]
    starts = (position_ids[0] == 0).nonzero().flatten().tolist() + [q.shape[2]]
    out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=softmax_scale,
                                                    is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
                     for a, b in zip(starts[:-1], starts[1:]) if b > a], dim=2)
    return out.transpose(1, 2)


def _sp2_flash_rank(rank, world, port, model_dir, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.integrations import flash_attention

    from verl_arpo.utils.ulysses import build_sequence_parallel

    _init(rank, world, port)
    try:
        flash_attention._flash_attention_forward = _stand_in_flash
        sp = build_sequence_parallel(2)
        model = load(model_dir, False)
        model.config._attn_implementation = "flash_attention_2"   # as loading with attn_implementation= would set
        model = _shard(model, init_device_mesh("cpu", (world,)))
        data = shared_prompt_batch(model.config.vocab_size, seed=11)
        actor = DataParallelPPOActor(actor_module=model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                     use_remove_padding=True, sp=sp, temperature=0.7,
                                     **actor_kwargs(loss_agg_mode="token-mean", ppo_micro_batch_size_per_gpu=3,
                                                    ppo_mini_batch_size=6))
        lp, ent = actor.compute_log_prob(DataProto(batch=data.batch), log_probs(4),
                                         calculate_entropy=True)
        torch.save(dict(lp=lp, ent=ent), f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_sp2_with_a_flash_kernel_finds_it_and_equals_one_process(model_dirs, tmp_path):
    """Before the fix the wrapper's registered name reached the flash loader: "Could not find the
    currently requested flash attention implementation" at the first compute_log_prob."""
    import torch.multiprocessing as mp

    out = tmp_path / "flash"
    mp.start_processes(_sp2_flash_rank, args=(2, _free_port(), model_dirs["kv1"], str(out)), nprocs=2, join=True,
                       start_method="spawn")
    model = load(model_dirs["kv1"], False)
    data = shared_prompt_batch(model.config.vocab_size, seed=11)
    actor = DataParallelPPOActor(actor_module=model, actor_optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                 use_remove_padding=True, temperature=0.7, **actor_kwargs(loss_agg_mode="token-mean",
                                                                         ppo_micro_batch_size_per_gpu=3,
                                                                         ppo_mini_batch_size=6))
    lp, ent = actor.compute_log_prob(DataProto(batch=data.batch), log_probs(4),
                                     calculate_entropy=True)
    for r in range(2):
        got = torch.load(f"{out}.{r}", weights_only=False)
        torch.testing.assert_close(got["lp"], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["ent"], ent, atol=1e-5, rtol=1e-5)
