"""Strictly on-policy updates skip the old-log-prob pass: step time with the skip vs without.

Same GRPO runs of our trainer (cpu_tiny preset, 2 Ray workers, P prompts × n, one mini-batch =
one optimizer step, so π_old = π_θ) with `actor.skip_old_log_prob_on_policy` true (ours) and false
(baseline: a separate forward computes old log-probs first, as verl does). Runs alternate
(on, off, off, on, ...) in one Ray cluster; medians over repetitions of the steps after warm-up.
The gradient is the same either way (tests/workers/test_dp_actor.py); only time changes.

    python benchmarks/bench_on_policy_skip.py                 # tiny model, 2 reps × 3 steps
    python benchmarks/bench_on_policy_skip.py --model ~/.cache/verl_arpo/models/smollm2-135m-instruct --reps 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (RESULTS, grpo_spec, machine_info, median, print_table, rates, run_ours_many,  # noqa: E402
                          summary_entry, tmpdir, write_json)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: the tiny random Qwen2 built now)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response_length", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "on_policy_skip.json"))
    a = p.parse_args()
    t0 = time.time()
    tmp = tmpdir("bench_skip_")
    spec = dict(grpo_spec(tmp, a.model, a.prompts, a.n, a.response_length, a.steps), workers=2)
    order = []
    for rep in range(a.reps):
        order += [True, False] if rep % 2 == 0 else [False, True]
    specs = [dict(spec, extra_overrides=[f"actor_rollout_ref.actor.skip_old_log_prob_on_policy={str(s).lower()}"])
             for s in order]
    runs = run_ours_many(specs, tmp, "skip")
    by = {True: [], False: []}
    for skip, r in zip(order, runs):
        by[skip].append(rates(r["steps"]))
    table = []
    for skip, name in ((True, "skip (on-policy: π_old from the update's forward)"), (False, "separate old-log-prob pass <- baseline")):
        rs = by[skip]
        table.append({"variant": name, "runs": len(rs), "step_s": median(x["step_s"] for x in rs),
                      "train_tok_per_s": median(x["train_tok_per_s"] for x in rs)})
    ratio = table[0]["train_tok_per_s"] / table[1]["train_tok_per_s"]
    table.append({"variant": "ratio skip/baseline", "train_tok_per_s": ratio,
                  "step_s": table[1]["step_s"] / table[0]["step_s"]})
    print_table(table, ["variant", "runs", "step_s", "train_tok_per_s"],
                title=f"model={'tiny' if not a.model else a.model} P={a.prompts} n={a.n} "
                      f"response={a.response_length} steps/run={a.steps} reps={a.reps}")
    write_json(a.out, {"machine": machine_info(), "args": vars(a), "table": table, "seconds": time.time() - t0,
                       "summary": [summary_entry("trained tokens/s, on-policy skip vs separate old-log-prob pass",
                                                 table[0]["train_tok_per_s"], table[1]["train_tok_per_s"], ratio, None)]})


if __name__ == "__main__":
    main()
