"""What one arm of the algorithm comparison costs a seed pair: this checkout against an older one.

Issue 47 asks that the comparison's cost per arm per seed pair fall with the quickstart's. An arm's run
(experiments/compare_algorithms.py) is the quickstart's RL stage from the one SFT model (13 steps of 24
trajectories; the comparison adds a second mini-batch a step), the merge, and a greedy evaluation of 600
questions. This benchmark times exactly those three stages of the quickstart, `python -m
verl_arpo.quickstart`, once with this checkout's code and once with the code of `--baseline` (a git
revision, checked out as a worktree; default: the code when issue 47 was filed). Both start from the same
finished quickstart (`--from`: its SFT model and the evaluations of the base and SFT models are copied
into each run's folder, so the quickstart reuses them) on the same machine, with this interpreter and its
packages, the two arms alternated over `--reps` repetitions (the baseline first in even repetitions).

Per arm: the stages' seconds (the quickstart's own `stage_seconds.json`), the RL stage's generated tokens,
generation, update and step seconds (its metrics.jsonl), the evaluation's generation seconds and response
tokens, and peak memory: a Ray worker's (the trainer's `perf/cpu_memory_peak_gb`, where the checkout
records it) and the largest process the quickstart waited for (the kernel's maxrss: the RL driver, the
merge or the evaluation). The two checkouts may compute different trajectories (their arithmetic is not
bound to be the same), so the tokens are reported beside the seconds. Their accuracies are recorded, not
compared: no choice is made on them.

Ratio = the baseline's seconds / this checkout's (> 1: an arm costs less now).

    python benchmarks/bench_arm_cost.py [--baseline REV] [--from outputs/quickstart] [--reps 1] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import PY, ROOT, machine_info, median, print_table, summary_entry, tail, write_json  # noqa: E402

BASELINE_REV = "f5024fe"
"""The code when issue 47 was filed (2026-11-26, before its first change, e88dd84)."""
ARMS = ("baseline", "this checkout")
REUSED = ("sft_model", "eval_base.json", "eval_sft.json")
"""What each run copies from `--from`: the quickstart reuses a stage whose output exists."""
TIMED = ("rl", "merge", "eval_rl")
"""The quickstart's stages an arm of the comparison runs (stage_seconds.json's names)."""


def git(*args: str, cwd: Path = ROOT) -> str:
    """git's output; its error, by name, if it fails (e.g. a revision this clone does not have)."""
    r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed in {cwd}: {r.stderr.strip()}")
    return r.stdout.strip()


def sft_arguments(from_dir: Path) -> list[str]:
    """The quickstart arguments that make both checkouts accept `--from`'s SFT model as theirs: its precision
    and steps, from the record SFT wrote into it (without them a checkout would train SFT again)."""
    record_file = from_dir / "sft_model" / "verl_arpo_sft.json"
    missing = [name for name in REUSED if not (from_dir / name).exists()]
    if missing or not record_file.exists():
        raise SystemExit(f"--from {from_dir}: not a finished quickstart (missing "
                         f"{', '.join(missing) or record_file.name}); run `bash scripts/quickstart.sh` first")
    record = json.loads(record_file.read_text())
    return ["--precision", record["precision"], "--sft_steps", str(record["steps"])]


def seed_run(from_dir: Path, out: Path) -> None:
    """A run folder holding `--from`'s SFT model and first two evaluations, and their recorded seconds."""
    out.mkdir(parents=True)
    for name in REUSED:
        src = from_dir / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, out / name)
    seconds_file = from_dir / "stage_seconds.json"
    seconds = json.loads(seconds_file.read_text()) if seconds_file.exists() else {}
    kept = {k: v for k, v in seconds.items() if k.startswith(("eval_base", "sft", "eval_sft"))}
    (out / "stage_seconds.json").write_text(json.dumps(kept, indent=2))


def rl_metrics(metrics_file: Path) -> dict:
    """The RL stage's totals over its steps (keys a checkout does not log are left out)."""
    from verl_arpo.utils.tracking import training_steps

    steps = training_steps(metrics_file)
    out = {"steps": len(steps)}
    for key, name in (("rollout/tokens_generated", "generated_tokens"), ("timing_s/gen", "gen_s"),
                      ("timing_s/update_actor", "update_s"), ("timing_s/step", "step_s")):
        values = [s[key] for s in steps if key in s]
        if values:
            out[name] = round(sum(values), 1)
    peaks = [s["perf/cpu_memory_peak_gb"] for s in steps if "perf/cpu_memory_peak_gb" in s]
    if peaks:
        out["worker_peak_gb"] = round(max(peaks), 3)
    return out


def run_arm(code: Path, from_dir: Path, out: Path, extra: list[str], log: Path) -> dict:
    """One arm: `code`'s quickstart over a folder seeded from `from_dir`; what its three stages cost."""
    seed_run(from_dir, out)
    env = {**os.environ, "PYTHONPATH": str(code)}   # `code`'s package, also in its Ray workers
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([PY, "-m", "verl_arpo.quickstart", "--out", str(out), *extra], cwd=str(code),
                                stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    if rc != 0:
        raise RuntimeError(f"the quickstart of {code} failed (exit {rc}):\n{tail(log)}")
    seconds = json.loads((out / "stage_seconds.json").read_text())
    report = json.loads((out / "eval_rl.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    tokens = sum(q["samples"][0]["response_tokens"] for q in report["samples"])
    return {"wall_s": round(time.perf_counter() - t0, 1), **{f"{k}_s": seconds[k] for k in TIMED},
            "arm_s": round(sum(seconds[k] for k in TIMED), 1), "rl": rl_metrics(out / "rl" / "logs" / "metrics.jsonl"),
            "eval_gen_s": report["generation_seconds"], "eval_tokens": tokens,
            "eval_questions": report["overall"]["n_questions"], "accuracy_rl": report["overall"]["accuracy"],
            "rl_gain_over_sft": summary["rl_gain_over_sft"]["mean"],
            "largest_waited_process_mib": round(usage.ru_maxrss / 1024)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per cost, the baseline's median / this checkout's (> 1: cheaper now); tokens/s the other way round."""
    by = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    if not all(by.values()):
        return []
    ours, theirs = by["this checkout"], by["baseline"]
    out = []
    for field, what in (("arm_s", "an arm's RL stage + merge + evaluation, seconds"), ("rl_s", "RL stage seconds"),
                        ("eval_rl_s", "evaluation seconds")):
        mine, base = median([r[field] for r in ours]), median([r[field] for r in theirs])
        out.append(summary_entry(f"{what} (ratio: the baseline's / this checkout's)", mine, base, base / mine, None))
    rates = [(r, r["rl"].get("generated_tokens"), r["rl"].get("gen_s")) for r in rows]
    if all(tok and sec for _, tok, sec in rates):
        mine = median([tok / sec for r, tok, sec in rates if r["arm"] == "this checkout"])
        base = median([tok / sec for r, tok, sec in rates if r["arm"] == "baseline"])
        out.append(summary_entry("RL generation tokens/s (ratio: this checkout's / the baseline's)", mine, base,
                                 mine / base, None))
    return out


def quick_from(tmp: Path) -> Path:
    """`--quick`'s finished quickstart: this checkout's smoke run on the random tiny model."""
    from_dir = tmp / "from"
    log = tmp / "from.log"
    with open(log, "w") as f:
        rc = subprocess.call([PY, "-m", "verl_arpo.quickstart", "--tiny", "--smoke", "--out", str(from_dir)],
                             cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"the tiny smoke quickstart failed (exit {rc}):\n{tail(log)}")
    return from_dir


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=BASELINE_REV, help=f"the older code, a git revision (default {BASELINE_REV})")
    p.add_argument("--from", dest="from_dir", type=Path, default=ROOT / "outputs" / "quickstart",
                   help="a finished quickstart whose SFT model both arms start from (default outputs/quickstart)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of each arm, alternated")
    p.add_argument("--quick", action="store_true", help="plumbing: the tiny model's smoke run, made first")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "arm_cost.json")
    a = p.parse_args(argv)
    revs = {"baseline": git("rev-parse", a.baseline), "this checkout": git("rev-parse", "HEAD")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="arm_cost_") as tmp:
        tmp = Path(tmp)
        from_dir = quick_from(tmp) if a.quick else a.from_dir.resolve()
        extra = sft_arguments(from_dir) + (["--tiny", "--smoke"] if a.quick else [])
        worktree = tmp / "baseline"
        git("worktree", "add", "--detach", str(worktree), revs["baseline"])
        try:
            code = {"baseline": worktree, "this checkout": ROOT}
            for rep in range(a.reps):
                for arm in (ARMS if rep % 2 == 0 else ARMS[::-1]):
                    r = {"arm": arm, "rev": revs[arm], "rep": rep,
                         **run_arm(code[arm], from_dir, tmp / f"run_{ARMS.index(arm)}_{rep}", extra,
                                   tmp / f"run_{ARMS.index(arm)}_{rep}.log")}
                    print(f"{arm} ({r['rev'][:7]}) rep {rep}: RL {r['rl_s']:.0f} s ({r['rl'].get('generated_tokens')} "
                          f"tokens generated), merge {r['merge_s']:.0f} s, evaluation {r['eval_rl_s']:.0f} s "
                          f"({r['eval_tokens']} tokens): an arm {r['arm_s']:.0f} s", flush=True)
                    rows.append(r)
        finally:
            git("worktree", "remove", "--force", str(worktree))
    summary = summarize(rows)
    print_table([{"metric": s["metric"], "this checkout": f"{s['ours']:.4g}", "baseline": f"{s['baseline']:.4g}",
                  "ratio": f"{s['ratio']:.2f}"} for s in summary], ["metric", "this checkout", "baseline", "ratio"],
                f"an arm of the comparison: this checkout ({revs['this checkout'][:7]}) against {revs['baseline'][:7]}")
    payload = dict(benchmark="arm_cost", args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                   revs=revs, quickstart_args=extra, machine=machine_info(), rows=rows, summary=summary)
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()
