"""Memory of Ulysses sequence parallelism on CPU: one actor update at S = 2 against S = 1, for the same
trajectories (docs/sequence_parallel.md).

Each case is a real run: S processes on gloo, the actor's update (forward, loss, backward) on one
packed micro-batch of `--rows` trajectories of L tokens, through DataParallelPPOActor with its
Ulysses attention at S = 2. Per rank it records
- activation memory: the bytes autograd saves for the backward (unique storages, the parameters
  excluded), read with torch.autograd.graph.saved_tensors_hooks: what sequence parallelism divides;
- the update's peak RSS rise (VmHWM reset before it): activations plus gradients, logits, the mask
  and allocator slack, what the process really needed;
- the update's wall time.
Then the longest trajectory whose activations fit a fixed cap (`--cap_mib` per rank), searched over
lengths doubling from 256, at S = 1 and S = 2.

The model is Llama-shaped and small (hidden 256, 4 layers, 4 query / 2 kv heads, the tiny tokenizer's
vocabulary), so the measured part is the layers', as in a long-context run of a large model; no
FSDP (each rank holds the whole model: the parameters do not change with S, and are not counted).

    python benchmarks/bench_sequence_parallel.py                 # writes benchmarks/results/sequence_parallel.json
    python benchmarks/bench_sequence_parallel.py --quick         # the smoke test's sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import RESULTS, machine_info, print_table, summary_entry, tiny_model, write_json  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=65536)


def _batch(vocab: int, rows: int, length: int, seed: int = 0):
    """`rows` trajectories of `length` tokens (a 32-token prompt, the rest response), as the rollout makes them."""
    import torch

    from verl_arpo.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    p, r = 32, length - 32
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    attn = torch.ones(rows, length, dtype=torch.long)
    pos = torch.arange(length).expand(rows, length).clone()
    mask = torch.ones(rows, r, dtype=torch.long)
    return DataProto.from_dict(tensors=dict(
        input_ids=ids, attention_mask=attn, position_ids=pos, responses=ids[:, p:], response_mask=mask,
        advantages=torch.randn(rows, 1, generator=g).expand(rows, r).contiguous(),
        old_log_probs=torch.full((rows, r), -8.0)))


def _measure(model, actor, data) -> dict:
    """One update: saved-for-backward bytes (parameters excluded), peak RSS rise, seconds."""
    import torch

    from verl_arpo.workers.host_memory import _read_hwm, _reset_hwm, _rss

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.device.type == "cpu":
            seen[st.data_ptr()] = st.nbytes()
        return t

    start = _rss()
    _reset_hwm()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.update_policy(data)
    seconds = time.perf_counter() - t0
    return dict(activation_mib=sum(seen.values()) / 2**20, peak_rise_mib=(_read_hwm() - start) / 2**20, seconds=seconds)


def _rank(rank: int, world: int, port: int, model_dir: str, rows: int, lengths: list[int], out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from verl_arpo.config import ActorConfig, Batching
    from verl_arpo.utils.ulysses import build_sequence_parallel
    from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sp = build_sequence_parallel(world)
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
        actor = DataParallelPPOActor(ActorConfig(loss_agg_mode="token-mean"), model, torch.optim.SGD(model.parameters(), lr=0.0),
                                     update=Batching(micro_batch=rows, use_dynamic_bsz=False, max_token_len=0, mini_batch=rows),
                                     use_remove_padding=True, sp=sp)
        results = []
        for length in lengths:
            data = _batch(model.config.vocab_size, rows, length)
            actor.update_policy(data)  # warm-up: the allocator's first growth is not the update's
            results.append(dict(length=length, **_measure(model, actor, data)))
        Path(f"{out}.{rank}").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_case(model_dir: str, sp: int, rows: int, lengths: list[int], tmp: Path) -> list[dict]:
    """S = `sp` ranks; per length, the maximum over ranks of each measure."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"sp{sp}"
    mp.start_processes(_rank, args=(sp, port, model_dir, rows, lengths, str(out)), nprocs=sp, join=True,
                       start_method="spawn")
    per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(sp)]
    return [{k: (max(r[i][k] for r in per_rank) if k != "length" else per_rank[0][i][k]) for k in per_rank[0][i]}
            for i in range(len(lengths))]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1, help="trajectories in the micro-batch (one long one by default)")
    p.add_argument("--length", type=int, default=8192, help="tokens per trajectory of the S = 1 vs S = 2 row")
    p.add_argument("--cap_mib", type=float, default=512.0, help="activation memory per rank for the longest-fit search")
    p.add_argument("--max_length", type=int, default=16384, help="the longest length the search tries")
    p.add_argument("--quick", action="store_true", help="small sizes (the smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS / "sequence_parallel.json")
    return p


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.rows, a.length, a.cap_mib, a.max_length = 1, 256, 24.0, 1024
    search = [n for n in (256 * 2**i for i in range(12)) if n <= a.max_length]
    with tempfile.TemporaryDirectory(prefix="bench_sp_") as d:
        tmp = Path(d)
        model_dir = tiny_model(tmp, **SHAPE)
        lengths = sorted(set(search) | {a.length})
        by_sp = {s: run_case(model_dir, s, a.rows, lengths, tmp) for s in (1, 2)}
    same = {s: next(r for r in by_sp[s] if r["length"] == a.length) for s in (1, 2)}
    row = dict(length=a.length, rows=a.rows,
               activation_mib_sp1=same[1]["activation_mib"], activation_mib_sp2=same[2]["activation_mib"],
               activation_ratio=same[2]["activation_mib"] / same[1]["activation_mib"],
               peak_rise_mib_sp1=same[1]["peak_rise_mib"], peak_rise_mib_sp2=same[2]["peak_rise_mib"],
               peak_ratio=same[2]["peak_rise_mib"] / max(same[1]["peak_rise_mib"], 1e-9),
               seconds_sp1=same[1]["seconds"], seconds_sp2=same[2]["seconds"])
    print_table([row], list(row), "one update, per rank (max over ranks): S = 2 against S = 1")
    fits = {s: max((r["length"] for r in by_sp[s] if r["activation_mib"] <= a.cap_mib and r["length"] in search),
                   default=None) for s in (1, 2)}
    fit_rows = [dict(sp=s, longest_fitting_length=fits[s], cap_mib=a.cap_mib,
                     **{f"activation_mib_at_{r['length']}": round(r["activation_mib"], 1) for r in by_sp[s]
                        if r["length"] in search}) for s in (1, 2)]
    print_table(fit_rows, ["sp", "longest_fitting_length", "cap_mib"],
                f"the longest trajectory whose activations fit {a.cap_mib:g} MiB per rank (lengths doubling from 256)")
    summary = [
        summary_entry(f"activation memory per rank, one {a.length}-token update: S=1 / S=2 (MiB)",
                      same[2]["activation_mib"], same[1]["activation_mib"],
                      same[1]["activation_mib"] / same[2]["activation_mib"], 1.6),
        summary_entry("peak RSS rise of the update per rank: S=1 / S=2 (MiB)", same[2]["peak_rise_mib"],
                      same[1]["peak_rise_mib"], same[1]["peak_rise_mib"] / max(same[2]["peak_rise_mib"], 1e-9), None),
        summary_entry(f"longest trajectory under {a.cap_mib:g} MiB of activations: S=2 / S=1 (tokens)", fits[2], fits[1],
                      (fits[2] / fits[1]) if fits[1] and fits[2] else None, 1.6)]
    payload = {"machine": machine_info(), "model": SHAPE, "same_length": row, "longest_fit": fit_rows,
               "per_length": {f"sp{s}": by_sp[s] for s in (1, 2)}, "summary": summary}
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()
