"""param_offload and optimizer_offload keep the numerics (docs/gpu.md, "Offload").

Two gloo ranks, the tiny model under FSDP2, two PPO updates per combination of
(param_offload: FSDP2's CPUOffloadPolicy, optimizer_offload: Adam moments moved to the host between
updates and back to their parameters' device for the step) — the worker's own helpers. On the CPU
the copies are no-ops, but every offload code path runs: the CPU-resident DTensor shards and their
gradients, the global-norm clip over them, the moments' round trip. All four combinations must give
bit-identical parameters.
"""
from __future__ import annotations

import itertools
import os

import torch
from test_dp_actor import _free_port, load_model, make_batch
from worker_configs import actor_kwargs, rank_share

from verl_arpo.protocol import DataProto

COMBOS = list(itertools.product([False, True], [False, True]))


def _rank(rank, world, port, model_dir, data_path, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
    from verl_arpo.workers.optim_step import build_adamw, move_optimizer_state
    from verl_arpo.workers.sharded_model import load_causal_lm, shard_fsdp2
    from verl_arpo.config import OptimConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh, data, half = rank_share(data_path, rank, world)
        results = {}
        for param_offload, optimizer_offload in COMBOS:
            model = shard_fsdp2(load_causal_lm(model_dir), mesh, cpu_offload=param_offload)
            opt = build_adamw(model.parameters(), OptimConfig(lr=1e-2))
            actor = DataParallelPPOActor(actor_module=model, actor_optimizer=opt, device=torch.device("cpu"),
                                         **actor_kwargs(ppo_mini_batch_size=half, ppo_micro_batch_size_per_gpu=2,
                                                        grad_clip=0.5))
            for _ in range(2):
                if optimizer_offload:
                    move_optimizer_state(opt, None)
                actor.update_policy(DataProto(batch=data.batch.clone(), meta_info=dict(data.meta_info)))
                if optimizer_offload:
                    move_optimizer_state(opt, torch.device("cpu"))
            results[(param_offload, optimizer_offload)] = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def test_offload_combinations_keep_identical_numerics(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    data = make_batch(load_model(tiny_model_dir).config.vocab_size, B=8, seed=3,
                      prompt_lens=[6, 5, 6, 4, 1, 2, 1, 3], resp_lens=[8, 7, 8, 6, 2, 3, 2, 4])
    data_path, out_path = tmp_path / "data.pt", tmp_path / "out.pt"
    torch.save(data, data_path)
    mp.start_processes(_rank, args=(2, _free_port(), tiny_model_dir, str(data_path), str(out_path)), nprocs=2,
                       join=True, start_method="spawn")
    results = torch.load(out_path, weights_only=False)
    base = results[(False, False)]
    initial = load_model(tiny_model_dir).state_dict()
    assert max((base[k] - initial[k]).abs().max().item() for k in base) > 1e-3  # the updates moved the weights
    for combo in COMBOS[1:]:
        for k, v in results[combo].items():
            torch.testing.assert_close(v, base[k], rtol=0, atol=0, msg=f"{combo} {k}")
