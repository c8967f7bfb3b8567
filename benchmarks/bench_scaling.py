"""How our trainer's step time and peak memory grow as the batch and the response length double.

Tiny model, plain GRPO (no tools), 2 Ray workers, dynamic batch size (token-budget micro-batches,
`ppo_max_token_len_per_gpu`) and packed sequences (`use_remove_padding`). Settings: the smallest
(P prompts × n, response length L), then 2× and 4× the prompts, then 2× and 4× the response length.
All runs share one local Ray cluster (one subprocess); each `run_ppo` starts its own workers, and
the peak memory of the process tree is taken per run. The smallest setting runs first and last
(and each repetition in reverse order), so drift of the shared machine shows up in its two values.

Reported, relative to the smallest setting (medians over its runs):
- work ×: trained tokens per step (prompt + response) ratio;
- time ×: median step time ratio; the summary's figure is k / time × for the k× setting (1.0 =
  time linear in the doubled quantity; above 1 = fixed per-step costs amortised). Time per
  trained token is in the table too: longer responses cost more per trained token because the
  decode steps are sequential while the ~280 prompt tokens per sequence are not;
- memory ×: peak PSS of the whole process tree (Ray included), and peak RSS of the training
  workers (the Ray actors: model, optimizer, activations, KV cache), and per token.
Expectation: time linear in tokens, peak memory flat (the token budget caps a micro-batch).

    python benchmarks/bench_scaling.py [--quick | --smoke] [--reps 3]     # default: 2 passes, ~3 min
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (RESULTS, machine_info, max_prompt_tokens, median, print_table, prompt_rows,  # noqa: E402
                          rates, run_ours_many, summary_entry, tiny_model, tmpdir, write_json, write_parquet)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step of the smallest setting")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response_length", type=int, default=64, help="response length of the smallest setting")
    p.add_argument("--factors", default="1,2,4", help="multipliers of batch and of response length")
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2, help="passes over the settings (alternating order)")
    p.add_argument("--max_token_len", type=int, default=2048, help="ppo_max_token_len_per_gpu (dynamic bsz)")
    p.add_argument("--quick", action="store_true", help="1 pass (the 1x setting still runs first and last)")
    p.add_argument("--smoke", action="store_true", help="factors 1,2, 2 steps, response 16 (tests)")
    p.add_argument("--out", default=str(RESULTS / "scaling.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.reps = 1
    if a.smoke:
        a.factors, a.steps, a.response_length, a.reps = "1,2", 2, 16, 1
    factors = [int(f) for f in a.factors.split(",")]
    t_start, load0 = time.time(), os.getloadavg()
    tmp = tmpdir("bench_scaling_")
    model = tiny_model(tmp)
    rows = prompt_rows(a.prompts * max(factors) * a.steps)
    data = write_parquet(rows, tmp / "train.parquet")
    base = {"model": model, "data": str(data), "n": a.n, "max_prompt_length": max_prompt_tokens(model, rows),
            "steps": a.steps, "micro": 4, "workers": 2, "dynamic_bsz": True, "remove_padding": True,
            "max_token_len": a.max_token_len}
    settings = [("1x", a.prompts, a.response_length)]
    settings += [(f"batch {f}x", a.prompts * f, a.response_length) for f in factors if f > 1]
    settings += [(f"length {f}x", a.prompts, a.response_length * f) for f in factors if f > 1]
    order = []
    for rep in range(a.reps):
        seq = settings[1:] if rep % 2 == 0 else settings[1:][::-1]
        order += [settings[0], *seq, settings[0]] if rep == 0 else [*seq, settings[0]]
    specs = [dict(base, prompts=P, response_length=L, label=lab) for lab, P, L in order]
    runs = run_ours_many(specs, tmp, "scaling", timeout=3600)

    by = {}
    for spec, r in zip(specs, runs):
        by.setdefault(spec["label"], []).append({**rates(r["steps"]), "peak_rss_mib": r["peak_rss_mib"],
                                                 "peak_pss_mib": r["peak_pss_mib"],
                                                 "peak_worker_rss_mib": r["peak_actor_rss_mib"]})
    table = []
    for lab, P, L in settings:
        rs = by[lab]
        table.append({"setting": lab, "prompts": P, "n": a.n, "response_length": L, "runs": len(rs),
                      "tokens_per_step": median(x["tokens_per_step"] for x in rs),
                      "step_s": median(x["step_s"] for x in rs), "update_s": median(x["update_s"] for x in rs),
                      "peak_rss_mib": median(x["peak_rss_mib"] for x in rs),
                      "peak_pss_mib": median(x["peak_pss_mib"] for x in rs),
                      "peak_worker_rss_mib": median(x["peak_worker_rss_mib"] for x in rs),
                      "step_s_all": [x["step_s"] for x in rs]})
    b = table[0]
    for r in table:
        r["work_x"] = r["tokens_per_step"] / b["tokens_per_step"]
        r["time_x"] = r["step_s"] / b["step_s"]
        r["time_per_token_x"] = r["time_x"] / r["work_x"]
        r["rss_x"] = r["peak_rss_mib"] / b["peak_rss_mib"]
        r["pss_x"] = r["peak_pss_mib"] / b["peak_pss_mib"]
        r["worker_rss_x"] = r["peak_worker_rss_mib"] / b["peak_worker_rss_mib"]
        r["worker_rss_per_token_x"] = r["worker_rss_x"] / r["work_x"]
    print(f"\ntiny model, n={a.n}, dynamic bsz (budget {a.max_token_len} tokens/micro-batch), packed sequences, "
          f"2 workers; {a.steps} steps/run (first = warm-up), {a.reps} pass(es)")
    text = print_table(table, ["setting", "prompts", "response_length", "runs", "tokens_per_step", "step_s", "work_x",
                               "time_x", "time_per_token_x", "peak_pss_mib", "pss_x", "peak_worker_rss_mib",
                               "worker_rss_x", "worker_rss_per_token_x"])
    big_b = next((r for r in reversed(table) if r["setting"].startswith("batch")), None)
    big_l = next((r for r in reversed(table) if r["setting"].startswith("length")), None)
    summary = []
    for big, what in ((big_b, "batch"), (big_l, "response length")):
        if big is None:
            continue
        f = big["setting"].split()[-1]
        k = float(f.rstrip("x"))
        # higher is better: k / (step-time ratio); 1.0 = time grows linearly with the doubled quantity
        summary.append(summary_entry(f"step time at {f} {what} vs 1x: {f} / time ratio (linear = 1.0)",
                                     big["step_s"], b["step_s"], k / big["time_x"], 1.0))
        summary.append(summary_entry(f"peak RSS of the training workers at {f} {what}: 1x / {f} (flat = 1.0)",
                                     big["peak_worker_rss_mib"], b["peak_worker_rss_mib"], 1.0 / big["worker_rss_x"], 0.8))
    write_json(a.out, {"benchmark": "scaling", "args": vars(a), "rows": table, "table": text, "summary": summary,
                       "runs": [{"label": s["label"], **r} for s, r in zip(specs, runs)],
                       "machine": {**machine_info(), "load_avg_start": list(load0), "load_avg_end": list(os.getloadavg())},
                       "seconds": time.time() - t_start})
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
