"""The decode step's kernels on this CPU: bf16 against fp32, and whether a batch's row count changes a
row's bits (docs/performance.md, "The quickstart on a CPU with native bf16").

Three measurements, at SmolLM2-135M's shapes (hidden 576, MLP 1536, 9 query / 3 key-value heads of 64):

- **linears**: one decoder layer's seven linears (q, k, v, o, gate, up, down) on `rows` rows, bf16
  against fp32 (the baseline, same run); GFLOP/s = 2 · rows · Σ in·out / seconds. Native bf16 (AMX,
  AVX-512 BF16) shows as a ratio above 1 at many rows; emulated bf16 far below 1.
- **decode attention**: `grouped_decode_attention` (the HF engine's CPU decode attention) at `rows` rows
  × `cached` tokens, bf16 against fp32, and its two batched matmuls alone (how much of it is the
  matmuls).
- **the cache's layout**: the decode cache (kv_room.py) hands keys and values as views of the first
  `cached` positions of a buffer with `--room` more, so a row's block is `cached` of `cached + room`
  positions apart. The two batched matmuls on those views (the strided baseline) against the same
  matmuls on contiguous copies, the copy included (what `grouped_decode_attention` now does), and
  whether both give the same bits.
- **row-count dependence**: the row counts m for which `F.linear` of the first m rows alone differs in
  any bit from the same rows of the full batch. A lever that changes which rows a decode step computes
  together (larger batches, compacting the cache less often) changes the numbers where this is not
  empty (issue 47 then asks for the 4-seed-pair check).

    python benchmarks/bench_decode_kernels.py [--quick] [--threads 2] [--out PATH]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import machine_info, median, print_table, summary_entry, write_json  # noqa: E402

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
LAYER_LINEARS = [(HIDDEN, HEADS * HEAD_DIM), (HIDDEN, KV_HEADS * HEAD_DIM), (HIDDEN, KV_HEADS * HEAD_DIM),
                 (HEADS * HEAD_DIM, HIDDEN), (HIDDEN, MLP), (HIDDEN, MLP), (MLP, HIDDEN)]
"""(in, out) of one decoder layer's linears: q, k, v, o, gate, up, down."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def layer_flops(rows: int) -> int:
    """2 · rows · Σ in·out over the layer's linears."""
    return 2 * rows * sum(i * o for i, o in LAYER_LINEARS)


def median_seconds(fn, reps: int) -> float:
    """Median seconds of `reps` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times)


def time_layer_linears(rows: int, dtype: torch.dtype, reps: int) -> float:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g).to(dtype) for i, o in LAYER_LINEARS]
    inputs = {i: torch.randn(rows, i, generator=g).to(dtype) for i, _ in LAYER_LINEARS}
    return median_seconds(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], reps)


def time_decode_attention(rows: int, cached: int, dtype: torch.dtype, reps: int) -> tuple[float, float]:
    """Seconds of grouped_decode_attention and of its two batched matmuls alone."""
    from verl_arpo.workers.rollout.engines.decode_attention import grouped_decode_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(rows, KV_HEADS, cached, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(rows, KV_HEADS, cached, HEAD_DIM, generator=g).to(dtype)
    mask = torch.ones(rows, 1, 1, cached, dtype=torch.bool)
    mask[:, :, :, : cached // 10] = False   # left padding, as a batch of different lengths has
    whole = median_seconds(lambda: grouped_decode_attention(None, q, k, v, mask), reps)
    qg = q.reshape(rows, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    p = torch.softmax(torch.matmul(qg, k.transpose(-1, -2)).float(), -1).to(dtype)
    matmuls = median_seconds(lambda: (torch.matmul(qg, k.transpose(-1, -2)), torch.matmul(p, v)), reps)
    return whole, matmuls


def time_cache_layout(rows: int, cached: int, room: int, dtype: torch.dtype, reps: int) -> dict:
    """The decode attention's two matmuls on views of a buffer with room (as the cache passes them)
    against contiguous copies of those views, the copy timed too; and whether the products are equal."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(rows, KV_HEADS, cached + room, HEAD_DIM, generator=g).to(dtype)[:, :, :cached]
    v = torch.randn(rows, KV_HEADS, cached + room, HEAD_DIM, generator=g).to(dtype)[:, :, :cached]
    p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).float(), -1).to(dtype)

    def strided():
        return torch.matmul(q, k.transpose(-1, -2)), torch.matmul(p, v)

    def copied():
        return torch.matmul(q, k.contiguous().transpose(-1, -2)), torch.matmul(p, v.contiguous())

    same = all(torch.equal(a, b) for a, b in zip(strided(), copied()))
    strided_s, copied_s = median_seconds(strided, reps), median_seconds(copied, reps)
    return {"dtype": "bf16" if dtype == torch.bfloat16 else "fp32", "rows": rows, "cached": cached, "room": room,
            "strided_ms": strided_s * 1e3, "copied_ms": copied_s * 1e3, "speedup": strided_s / copied_s,
            "same_bits": same}


def rows_that_differ(dtype: torch.dtype, batch: int, candidates: list[int]) -> list[int]:
    """The m in `candidates` for which F.linear(x[:m]) differs in any bit from F.linear(x)[:m]."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(MLP, HIDDEN, generator=g).to(dtype)
    x = torch.randn(batch, HIDDEN, generator=g).to(dtype)
    full = F.linear(x, w)
    return [m for m in candidates if m < batch and not torch.equal(F.linear(x[:m], w), full[:m])]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="4,12,150,1024", help="comma-separated row counts of the linears")
    p.add_argument("--attn_rows", type=int, default=150)
    p.add_argument("--cached", type=int, default=300, help="cached tokens per row of the decode attention")
    p.add_argument("--room", type=int, default=256, help="spare positions of the decode cache's buffer (kv_room.ROOM)")
    p.add_argument("--layout_rows", default="12,150", help="rows of the cache-layout case (an RL worker's, the evaluation's)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_kernels.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.attn_rows, a.cached, a.reps, a.layout_rows, a.room = "4,32", 16, 64, 3, "4,16", 32
    torch.set_num_threads(a.threads)
    machine = machine_info()

    linears = []
    for rows in [int(r) for r in a.rows.split(",")]:
        sec = {name: time_layer_linears(rows, dt, a.reps) for name, dt in DTYPES.items()}
        linears.append({"rows": rows, **{f"{n}_ms": s * 1e3 for n, s in sec.items()},
                        **{f"{n}_gflops": layer_flops(rows) / s / 1e9 for n, s in sec.items()},
                        "bf16_over_fp32": sec["fp32"] / sec["bf16"]})
    print_table(linears, ["rows", "bf16_ms", "fp32_ms", "bf16_gflops", "fp32_gflops", "bf16_over_fp32"],
                f"one decoder layer's linears, {a.threads} threads")

    attention = []
    for name, dt in DTYPES.items():
        whole, matmuls = time_decode_attention(a.attn_rows, a.cached, dt, a.reps)
        attention.append({"dtype": name, "rows": a.attn_rows, "cached": a.cached, "ms": whole * 1e3,
                          "matmuls_ms": matmuls * 1e3, "matmul_share": matmuls / whole})
    print_table(attention, ["dtype", "rows", "cached", "ms", "matmuls_ms", "matmul_share"],
                "grouped decode attention, one layer")

    layout = [time_cache_layout(int(rows), a.cached, a.room, dt, a.reps)
              for rows in a.layout_rows.split(",") for dt in DTYPES.values()]
    print_table(layout, ["dtype", "rows", "cached", "room", "strided_ms", "copied_ms", "speedup", "same_bits"],
                "decode attention's matmuls on the cache's views: strided against copied first, one layer")

    candidates = [1, 2, 3, 4, 5, 8, 12, 16, 17, 32, 64, 100, 149]
    differ = {name: rows_that_differ(dt, 150, candidates) for name, dt in DTYPES.items()}
    print(f"row counts whose rows differ from the same rows of a 150-row batch: {differ}")

    summary = [summary_entry(f"decode-layer linears at {r['rows']} rows: bf16 GFLOP/s (fp32 baseline)",
                             r["bf16_gflops"], r["fp32_gflops"], r["bf16_over_fp32"], None) for r in linears]
    bf16_attn, fp32_attn = attention
    summary.append(summary_entry(f"decode attention, {a.attn_rows} rows x {a.cached} cached: bf16 ms (fp32 baseline)",
                                 bf16_attn["ms"], fp32_attn["ms"], fp32_attn["ms"] / bf16_attn["ms"], None))
    summary += [summary_entry(f"decode attention's matmuls on the cache's views, {r['dtype']}, {r['rows']} rows x "
                              f"{r['cached']} cached: copied first, ms (strided baseline; same bits: {r['same_bits']})",
                              r["copied_ms"], r["strided_ms"], r["speedup"], None) for r in layout]
    payload = {"machine": machine, "threads": a.threads, "linears": linears, "attention": attention, "cache_layout": layout,
               "row_count_changes_bits": differ, "row_candidates": candidates, "summary": summary}
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()
