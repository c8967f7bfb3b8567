"""bf16 against fp32 on this CPU, on the quickstart's own SFT and evaluation commands.

`--precision auto` (the quickstart's and the comparison's default) computes in bf16 where
/proc/cpuinfo lists `amx_bf16` or `avx512_bf16`, fp32 elsewhere (docs/performance.md, "Precision on
the CPU"). This benchmark checks that choice on the machine it runs on: both precisions, each stage
in a fresh process, alternated over `--reps` repetitions (fp32 first in even repetitions, bf16 first
in odd ones), with the environment the quickstart gives that stage (`STAGE_ENV`,
`KEEP_FREED_MEMORY_ENV` and the CPU threads' wait).

- **SFT**: `quickstart.sft_command` for `--sft_steps` steps of 16 conversations (the first a warm-up):
  the median seconds of a step after the first (main_sft's own per-step record in `sft_meta.json`).
- **Evaluation**: `quickstart.eval_command` on the first `--questions` test questions, greedy, up to 288
  tokens, 150 rows a generation call: `generation_seconds` of the report (model loading excluded) and
  the response tokens (generated and tool results, `response_tokens` of each answer). The two precisions
  decode different tokens (greedy decoding flips on thin margins), so tokens/s is compared, and each
  answer's length is recorded. Speed only: no choice is made on these answers' accuracy.

Ratio = the speed of the precision `auto` picks here / the other's (> 1: `auto` picked the faster one).
The peak RSS of each stage's largest process is reported too. On a CPU without native bf16 the bf16 arm is
~50× slower; run `--quick` there.

    python benchmarks/bench_precision.py [--reps 2] [--sft_steps 5] [--questions 150] [--model DIR] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (ROOT, machine_info, median, print_table, smollm2_dir, summary_entry, tail,  # noqa: E402
                          tiny_model, write_json)

from verl_arpo.quickstart import (KEEP_FREED_MEMORY_ENV, STAGE_ENV, TEST_DATA, eval_args, eval_command,  # noqa: E402
                                  resolve_precision, sft_command)
from verl_arpo.utils.threads import cpu_process_env  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def stage_env() -> dict[str, str]:
    """What the quickstart's run_logged gives its SFT and evaluation stages: STAGE_ENV and the malloc
    settings both run with, then how CPU threads wait, chosen from the load as the process starts."""
    env = {**STAGE_ENV, **KEEP_FREED_MEMORY_ENV}
    return {**env, **cpu_process_env(env)}


def run_stage(cmd: list[str], log: Path, stage: str, env: dict[str, str] | None = None) -> dict:
    """Run one stage's command with its environment; wall seconds and the peak RSS of its largest
    process (the kernel's maxrss of the child and its waited-for descendants, as `time -v` reports:
    a process-tree sampler double-counts the evaluation's tool launches, which share its memory for a
    moment). `env` is added to the stage's own."""
    env = {**os.environ, **stage_env(), **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"{stage} failed (exit {rc}):\n{tail(log)}")
    return {"wall_s": time.perf_counter() - t0, "peak_rss_mib": usage.ru_maxrss / 1024}


def run_sft(base: str, out: Path, steps: int, precision: str, batch_size: int, env: dict | None = None) -> dict:
    """One SFT run; its median step seconds after the warm-up step, from main_sft's record."""
    r = run_stage(sft_command(Path(base), out, steps, 1, precision, batch_size), out.with_suffix(".log"), "sft", env)
    history = [h for h in json.loads((out / "sft_meta.json").read_text())["history"] if "loss" in h]
    times = [h["seconds"] for h in history]
    return {**r, "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0], "times": times,
            "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"]}


def run_eval(model: str, out: Path, questions: int, precision: str, response_length: int,
             env: dict | None = None) -> dict:
    """One evaluation run: its generation seconds and its response tokens."""
    r = run_stage(eval_command(Path(model), eval_args(questions, precision, response_length), out),
                  out.with_suffix(".log"), "eval", env)
    report = json.loads(out.read_text())
    lengths = [q["samples"][0]["response_tokens"] for q in report["samples"]]
    return {**r, "gen_s": report["generation_seconds"], "tokens": sum(lengths),
            "tokens_per_s": sum(lengths) / report["generation_seconds"], "lengths": lengths}


def summarize_arms(rows: list[dict], pick: str, arms: tuple[str, ...], key: str, metric) -> list[dict]:
    """Per stage, the arm this machine picks (`pick`) against the other (rows name their arm in `key`):
    ratio = its speed / the other's (SFT: seconds a step; evaluation: tokens/s), so > 1 means the pick is
    the faster. `metric(unit, pick, other)` names the entry."""
    other = next(arm for arm in arms if arm != pick)
    out = []
    for stage, field, unit in (("sft", "step_s", "SFT step s"), ("eval", "tokens_per_s", "evaluation tokens/s")):
        by = {arm: [r for r in rows if r["stage"] == stage and r[key] == arm] for arm in arms}
        if not all(by.values()):
            continue
        mine, theirs = median([r[field] for r in by[pick]]), median([r[field] for r in by[other]])
        ratio = theirs / mine if field == "step_s" else mine / theirs
        out.append(summary_entry(metric(unit, pick, other), mine, theirs, ratio, 1.0,
                                 peak_mib=max(r["peak_rss_mib"] for r in by[pick]),
                                 bare_peak_mib=max(r["peak_rss_mib"] for r in by[other])))
    return out


def summarize(rows: list[dict], pick: str) -> list[dict]:
    """Per stage, the precision `auto` picks (`pick`) against the other one (summarize_arms)."""
    return summarize_arms(rows, pick, PRECISIONS, "precision",
                          lambda unit, mine, other: f"{unit}, {mine} = auto's pick (ratio: its speed / {other}'s)")


def stage_parser(description: str, out: Path) -> argparse.ArgumentParser:
    """The command line of a benchmark that runs the quickstart's SFT and evaluation stages in two arms."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="base model for SFT (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--eval_model", default=None,
                   help="model to evaluate (default: outputs/quickstart/sft_model when it exists, else --model)")
    p.add_argument("--sft_steps", type=int, default=5, help="SFT steps a run (the first is warm-up)")
    p.add_argument("--questions", type=int, default=150, help="test questions an evaluation answers")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every case, alternated")
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 SFT steps of 2, 6 questions of 32 tokens")
    p.add_argument("--out", type=Path, default=out)
    return p


def run_arms(a: argparse.Namespace, arms: tuple[str, ...], key: str, setting, label=str, before=None) -> dict:
    """Both stages in each arm, each run a fresh process, the arms alternated over `a.reps` repetitions (the
    first arm first in even repetitions). `setting(arm)` = (precision, extra environment); `before(base)`
    runs first, in the models' temporary folder. Returns the rows and the models used."""
    batch, length = (2, 32) if a.quick else (16, 288)
    if a.quick:
        a.sft_steps, a.questions, a.reps = 2, 6, 1
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = a.model or (tiny_model(tmp) if a.quick else smollm2_dir())
        sft_model = ROOT / "outputs" / "quickstart" / "sft_model"
        evaluated = a.eval_model or (str(sft_model) if not a.quick and (sft_model / "config.json").exists() else base)
        if before is not None:
            first = before(base)
        for rep in range(a.reps):
            order = arms if rep % 2 == 0 else arms[::-1]
            for stage in ("sft", "eval"):
                for arm in order:
                    out, (precision, env) = tmp / f"{stage}_{arms.index(arm)}_{rep}", setting(arm)
                    r = (run_sft(base, out, a.sft_steps, precision, batch, env) if stage == "sft" else
                         run_eval(evaluated, out.with_suffix(".json"), a.questions, precision, length, env))
                    r = {"stage": stage, key: arm, "rep": rep, **r}
                    print(f"{stage} {label(arm)} rep {rep}: " + (
                        f"{r['step_s']:.2f} s a step, losses {r['first_loss']:.6f} .. {r['last_loss']:.6f}"
                        if stage == "sft" else f"{r['gen_s']:.1f} s, {r['tokens']:.0f} tokens ({r['tokens_per_s']:.1f}/s)")
                          + f", peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
                    rows.append(r)
    return {"rows": rows, "model": str(base), "eval_model": str(evaluated), "before": first}


def main(argv: list[str] | None = None) -> dict:
    a = stage_parser(__doc__, ROOT / "benchmarks" / "results" / "precision.json").parse_args(argv)
    ran = run_arms(a, PRECISIONS, "precision", lambda precision: (precision, None))
    rows = ran["rows"]
    pick = resolve_precision("auto")
    summary = summarize(rows, pick)
    print_table([{"metric": s["metric"], "auto's pick": f"{s['ours']:.3g}", "the other": f"{s['baseline']:.3g}",
                  "ratio": f"{s['ratio']:.2f}"} for s in summary], ["metric", "auto's pick", "the other", "ratio"],
                f"bf16 against fp32 on this CPU (auto: {pick})")
    payload = dict(benchmark="precision", args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                   auto=pick, model=ran["model"], eval_model=ran["eval_model"], data=str(TEST_DATA),
                   machine=machine_info(), rows=rows, summary=summary)
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()
