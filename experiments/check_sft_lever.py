"""Does a speed lever in the SFT stage keep the SFT model's result? Issue 47's rule for levers that change
the arithmetic (docs/performance.md, "Levers that change the arithmetic"), at the stage the lever changes:
`check_lever.py` checks RL levers from one SFT model; an SFT lever changes that model itself.

    python experiments/check_sft_lever.py --arm baseline --code_dir <a checkout from before the change>
    python experiments/check_sft_lever.py --arm sft_causal --code_dir . --code "what changed"
    python experiments/check_sft_lever.py --arm sft_causal --report

Seed k trains the quickstart's SFT (24 steps, 16 conversations a step, its precision) with
`trainer.seed=k` (the order of the conversations) using the code of `--code_dir`, then evaluates the
model greedily on the fresh validation split (600 questions, its corpus: the tuning protocol of
compare_algorithms.py, so no choice is made on the test split) with this checkout's evaluation.
Seeds 42 (the quickstart's), 43, 44, 45 by default. A pair is one seed's baseline and lever model.

Stores: <results>/<arm>/seed<k>.json (committed; a later call skips the seeds they hold). The report,
<results>/<arm>.json and .md: per seed both accuracies, commits and SFT seconds; the paired difference
(lever − baseline) with the t-interval over seeds (primary) and the paired bootstrap over seeds ×
questions; the verdict, **worse** when the t-interval lies below 0, else **no loss detected at K seeds**.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from compare_algorithms import PROTOCOLS, Experiment, cpu_flags, git_commit, templates_of, weights_sha256  # noqa: E402
from comparison_report import _ci as ci  # noqa: E402
from run_records import eval_record, write_atomic  # noqa: E402

from verl_arpo.quickstart import (PRECISIONS, SFT_STEPS, resolve_precision, run_logged, say,  # noqa: E402
                                  sft_command)
from verl_arpo.utils.stats import paired_bootstrap, seed_t_interval  # noqa: E402

BASELINE = "baseline"
SEEDS = (42, 43, 44, 45)
"""trainer.seed of the SFT runs: 42 is main_sft's default, the quickstart's."""


def train_and_evaluate(seed: int, code_dir: Path, out: Path, precision: str, sft_steps: int,
                       exp: Experiment) -> dict[str, Any]:
    """One seed's run: SFT with `code_dir`'s main_sft, then this checkout's evaluation; its record."""
    sft_dir = out / "sft_model"
    env = {**exp.env, "PYTHONPATH": str(code_dir)}
    cmd = [*sft_command(exp.base_model(), sft_dir, sft_steps, precision=precision), f"trainer.seed={seed}"]
    t0 = time.perf_counter()
    # in code_dir: `python -m verl_arpo...` takes the package from its working directory first
    run_logged(cmd, out / "sft.log", env, cwd=code_dir)
    sft_s = time.perf_counter() - t0
    meta = json.loads((sft_dir / "sft_meta.json").read_text())
    t0 = time.perf_counter()
    report = out / "eval.json"
    exp.evaluate(sft_dir, report, out / "eval.log")
    return {"seed": seed, "commit": git_commit(code_dir), "sft_sha256": weights_sha256(sft_dir), "precision": precision,
            "sft_steps": sft_steps, "wall_s": {"sft": round(sft_s, 1), "eval": round(time.perf_counter() - t0, 1)},
            "sft_step_s": float(np.median([h["seconds"] for h in meta["history"] if "loss" in h][1:] or [0.0])),
            "final_loss": [h["loss"] for h in meta["history"] if "loss" in h][-1],
            "load_avg_start": os.getloadavg()[0], "machine": {"nproc": os.cpu_count(), "cpu_flags": cpu_flags()},
            "eval": eval_record(json.loads(report.read_text()), exp.templates)}


def stored(root: Path) -> dict[int, dict]:
    return {r["seed"]: r for r in (json.loads(p.read_text()) for p in sorted(root.glob("seed*.json")))}


def sft_lever_report(base: dict[int, dict], lever: dict[int, dict], name: str, code: str | None) -> dict[str, Any]:
    """Per seed k: d_k = acc_k(lever) − acc_k(baseline); primary d̄ ± t_{0.975, K−1}·s_d/√K (seed_t_interval),
    beside it the paired bootstrap over seeds × questions (pure: the stored records only)."""
    seeds = sorted(set(base) & set(lever))
    rep: dict[str, Any] = {"lever": name, "code": code, "seeds": seeds}
    if not seeds:
        return {**rep, "verdict": "no seed finished by both yet"}
    for k in seeds:
        if base[k]["eval"]["questions"] != lever[k]["eval"]["questions"] or base[k]["precision"] != lever[k]["precision"]:
            raise ValueError(f"seed {k}: the two runs answered other questions or ran at another precision")
    b = np.array([base[k]["eval"]["correct"] for k in seeds], dtype=float)
    m = np.array([lever[k]["eval"]["correct"] for k in seeds], dtype=float)
    t, boot = seed_t_interval(m - b), paired_bootstrap(m - b)
    if len(seeds) < 2:
        verdict = f"1 seed: no interval yet (difference {t[0]:+.3f})"
    elif t[2] < 0:
        verdict = f"worse: the lever loses {-t[0]:.3f} [{t[1]:+.3f}, {t[2]:+.3f}] at {len(seeds)} seeds"
    else:
        verdict = (f"no loss detected at {len(seeds)} seeds: {t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}] "
                   f"(a loss larger than {-t[1]:.3f} is ruled out at 95%)")
    per_seed = [{"seed": k, "baseline": float(b[i].mean()), "lever": float(m[i].mean()),
                 "sft_step_s": [base[k]["sft_step_s"], lever[k]["sft_step_s"]],
                 "sft_s": [base[k]["wall_s"]["sft"], lever[k]["wall_s"]["sft"]],
                 "final_loss": [base[k]["final_loss"], lever[k]["final_loss"]],
                 "commit": [base[k]["commit"], lever[k]["commit"]],
                 "load_avg_start": [base[k].get("load_avg_start"), lever[k].get("load_avg_start")]}
                for i, k in enumerate(seeds)]
    step_s = np.array([r["sft_step_s"] for r in per_seed])
    return {**rep, "n_questions": b.shape[1], "precision": base[seeds[0]]["precision"], "per_seed": per_seed,
            "lever_minus_baseline": {"t_over_seeds": list(t), "bootstrap": list(boot)},
            "sft_step_ratio": float(np.median(step_s[:, 0]) / np.median(step_s[:, 1])), "verdict": verdict}


def markdown(rep: dict[str, Any]) -> str:
    head = [f"# SFT lever `{rep['lever']}` against the baseline (validation split)", "",
            *([f"Code: {rep['code']}", ""] if rep.get("code") else []), f"**{rep['verdict']}**", ""]
    if not rep["seeds"]:
        return "\n".join(head)
    rows = ["| seed | baseline | lever | SFT step s (baseline, lever) | final loss | commits |", "|---:|---:|---:|---|---|---|"]
    for r in rep["per_seed"]:
        rows.append(f"| {r['seed']} | {r['baseline']:.3f} | {r['lever']:.3f} | {r['sft_step_s'][0]:.2f}, "
                    f"{r['sft_step_s'][1]:.2f} | {r['final_loss'][0]:.4f}, {r['final_loss'][1]:.4f} | "
                    f"{r['commit'][0]}, {r['commit'][1]} |")
    d = rep["lever_minus_baseline"]
    tail = ["", f"- {rep['n_questions']} questions, {rep['precision']}",
            f"- lever − baseline: {ci(d['t_over_seeds'])} (t over seeds); bootstrap over seeds × questions {ci(d['bootstrap'])}",
            f"- SFT step seconds, median baseline / median lever: **{rep['sft_step_ratio']:.2f}×**"]
    return "\n".join(head + rows + tail) + "\n"


def write_report(results: Path, name: str, code: str | None, show: bool = True) -> dict:
    rep = sft_lever_report(stored(results / BASELINE), stored(results / name), name, code)
    rep["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    results.mkdir(parents=True, exist_ok=True)
    write_atomic(results / f"{name}.json", rep)
    (results / f"{name}.md").write_text(markdown(rep))
    if show:
        print(markdown(rep), flush=True)
    return rep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", required=True, help=f"{BASELINE!r} or the lever's name")
    p.add_argument("--code_dir", type=Path, default=ROOT, help="the checkout whose main_sft trains this arm")
    p.add_argument("--code", default=None, metavar="TEXT", help="the lever: what changed (its report names it)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--precision", choices=PRECISIONS, default="auto")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "sft_levers")
    p.add_argument("--results", type=Path, default=ROOT / "experiments" / "results" / "sft_levers")
    p.add_argument("--report", action="store_true", help="only write the lever's report from the stored runs")
    p.add_argument("--smoke", action="store_true", help="2 SFT steps, 30 questions")
    p.add_argument("--tiny", action="store_true", help="the random tiny model (plumbing only)")
    return p


def main(argv: list[str] | None = None) -> dict | None:
    p = build_parser()
    a = p.parse_args(argv)
    if "/" in a.arm or not a.arm:
        p.error(f"--arm {a.arm!r}: {BASELINE!r} or a lever's name, no '/'")
    if a.report:
        if a.arm == BASELINE:
            p.error("--report: name the lever's arm")
        return write_report(a.results, a.arm, a.code)
    precision = resolve_precision(a.precision)
    exp = Experiment(a.out, 0, 2 if a.smoke else SFT_STEPS, 30 if a.smoke else None, a.tiny, [], precision,
                     PROTOCOLS["tune"])
    exp.templates = templates_of(exp.protocol.eval_data)
    store = a.results / a.arm
    store.mkdir(parents=True, exist_ok=True)
    held = stored(store)
    for seed in a.seeds:
        if seed in held:
            continue
        say(f"SFT lever check: {a.arm}, seed {seed}, the code of {a.code_dir.resolve()} ({git_commit(a.code_dir)})")
        run = train_and_evaluate(seed, a.code_dir.resolve(), a.out / a.arm / f"seed{seed}", precision,
                                 exp.sft_steps, exp)
        write_atomic(store / f"seed{seed}.json", run)
        say(f"seed {seed}: accuracy {run['eval']['accuracy']:.3f}, SFT {run['wall_s']['sft']:.0f} s")
    if a.arm != BASELINE:
        return write_report(a.results, a.arm, a.code)
    return None


if __name__ == "__main__":
    main()
