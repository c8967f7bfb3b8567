"""The actor update on 2 FSDP2 ranks, lever by lever, against FSDP2's defaults measured in the same run.

The quickstart's RL stage trains on 2 Ray workers of one CPU thread each, FSDP2 over gloo, bf16 compute
with fp32 master weights and fp32 gradient reduction, packed micro-batches with prefix sharing under a
token budget. `bench_actor_update.py` times one rank, where the collectives are local copies; this
benchmark times the two ranks, where they are not (docs/performance.md, "Parameters gathered once a
mini-batch" and "Gradients reduced once a mini-batch"). Cases, each in its own pair of processes:

- `defaults`: FSDP2 as it comes (`reshard_after_forward=true`): every decoder layer all-gathered in the
  forward and again in the backward of every micro-batch, the gradients reduce-scattered after every
  micro-batch;
- `gather_once`: `fsdp_config.reshard_after_forward=false` (the quickstart's): one all-gather a mini-batch;
- `gather_once + grad_sync_once`: also `fsdp_config.grad_sync_once=true`: one reduce-scatter a mini-batch.

The data: `--rows` trajectories (groups of 4 sharing a prompt, bench_actor_update._batch), rank r
taking the r-th half, one mini-batch a step. Every case trains `DataParallelPPOActor.update_policy`,
the worker's class, from the same weights on the same rows: 1 warm-up step, then `--steps` timed
(median of rank 0's wall, which includes waiting for the other rank). It reports trained tokens/s of
both ranks together, the ratio to `defaults`, each rank's peak RSS, and the first step's gradient
norm (`gather_once` must equal `defaults` bit for bit; `grad_sync_once` to the fp32 sum's rounding).

    python benchmarks/bench_update_ranks.py [--model DIR] [--rows 24] [--steps 3] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

CASES = [  # label, reshard_after_forward, grad_sync_once
    ("defaults", True, False),
    ("gather_once", False, False),
    ("gather_once + grad_sync_once", False, True),
]
WORLD = 2


def _rank(rank: int, spec: dict, out_dir: str) -> None:
    """One rank of one case: build the worker's sharded model and actor, time its updates."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), OMP_NUM_THREADS=str(spec["threads"]))
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    from bench_actor_update import _batch
    from verl_arpo.config import ActorConfig, Batching, FSDPConfig, MixedPrecisionConfig, OptimConfig
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
    from verl_arpo.workers.host_memory import HOST_MEMORY
    from verl_arpo.workers.optim_step import build_adamw
    from verl_arpo.workers.sharded_model import fsdp_mixed_precision, init_sharded_model, load_causal_lm, shard_fsdp2

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        vocab = AutoConfig.from_pretrained(spec["model"]).vocab_size
        full = _batch(vocab, int(spec["rows"]), int(spec["response_max"]))
        half = len(full) // WORLD
        data = full.slice(rank * half, (rank + 1) * half)
        mesh = init_device_mesh("cpu", (WORLD,))
        mp = fsdp_mixed_precision(MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32"), "cpu")
        model = init_sharded_model(lambda: load_causal_lm(spec["model"], attn="sdpa"),
                                   lambda: load_causal_lm(spec["model"], empty=True, attn="sdpa"),
                                   lambda m: shard_fsdp2(m, mesh, mp_policy=mp,
                                                         reshard_after_forward=spec["reshard_after_forward"]),
                                   torch.device("cpu"))
        opt = build_adamw(model.parameters(), OptimConfig(lr=1e-6))
        update = Batching(micro_batch=half, use_dynamic_bsz=True, max_token_len=int(spec["micro_tokens"]),
                          mini_batch=half)
        config = ActorConfig(grad_clip=1.0, fsdp_config=FSDPConfig(reshard_after_forward=spec["reshard_after_forward"],
                                                                   grad_sync_once=spec["grad_sync_once"]))
        actor = DataParallelPPOActor(config, model, opt, update=update, use_remove_padding=True,
                                     use_prefix_sharing=True, on_policy=True, dp_group=None,
                                     gather_once=not spec["reshard_after_forward"])
        first = actor.update_policy(data)
        HOST_MEMORY.take_window_peak()
        times = []
        for _ in range(int(spec["steps"])):
            dist.barrier()
            t = time.perf_counter()
            actor.update_policy(data)
            dist.barrier()   # the step ends when the slower rank ends
            times.append(time.perf_counter() - t)
        tokens = torch.tensor([float(data.batch["attention_mask"].sum())])
        dist.all_reduce(tokens)
        result = dict(step_s=statistics.median(times), times=times, tokens=float(tokens),
                      grad_norm=float(first["actor/grad_norm"][-1]), peak_mib=HOST_MEMORY.take_window_peak() / 2**20)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_case(spec: dict) -> dict:
    """Both ranks of a case in fresh processes; rank 0's times, both ranks' peaks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec = {**spec, "port": s.getsockname()[1]}
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(spec, out), nprocs=WORLD, join=True, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    r0 = ranks[0]
    return {**spec, "step_s": r0["step_s"], "times": r0["times"], "tokens": r0["tokens"],
            "tok_per_s": r0["tokens"] / r0["step_s"], "grad_norm": r0["grad_norm"],
            "peak_mib_per_rank": [r["peak_mib"] for r in ranks]}


def summarize(rows: list[dict]) -> list[dict]:
    """Each lever against `defaults` of the same run (trained tokens/s; higher is better)."""
    from bench_common import summary_entry

    base = next((r for r in rows if r["label"] == "defaults"), None)
    if base is None:
        return []
    out = [summary_entry(f"2-rank update tok/s, {r['label']} / FSDP2 defaults", r["tok_per_s"], base["tok_per_s"],
                         r["tok_per_s"] / base["tok_per_s"], 1.0, peak_mib=max(r["peak_mib_per_rank"]),
                         bare_peak_mib=max(base["peak_mib_per_rank"]))
           for r in rows if r is not base]
    once = {r["label"]: r for r in rows}
    if {"gather_once", "gather_once + grad_sync_once"} <= set(once):   # the second lever on top of the first
        r, b = once["gather_once + grad_sync_once"], once["gather_once"]
        out.append(summary_entry("2-rank update tok/s, gather_once + grad_sync_once / gather_once", r["tok_per_s"],
                                 b["tok_per_s"], r["tok_per_s"] / b["tok_per_s"], 1.0,
                                 peak_mib=max(r["peak_mib_per_rank"]), bare_peak_mib=max(b["peak_mib_per_rank"])))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--rows", type=int, default=24, help="trajectories of both ranks (the quickstart's step: 24)")
    p.add_argument("--response_max", type=int, default=288)
    p.add_argument("--micro_tokens", type=int, default=768, help="token budget of a micro-batch (the quickstart's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (the quickstart's workers: 1)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="repetitions of every case, alternated")
    p.add_argument("--quick", action="store_true", help="the tiny model, 8 rows, 1 timed step, 1 repetition")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "update_ranks.json"))
    a = p.parse_args(argv)
    from bench_common import smollm2_dir, tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            a.rows, a.steps, a.reps, a.response_max, a.micro_tokens = 8, 1, 1, 64, 256
        model = a.model or (tiny_model(Path(tmp)) if a.quick else smollm2_dir())
        runs = []
        for rep in range(a.reps):
            for label, reshard, once in CASES:
                r = run_case(dict(model=model, rows=a.rows, response_max=a.response_max, micro_tokens=a.micro_tokens,
                                  threads=a.threads, steps=a.steps, reshard_after_forward=reshard, grad_sync_once=once))
                runs.append({**r, "label": label, "rep": rep})
                print(f"{label:<32} rep {rep}: {r['step_s']:.2f} s a step, {r['tok_per_s']:.0f} tok/s, peak "
                      f"{'/'.join(f'{m:.0f}' for m in r['peak_mib_per_rank'])} MiB, grad norm {r['grad_norm']:.6g}",
                      flush=True)
                save(a, runs)   # after every case: a run cut short keeps what it measured


def save(a: argparse.Namespace, runs: list[dict]) -> None:
    """The runs so far and each case's row: the median over its repetitions."""
    from bench_common import machine_info, write_json

    rows = []
    for label, _, _ in CASES:
        mine = [r for r in runs if r["label"] == label]
        if not mine:
            continue
        step = statistics.median(r["step_s"] for r in mine)
        rows.append(dict(label=label, step_s=step, tok_per_s=mine[0]["tokens"] / step, grad_norm=mine[0]["grad_norm"],
                         peak_mib_per_rank=[max(r["peak_mib_per_rank"][k] for r in mine) for k in range(WORLD)],
                         reps=[r["step_s"] for r in mine]))
    write_json(a.out, dict(benchmark="update_ranks", args=vars(a), machine=machine_info(), runs=runs, rows=rows,
                           summary=summarize(rows), load_avg=list(os.getloadavg())))


if __name__ == "__main__":
    main()
