"""Does a speed lever that changes the arithmetic keep the result? Issue 47's rule: a lever whose
numbers differ from the baseline's (a kernel, a layout, a batch split) is taken only when its result
at 4 seed pairs is not worse (docs/performance.md, "Levers that change the arithmetic").

    python experiments/check_lever.py --name one_process trainer.single_process=true trainer.n_gpus_per_node=1
    python experiments/check_lever.py --name one_process --report     # the report from the stored runs only
    python experiments/check_lever.py --name balance_by_tree --code "balance_batch weighs a group by its prefix tree"

Each seed pair trains the comparison's ARPO arm twice from one SFT model, as the tuning protocol has it
(compare_algorithms.py `--protocol tune`: the fresh validation split, seed pairs 50..., two
mini-batches a step): once as configured (the baseline) and once with the lever's overrides. Pair by
pair, the baseline first, so that both runs of a pair see the same machine. The choice is judged on
the validation split, never on the test split.

Stores (compare_algorithms' Store: one JSON per finished run, committed; a later call resumes and
skips what they hold): <results>/baseline/ (shared by every lever checked from the same SFT model and
precision) and <results>/<name>/. The report, <results>/<name>.json and .md: per pair both
accuracies and both runs' seconds; the paired difference (lever − baseline) with the t-interval over
pairs (the primary one) and the paired bootstrap over pairs × questions; each arm's gain over the SFT
model; and the verdict: **worse** when the t-interval lies below 0, else **no loss detected at K
pairs**. With 4 pairs that rules out only a large loss, and the report says how wide the interval is.
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

from compare_algorithms import PROTOCOLS, Experiment, Store, cpu_flags, protocol_record  # noqa: E402
from comparison_report import _ci as ci  # noqa: E402
from run_records import write_atomic  # noqa: E402

from verl_arpo.quickstart import PRECISIONS, SFT_STEPS, resolve_precision  # noqa: E402
from verl_arpo.utils.stats import paired_bootstrap, seed_t_interval  # noqa: E402

ARM = "arpo"
"""The arm a lever is checked on: the quickstart's algorithm (configs/quickstart.yaml is ARPO)."""
BASELINE_STORE = "baseline"


def lever_report(sft_eval: dict, base_runs: dict[int, dict], lever_runs: dict[int, dict], name: str,
                 overrides: list[str], code: str | None = None) -> dict[str, Any]:
    """The lever against the baseline over the pairs both finished (pure: the stored records only).

    Per pair k: acc_k(arm) = mean over questions of correct; d_k = acc_k(lever) − acc_k(baseline).
    Primary: d̄ ± t_{0.975, K−1}·s_d/√K (stats.seed_t_interval); beside it the paired bootstrap over
    pairs × questions. Gain over SFT per arm: acc_k(arm) − acc(SFT), the same t-interval."""
    pairs = sorted(set(base_runs) & set(lever_runs))
    questions = sft_eval["questions"]
    for k in pairs:
        for run in (base_runs[k], lever_runs[k]):
            if run["eval"]["questions"] != questions:
                raise ValueError(f"pair {k}: a run answered other questions than the SFT model's evaluation")

    def interval(diff: np.ndarray) -> dict[str, list[float]]:
        return {"t_over_pairs": list(seed_t_interval(diff)), "bootstrap": list(paired_bootstrap(diff))}

    def both(k: int, read) -> list:
        """`read` of pair k's baseline run and of its lever run."""
        return [read(base_runs[k]), read(lever_runs[k])]

    sft_correct = np.asarray(sft_eval["correct"], dtype=float)
    report: dict[str, Any] = {"lever": name, "overrides": overrides, **({"code": code} if code else {}), "arm": ARM, "pairs": pairs,
                              "n_questions": len(questions), "sft_accuracy": float(sft_correct.mean())}
    if not pairs:
        return {**report, "verdict": "no pair finished by both yet"}
    base = np.array([base_runs[k]["eval"]["correct"] for k in pairs], dtype=float)
    lever = np.array([lever_runs[k]["eval"]["correct"] for k in pairs], dtype=float)
    diff = interval(lever - base)
    lo, hi = diff["t_over_pairs"][1:]
    if len(pairs) < 2:
        verdict = f"1 pair: no interval yet (difference {diff['t_over_pairs'][0]:+.3f})"
    elif hi < 0:
        verdict = f"worse: the lever loses {-diff['t_over_pairs'][0]:.3f} [{lo:+.3f}, {hi:+.3f}] at {len(pairs)} pairs"
    else:
        verdict = (f"no loss detected at {len(pairs)} pairs: {diff['t_over_pairs'][0]:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                   f"(a loss larger than {-lo:.3f} is ruled out at 95%)")
    per_pair = [{"pair": k, "baseline": float(base[i].mean()), "lever": float(lever[i].mean()),
                 "rl_s": both(k, lambda r: r["wall_s"]["rl"]), "eval_s": both(k, lambda r: r["wall_s"]["eval"]),
                 "step_s": both(k, lambda r: r["train"]["mean"].get("step_s")),
                 "executed_tool_calls_per_traj": both(k, lambda r: r["train"]["mean"].get("executed_tool_calls_per_traj")),
                 "load_avg_start": both(k, lambda r: r.get("load_avg_start")), "commit": both(k, lambda r: r.get("commit"))}
                for i, k in enumerate(pairs)]
    rl_s = np.array([r["rl_s"] for r in per_pair], dtype=float)
    return {**report, "per_pair": per_pair, "lever_minus_baseline": diff,
            "gain_over_sft": {"baseline": interval(base - sft_correct), "lever": interval(lever - sft_correct)},
            "rl_seconds_ratio": float(np.median(rl_s[:, 0]) / np.median(rl_s[:, 1])),
            "verdict": verdict}


def markdown(rep: dict[str, Any]) -> str:
    head = [f"# Lever `{rep['lever']}` against the baseline ({rep['arm']}, validation split, "
            f"{rep['n_questions']} questions)", "", f"Overrides: `{' '.join(rep['overrides']) or '(none)'}`", "",
            *([f"Code: {rep['code']} (commits of the runs, baseline / lever: "
               f"{', '.join(sorted({str(r['commit'][0]) for r in rep.get('per_pair', [])}))} / "
               f"{', '.join(sorted({str(r['commit'][1]) for r in rep.get('per_pair', [])}))})", ""] if rep.get("code") else []),
            f"**{rep['verdict']}**", ""]
    if not rep["pairs"]:
        return "\n".join(head)
    rows = ["| pair | baseline | lever | RL s (baseline, lever) | step s | evaluation s | tool calls / trajectory |",
            "|---:|---:|---:|---|---|---|---|"]

    def pair_text(v: list) -> str:
        return ", ".join("—" if x is None else f"{x:.1f}" if isinstance(x, float) and x >= 10 else
                         f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
    for r in rep["per_pair"]:
        rows.append(f"| {r['pair']} | {r['baseline']:.3f} | {r['lever']:.3f} | {pair_text(r['rl_s'])} | "
                    f"{pair_text(r['step_s'])} | {pair_text(r['eval_s'])} | {pair_text(r['executed_tool_calls_per_traj'])} |")
    d, g = rep["lever_minus_baseline"], rep["gain_over_sft"]
    tail = ["", f"- lever − baseline: {ci(d['t_over_pairs'])} (t over pairs); bootstrap over pairs × questions "
            f"{ci(d['bootstrap'])}",
            f"- gain over the SFT model ({rep['sft_accuracy']:.3f}): baseline {ci(g['baseline']['t_over_pairs'])}, "
            f"lever {ci(g['lever']['t_over_pairs'])}",
            f"- RL stage seconds, median baseline / median lever: **{rep['rl_seconds_ratio']:.2f}×**"]
    return "\n".join(head + rows + tail) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", required=True, help="the lever's name: its store and report are <results>/<name>")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--rl_steps", type=int, default=None, help="RL steps per run (default: the quickstart's 13)")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "levers")
    p.add_argument("--results", type=Path, default=ROOT / "experiments" / "results" / "speed_levers")
    p.add_argument("--report", action="store_true", help="only write the report from the stored runs")
    p.add_argument("--smoke", action="store_true", help="2 SFT and 2 RL steps, 30 questions")
    p.add_argument("--tiny", action="store_true", help="the random tiny model (plumbing only)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto")
    p.add_argument("--both", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override for the baseline and the lever alike (e.g. a smaller batch for --tiny)")
    p.add_argument("--code", default=None, metavar="TEXT",
                   help="a lever that is a change in the code, not a key: what changed. Its runs are this checkout's; "
                        "the baseline's stored runs must come from before the change (each run records its commit)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the lever: Hydra overrides of its runs only")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = build_parser()
    a = p.parse_args(argv)
    if a.name == BASELINE_STORE or "/" in a.name or not a.name:
        p.error(f"--name {a.name!r}: name the lever (not {BASELINE_STORE!r}, no '/')")
    bad = [o for o in [*a.overrides, *a.both] if "=" not in o]
    if bad:
        p.error(f"{bad[0]!r} is not a Hydra override: write KEY=VALUE")
    protocol = PROTOCOLS["tune"]
    base_store, lever_store = Store(a.results / BASELINE_STORE), Store(a.results / a.name)
    if a.report:
        if not (lever_store.root / "sft.json").exists():
            p.error(f"--report: {lever_store.root} holds no run yet")
        return write_report(a, base_store, lever_store)
    if not a.overrides and not a.code:
        p.error("a lever is its overrides: give at least one KEY=VALUE (or --code TEXT for a change in the code)")
    if a.code and not (base_store.root / "sft.json").exists():
        p.error(f"--code: {base_store.root} holds no baseline run yet; a code lever pairs with runs stored before the change")
    precision = resolve_precision(a.precision)
    rl_steps, sft_steps = a.rl_steps or (2 if a.smoke else 13), 2 if a.smoke else SFT_STEPS
    arms = {}
    for store, extra, runs in ((base_store, a.both, BASELINE_STORE), (lever_store, [*a.both, *a.overrides], a.name)):
        exp = Experiment(a.out, rl_steps, sft_steps, 30 if a.smoke else None, a.tiny, extra, precision, protocol)
        exp.runs_dir = a.out / "runs" / runs   # both arms share the SFT model and its evaluation in --out
        exp.config_sha256 = protocol_record(protocol, rl_steps, precision, extra)["config_sha256"]
        arms[runs] = (exp, store)
    sft_dir, sft_sha, sft_eval = arms[BASELINE_STORE][0].sft(base_store)
    for store in (base_store, lever_store):
        store.bind(sft_sha, precision, sft_eval)
    pin(base_store.root, {"both": a.both})
    pin(lever_store.root, {"both": a.both, "overrides": a.overrides, **({"code": a.code} if a.code else {})})
    for pair in range(protocol.first_pair, protocol.first_pair + a.pairs):
        for exp, store in arms.values():
            if store.get(ARM, pair) is None:
                exp.run(ARM, pair, sft_dir, store, sft_sha)
                write_report(a, base_store, lever_store, show=False)   # after every run: a partial one reports too
    return write_report(a, base_store, lever_store)


def pin(root: Path, settings: dict) -> None:
    """A store's runs are of one config: the first call writes it (settings.json), a later call with
    another is refused, so that a finished run is never paired under settings it did not run with."""
    f = root / "settings.json"
    if not f.exists():
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(f, settings)
        return
    held = json.loads(f.read_text())
    if held != settings:
        raise SystemExit(f"{root} holds runs made with {held}; this call asks for {settings}. Check it under another "
                         "--name (or another --results for other --both), or move that folder away")


def write_report(a: argparse.Namespace, base_store: Store, lever_store: Store, show: bool = True) -> dict:
    sft = lever_store.sft()
    if base_store.sft_if(sft["sft_sha256"], sft["precision"]) is None:
        raise SystemExit(f"{base_store.root} holds runs of another SFT model or precision than {lever_store.root}: "
                         "they cannot be paired")
    held = lever_store.root / "settings.json"
    settings = json.loads(held.read_text()) if held.exists() else {"overrides": a.overrides, "code": getattr(a, "code", None)}
    overrides, code = settings["overrides"], settings.get("code")
    rep = lever_report(sft["eval"], {k: r for (arm, k), r in base_store.runs().items() if arm == ARM},
                       {k: r for (arm, k), r in lever_store.runs().items() if arm == ARM}, a.name, overrides, code)
    rep.update(precision=sft["precision"], sft_sha256=sft["sft_sha256"], time=time.strftime("%Y-%m-%dT%H:%M:%S"),
               machine={"nproc": os.cpu_count(), "cpu_flags": cpu_flags()})
    a.results.mkdir(parents=True, exist_ok=True)
    write_atomic(a.results / f"{a.name}.json", rep)
    md = markdown(rep)
    (a.results / f"{a.name}.md").write_text(md)
    if show:
        print(md, flush=True)
    return rep


if __name__ == "__main__":
    main()
