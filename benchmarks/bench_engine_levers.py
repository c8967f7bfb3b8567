"""HF engine levers on the quickstart's evaluation shape: decode attention and a shared prompt prefix.

Workload: the first `--prompts` questions of the bundled test split with their system prompt
(chat template; ~118 of ~140 tokens are the same in every prompt), greedy, up to `--new_tokens`
tokens each, all rows in one batch, SmolLM2-135M-Instruct (or `--model`) in `--dtype` (auto: bf16
where the CPU has native bf16, else fp32), one process with `--threads` torch threads. Cases, each in
a fresh subprocess:

1. sdpa attention, every prompt prefilled in full (baseline);
2. grouped decode attention (`decode_attention.py`), full prefill;
3. grouped decode attention + the shared prefix encoded once, the cache grown by concatenation;
4. as 3, with the decode cache appending into room set aside in advance (`kv_room.py`): the engine now
   in fp32;
5. as 4, with each layer's q/k/v and gate/up projections one matmul in a decode step
   (`fused_projections.py`): the engine now in bf16 on a CPU.

Reports wall seconds of `generate` (the median over `--reps` alternated runs), generated tokens/s,
prefilled tokens, peak RSS of the process,
the ratio to the first case run in the same run, how many rows produced exactly its tokens
(rounding differs between attention kernels, so a few greedy rows may take another token), and how
many rows equal the previous case's in tokens and in every log-prob bit (cases 3, 4 and 5 do the same
arithmetic, so all should).

    python benchmarks/bench_engine_levers.py [--model DIR] [--quick] [--cases 1,3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CASES = [  # (label, attention, share_prefix, kv_room, fuse_projections)
    ("sdpa, full prefill (before)", "sdpa", False, 0, False),
    ("grouped decode attention, full prefill", None, False, 0, False),
    ("grouped decode attention + shared prefix", None, True, 0, False),
    ("grouped decode attention + shared prefix + decode cache room (now in fp32)", None, True, None, False),
    ("as 4 + fused q/k/v and gate/up in decode steps (now in bf16)", None, True, None, True),
]


def child(spec: dict) -> dict:
    import resource

    import torch
    from transformers import AutoTokenizer

    from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
    from verl_arpo.workers.rollout.engines.hf_engine import HFEngine

    torch.set_num_threads(int(spec["threads"]))
    tok = AutoTokenizer.from_pretrained(spec["model"])
    prompts = [tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for r in spec["rows"]]
    eng = HFEngine(spec["model"], tok, dtype=spec["dtype"], attn_implementation=spec["attention"],
                   max_batch_size=len(prompts), share_prefix=spec["share_prefix"],
                   fuse_projections=spec["fuse_projections"],
                   **({} if spec["kv_room"] is None else {"kv_room": spec["kv_room"]}))
    reqs = [GenRequest(str(i), p, int(spec["new_tokens"]), [], SamplingParams(greedy=True))
            for i, p in enumerate(prompts)]
    eng.generate(reqs[:2])   # warm-up (kernels, allocator)
    eng.release()
    eng.reset_stats()
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    wall = time.perf_counter() - t0
    gen = sum(len(o.token_ids) for o in outs)
    return dict(wall_s=wall, generated=gen, tok_per_s=gen / wall, prefill_tokens=eng.stats["prefill_tokens"],
                attention=eng.model.config._attn_implementation, tokens=[o.token_ids for o in outs],
                logprobs=[o.logprobs for o in outs],
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(Path(sys.argv[2]).read_text()))))
        return
    from bench_common import machine_info, print_table, prompt_rows, run_case, summary_entry, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--prompts", type=int, default=150)
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="16 prompts, 24 tokens")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 where the CPU has native bf16, else float32")
    p.add_argument("--cases", default="1,2,3,4,5", help="which cases (1-5), the first is the baseline")
    p.add_argument("--reps", type=int, default=1,
                   help="run the cases this many times, alternating (1,2,..,1,2,..); the table gives medians")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_levers.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.new_tokens = 16, 24
    model = a.model
    if model is None:
        from bench_common import smollm2_dir

        model = smollm2_dir()
    if a.dtype == "auto":
        from verl_arpo.utils.device import cpu_has_fast_bf16

        a.dtype = "bfloat16" if cpu_has_fast_bf16() else "float32"
    rows = prompt_rows(a.prompts, ROOT / "rl_datasets" / "test.parquet")
    cases = [int(c) for c in a.cases.split(",")]
    runs: dict[int, list[dict]] = {k: [] for k in cases}
    for _ in range(max(1, a.reps)):   # alternated, so that a drift in the machine's load hits every case
        for k in cases:
            label, attention, share, room, fuse = CASES[k - 1]
            runs[k].append(run_case(__file__, dict(model=model, rows=rows, new_tokens=a.new_tokens,
                                                   threads=a.threads, attention=attention, share_prefix=share,
                                                   kv_room=room, fuse_projections=fuse, dtype=a.dtype)))
    results = []
    for k in cases:
        walls = [r["wall_s"] for r in runs[k]]
        median = sorted(runs[k], key=lambda r: r["wall_s"])[(len(walls) - 1) // 2]
        results.append({**median, "label": f"{k}. {CASES[k - 1][0]}", "wall_s_reps": walls,
                        "peak_rss_mib_reps": [r["peak_rss_mib"] for r in runs[k]]})
    base = results[0]
    table = []
    for prev, r in zip([None] + results[:-1], results):
        r["rows_bit_equal_to_previous"] = None if prev is None else sum(
            t == pt and lp == plp for t, pt, lp, plp in zip(r["tokens"], prev["tokens"], r["logprobs"], prev["logprobs"]))
        same = sum(t == b for t, b in zip(r["tokens"], base["tokens"]))
        table.append({"case": r["label"], "attention": r["attention"], "generate s": f"{r['wall_s']:.1f}",
                      "generated tok/s": f"{r['tok_per_s']:.0f}", "prefilled tokens": r["prefill_tokens"],
                      "speed-up": f"{base['wall_s'] / r['wall_s']:.2f}x", "rows = first": f"{same}/{len(rows)}",
                      "rows bit-equal to previous": ("—" if r["rows_bit_equal_to_previous"] is None
                                                     else f"{r['rows_bit_equal_to_previous']}/{len(rows)}"),
                      "peak RSS MiB": f"{r['peak_rss_mib']:.0f}"})
    print_table(table, list(table[0]), title=f"HF engine levers: {a.prompts} prompts x {a.new_tokens} tokens, "
                                             f"{a.dtype}, {a.threads} threads, load {os.getloadavg()[0]:.1f}")
    now = results[-1]
    summary = [summary_entry(f"generate wall s, {base['label'][:1]} / {now['label'][:1]} (same run)", now["wall_s"],
                             base["wall_s"], base["wall_s"] / now["wall_s"], None)]
    for r in results:
        r["rows_equal_to_first"] = sum(t == b for t, b in zip(r["tokens"], base["tokens"]))
    if len(results) > 2:   # the last lever alone, against the case before it
        prev = results[-2]
        summary.append(summary_entry(f"generate wall s, {prev['label'][:1]} / {now['label'][:1]} (same run)",
                                     now["wall_s"], prev["wall_s"], prev["wall_s"] / now["wall_s"], None))
    for r in results:
        r.pop("tokens")
        r.pop("logprobs")
    write_json(a.out, dict(benchmark="engine_levers", args={**vars(a), "model": model}, rows=results,
                           summary=summary, load_avg=list(os.getloadavg()), machine=machine_info()))


if __name__ == "__main__":
    main()
