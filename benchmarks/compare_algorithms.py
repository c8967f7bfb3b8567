"""What ARPO and AEPO buy: GRPO, ARPO and AEPO trained side by side from one SFT model, over K seed
pairs, with paired bootstrap intervals (docs/results.md).

    python benchmarks/compare_algorithms.py                  # 4 seed pairs x 3 algorithms at the quickstart's shape
    python benchmarks/compare_algorithms.py --pairs 2        # fewer pairs (a later call with more adds the rest)
    python benchmarks/compare_algorithms.py --report         # tables and picture from the finished runs only
    python benchmarks/compare_algorithms.py --tiny --smoke   # plumbing: the random tiny model, 2 steps, 30 questions

Every run is `main_ppo --config-name=quickstart` from the same SFT model; an algorithm is only its
config switches (verl_arpo.quickstart.ALGO_OVERRIDES, shown in the table). Seed pair k sets
`data.seed=1+k` (which prompts each step trains, in which order) and
`actor_rollout_ref.rollout.seed=k` (sampling and branching): within a pair every algorithm trains
the same prompts in the same order, so the differences are paired. Pair 0 is the quickstart's own
seeds. Runs go pair by pair, so a partial experiment holds whole pairs.

Layout of --out (default outputs/compare):
  sft_model/, eval_sft.json        the one SFT model (the quickstart's SFT stage) and its evaluation
  runs/<algo>_pair<k>/             one run: rl/ (checkpoints, metrics.jsonl, rollout dumps), rl_model_hf/,
                                   eval.json, logs/
  runs/<algo>_pair<k>/result.json  written last and atomically: a run folder without it is half-done, and
                                   is deleted and run again from scratch (never resumed, never reported)
and in --results (default benchmarks/results, committed):
  compare_algorithms/sft.json      the SFT model's sha256, the precision and its evaluation
  compare_algorithms/<algo>_pair<k>.json   every finished run (the report is built from these alone), so
                                   a fresh clone continues the experiment: it trains the SFT model again
                                   and runs only the pairs not stored; a store from another SFT model or
                                   precision is refused, never mixed in
  compare_algorithms.json/.md/.png the report

Intervals: paired bootstrap over questions x seed pairs (resample the pairs, and the questions
within them, 4000 times; the 2.5th and 97.5th percentiles of the mean difference).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from verl_arpo.quickstart import (  # noqa: E402  (after the path set-up: runs as a script)
    ALGO_OVERRIDES,
    STAGE_ENV,
    PRECISIONS,
    SFT_STEPS,
    eval_args,
    eval_command,
    merge_command,
    resolve_precision,
    rl_command,
    run_logged,
    say,
    sft_model_matches,
    sft_record,
    train_sft,
)

ALGOS = ("grpo", "arpo", "aepo")
BASELINE = "grpo"
N_BOOT = 4000
KINDS = {"arpo_toy_math": "arithmetic", "arpo_toy_search": "lookup", "arpo_toy_multi": "two-step"}


def seed_overrides(pair: int) -> list[str]:
    """Seed pair k: the data order seed and the rollout's sampling/branching seed (pair 0 = the quickstart's)."""
    return [f"data.seed={1 + pair}", f"actor_rollout_ref.rollout.seed={pair}"]


# --------------------------------------------------------------------------- statistics (pure)
def paired_bootstrap(diff: np.ndarray, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float, float]:
    """Mean and 95% percentile interval of a paired difference over questions x seed pairs.

    `diff[k, q]` = score of A minus score of B on question q in seed pair k (both runs of a pair saw
    the same training prompts; every run answers the same questions). One replicate draws K pairs
    with replacement, then Q questions with replacement (the same questions in every drawn pair: a
    question's difficulty is shared by all runs), and takes the mean of diff over that K x Q grid.
    With K = 1 this is the ordinary paired bootstrap over questions.
    """
    diff = np.atleast_2d(np.asarray(diff, dtype=float))
    k, q = diff.shape
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for start in range(0, n_boot, 500):  # chunks bound memory at 500 x K x Q
        r = min(500, n_boot - start)
        ks = rng.integers(0, k, size=(r, k))
        qs = rng.integers(0, q, size=(r, q))
        means[start:start + r] = diff[ks[:, :, None], qs[:, None, :]].mean(axis=(1, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(lo), float(hi)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean of per-seed-pair values and the range over pairs (a count per run, not a per-question
    score, so there is nothing to resample within a run)."""
    return float(np.mean(values)), float(np.min(values)), float(np.max(values))


# --------------------------------------------------------------------------- one run's record
def last_per_step(metrics_file: Path) -> list[dict]:
    """metrics.jsonl rows, one per step (a resumed run appends: the last line of a step counts)."""
    rows: dict[int, dict] = {}
    for line in open(metrics_file):
        m = json.loads(line)
        if "step" in m and "critic/score/mean" in m:
            rows[int(m["step"])] = m
    return [rows[s] for s in sorted(rows)]


def training_record(metrics_file: Path, rollout_dir: Path) -> dict[str, Any]:
    """Per-step training numbers of one run: executed tool calls (every tool's `calls` counter, summed
    over ranks) per trajectory, tool calls counted in the trajectories (a branch inherits its
    prefix's), branches and the branch rule's draws (branches / draws = how often it fires), generated
    tokens (the engine's new tokens, tool results excluded), trained
    tokens (prompt + response rows of the update's batch), step and rollout seconds, and the entropy
    around tool calls (ARPO's branching signal)."""
    steps = last_per_step(metrics_file)
    if not steps:
        raise ValueError(f"{metrics_file}: no training step was logged")
    out: dict[str, list[float]] = {k: [] for k in (
        "reward", "executed_tool_calls_per_traj", "tool_calls_in_traj_per_traj", "branches", "branch_draws",
        "tokens_generated",
        "tokens_trained", "step_s", "rollout_s", "update_s", "entropy_before_tools", "entropy_after_tools")}
    for m in steps:
        with open(rollout_dir / f"rollout_{m['step']}.jsonl") as f:
            trajectories = sum(1 for _ in f)
        # tools/calls is the executor's total; tools/<name>/calls its share per tool (older logs: sum those)
        executed = m.get("tools/calls", sum(v for k, v in m.items() if k.count("/") == 2 and k.startswith("tools/")
                                            and k.endswith("/calls")))
        out["reward"].append(m["critic/score/mean"])
        out["executed_tool_calls_per_traj"].append(executed / trajectories)
        out["tool_calls_in_traj_per_traj"].append(m.get("tools/calls_per_traj", 0.0))
        out["branches"].append(m.get("rollout/branches", 0.0))
        out["branch_draws"].append(m.get("rollout/branch_draws", float("nan")))  # logged from this commit on
        out["tokens_generated"].append(m.get("rollout/tokens_generated", 0.0))
        out["tokens_trained"].append(m.get("perf/total_num_tokens", 0.0))
        out["step_s"].append(m.get("timing_s/step", 0.0))
        out["rollout_s"].append(m.get("timing_s/gen", m.get("timing_s/rollout", 0.0)))
        out["update_s"].append(m.get("timing_s/update_actor", 0.0))
        out["entropy_before_tools"].append(m.get("rollout/entropy/before_tools", float("nan")))
        out["entropy_after_tools"].append(m.get("rollout/entropy/after_tools", float("nan")))
    return {"steps": len(steps), "per_step": out, "trajectories_per_step": trajectories,
            "mean": {k: float(np.nanmean(v)) if not np.all(np.isnan(v)) else None for k, v in out.items()}}


def eval_record(report: dict) -> dict[str, Any]:
    """What the comparison keeps of a main_eval report: accuracy overall and per task type, tool calls
    per question, and each question's score (keyed by its text, so runs can be aligned and checked)."""
    return {"accuracy": report["overall"]["accuracy"],
            "per_kind": {KINDS.get(ds, ds): m["accuracy"] for ds, m in report["per_data_source"].items()},
            "tool_calls_per_question": report["overall"]["tool_calls_per_question"],
            "questions": [q["question"] for q in report["samples"]],
            "kinds": [KINDS.get(q["data_source"], q["data_source"]) for q in report["samples"]],
            "correct": [sum(s["correct"] for s in q["samples"]) / len(q["samples"]) for q in report["samples"]]}


def write_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def weights_sha256(model_dir: Path) -> str:
    """sha256 over a model folder's weight files (names and bytes): which SFT model a run started from."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


class Store:
    """The finished runs of one experiment (one SFT model, one precision), as small JSON files that
    can be committed: the report is built from them alone, and a later call on another clone skips
    the runs they hold."""

    def __init__(self, root: Path):
        self.root = root

    def bind(self, sft_sha: str, precision: str, sft_eval: dict) -> None:
        """Tie the store to this SFT model and precision; refuse one that holds another experiment's runs."""
        f = self.root / "sft.json"
        if f.exists():
            held = json.loads(f.read_text())
            if (held["sft_sha256"], held["precision"]) != (sft_sha, precision):
                raise SystemExit(
                    f"{self.root} holds the runs of another experiment (SFT {held['sft_sha256'][:12]}, "
                    f"{held['precision']}); this one is SFT {sft_sha[:12]}, {precision}. Their runs cannot be "
                    "paired: pass --precision " + held["precision"] + " if only the precision differs, or move "
                    f"{self.root} away (or pass another --results) to start a new experiment")
            return
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(f, {"sft_sha256": sft_sha, "precision": precision, "eval": sft_eval})

    def sft(self) -> dict:
        return json.loads((self.root / "sft.json").read_text())

    def sft_if(self, sft_sha: str, precision: str) -> dict | None:
        """The stored SFT record when it is this model at this precision, else None."""
        f = self.root / "sft.json"
        if not f.exists():
            return None
        held = json.loads(f.read_text())
        return held if (held["sft_sha256"], held["precision"]) == (sft_sha, precision) else None

    def get(self, algo: str, pair: int) -> dict | None:
        f = self.root / f"{algo}_pair{pair}.json"
        return json.loads(f.read_text()) if f.exists() else None

    def put(self, result: dict) -> None:
        write_atomic(self.root / f"{result['algo']}_pair{result['pair']}.json", result)

    def runs(self) -> dict[tuple[str, int], dict]:
        stored = (json.loads(p.read_text()) for p in sorted(self.root.glob("*_pair*.json")))
        return {(r["algo"], r["pair"]): r for r in stored}


# --------------------------------------------------------------------------- the experiment
class Experiment:
    def __init__(self, out: Path, rl_steps: int, sft_steps: int, test_limit: int | None, tiny: bool,
                 overrides: list[str], precision: str):
        self.out, self.rl_steps, self.sft_steps = out, rl_steps, sft_steps
        self.test_limit, self.tiny, self.overrides, self.precision = test_limit, tiny, overrides, precision
        self.env = dict(STAGE_ENV)

    def base_model(self) -> Path:
        if self.tiny:
            from verl_arpo.utils.tiny_model import make_tiny_model

            base = self.out / "tiny_base"
            if not (base / "config.json").exists():
                make_tiny_model(base)
            return base
        from verl_arpo.utils.model_prep import default_model_dir

        base = Path(default_model_dir())
        if not (base / "verl_arpo_model_prep.json").exists():
            run_logged([sys.executable, "-m", "verl_arpo.utils.model_prep", "--out", str(base)],
                       self.out / "logs" / "prepare.log", self.env)
        return base

    def sft(self, store: "Store") -> tuple[Path, str, dict]:
        """The one SFT model every run starts from, its sha256 and its evaluation record (all kept
        across calls). A store that already holds this very model (same sha256 and precision) gives
        its evaluation: a fresh clone retrains the SFT model (deterministic) but does not evaluate it again."""
        sft_dir, report = self.out / "sft_model", self.out / "eval_sft.json"
        record = sft_record(self.sft_steps, 1, self.precision)
        if not sft_model_matches(sft_dir, record):   # none yet, or trained with other arguments
            report.unlink(missing_ok=True)
            runs = self.out / "runs"
            if runs.exists():  # trained from another SFT model: never to be paired with this one's
                aside = self.out / time.strftime("runs_before_%Y%m%d_%H%M%S")
                say(f"SFT model changes ({record}): the runs made from the previous one move to {aside}")
                runs.rename(aside)
            train_sft(self.base_model(), sft_dir, record, self.out / "logs" / "sft.log", self.env)
        sha = weights_sha256(sft_dir)
        held = store.sft_if(sha, self.precision)
        if held is not None:
            say(f"SFT model {sha[:12]} ({self.precision}) is the store's: its evaluation is reused")
            return sft_dir, sha, held["eval"]
        if not report.exists():
            tmp = report.with_suffix(".tmp.json")
            run_logged(eval_command(sft_dir, eval_args(self.test_limit, self.precision), tmp),
                       self.out / "logs" / "eval_sft.log", self.env)
            os.replace(tmp, report)
        return sft_dir, sha, eval_record(json.loads(report.read_text()))

    def run(self, algo: str, pair: int, sft_dir: Path, store: Store, sft_sha: str) -> dict:
        """One RL run, merged and evaluated; result.json is its completion marker, and the store gets a copy."""
        stored = store.get(algo, pair)
        if stored is not None:
            return stored
        d = self.out / "runs" / f"{algo}_pair{pair}"
        done = d / "result.json"
        if done.exists():  # finished here before the store had it (this --out's SFT model: `sft_sha`)
            # its training numbers are read again from its logs, by this version's training_record
            result = {**json.loads(done.read_text()), "sft_sha256": sft_sha,
                      "train": training_record(d / "rl" / "logs" / "metrics.jsonl", d / "rl" / "rollout")}
            store.put(result)
            return result
        if d.exists():  # a killed run: start it over, its partial numbers never reach the report
            say(f"{d.name}: half-done (no result.json), starting it over")
            shutil.rmtree(d)
        logs = d / "logs"
        overrides = [*seed_overrides(pair), *self.overrides]
        t0 = time.perf_counter()
        run_logged(rl_command(sft_dir, d / "rl", self.rl_steps, algo, d / "search_cache.sqlite", self.tiny, overrides,
                              self.precision), logs / "rl.log", self.env)
        t_rl = time.perf_counter() - t0
        run_logged(merge_command(d / "rl", d / "rl_model_hf"), logs / "merge.log", self.env)
        t1 = time.perf_counter()
        run_logged(eval_command(d / "rl_model_hf", eval_args(self.test_limit, self.precision), d / "eval.json"),
                   logs / "eval.log", self.env)
        t_eval = time.perf_counter() - t1
        result = {"algo": algo, "pair": pair, "precision": self.precision, "sft_sha256": sft_sha,
                  "overrides": [*ALGO_OVERRIDES[algo], *overrides],
                  "rl_steps": self.rl_steps, "train": training_record(d / "rl" / "logs" / "metrics.jsonl",
                                                                      d / "rl" / "rollout"),
                  "eval": eval_record(json.loads((d / "eval.json").read_text())),
                  "wall_s": {"rl": round(t_rl, 1), "eval": round(t_eval, 1)},
                  "load_avg_end": list(os.getloadavg())}
        shutil.rmtree(d / "rl_model_hf")  # 0.5 GB a run; the eval report and the checkpoint stay
        write_atomic(done, result)
        store.put(result)
        return result


# --------------------------------------------------------------------------- the report
def complete_pairs(runs: dict[tuple[str, int], dict], algos: tuple[str, ...]) -> list[int]:
    """Seed pairs for which every algorithm has finished: only these enter the comparison."""
    pairs = sorted({p for _, p in runs})
    return [p for p in pairs if all((a, p) in runs for a in algos)]


def build_report(sft: dict, runs: dict[tuple[str, int], dict], algos: tuple[str, ...]) -> dict[str, Any]:
    """The comparison over the pairs every algorithm finished; `sft` is the SFT model's eval_record."""
    pairs = complete_pairs(runs, algos)
    report: dict[str, Any] = {"pairs": pairs, "n_questions": len(sft["correct"]), "sft": {
        "accuracy": sft["accuracy"], "per_kind": sft["per_kind"],
        "tool_calls_per_question": sft["tool_calls_per_question"]},
        "algos": {}, "vs_baseline": {}}
    if not pairs:
        return report
    sft_c = np.asarray(sft["correct"])
    scores: dict[str, np.ndarray] = {}
    for a in algos:
        rs = [runs[(a, p)] for p in pairs]
        for r in rs:
            if r["eval"]["questions"] != sft["questions"]:
                raise ValueError(f"{a} pair {r['pair']} was evaluated on other questions than the SFT model "
                                 "(the test split changed): delete its run folder and run it again")
        scores[a] = np.asarray([r["eval"]["correct"] for r in rs])  # K x Q
        acc = paired_bootstrap(scores[a])  # a difference against 0: the accuracy's own interval
        gain = paired_bootstrap(scores[a] - sft_c[None, :])
        train = {k: mean_interval([r["train"]["mean"][k] for r in rs if r["train"]["mean"][k] is not None])
                 for k in rs[0]["train"]["mean"] if any(r["train"]["mean"][k] is not None for r in rs)}
        report["algos"][a] = {
            "overrides": ALGO_OVERRIDES[a], "accuracy": acc, "gain_over_sft": gain,
            "gain_over_sft_per_pair": {str(r["pair"]): paired_bootstrap(scores[a][i:i + 1] - sft_c[None, :])
                                       for i, r in enumerate(rs)},
            "per_kind": {k: float(np.mean([r["eval"]["per_kind"][k] for r in rs])) for k in rs[0]["eval"]["per_kind"]},
            "eval_tool_calls_per_question": mean_interval([r["eval"]["tool_calls_per_question"] for r in rs]),
            "train": train, "rl_s": mean_interval([r["wall_s"]["rl"] for r in rs]),
            "reward_curves": {str(r["pair"]): r["train"]["per_step"]["reward"] for r in rs}}
    if BASELINE in scores:
        base_calls = [runs[(BASELINE, p)]["train"]["mean"]["executed_tool_calls_per_traj"] for p in pairs]
        for a in algos:
            if a == BASELINE:
                continue
            calls = [runs[(a, p)]["train"]["mean"]["executed_tool_calls_per_traj"] for p in pairs]
            report["vs_baseline"][a] = {
                "accuracy_delta": paired_bootstrap(scores[a] - scores[BASELINE]),
                "executed_tool_calls_ratio": float(np.mean(calls) / max(np.mean(base_calls), 1e-9)),
                "executed_tool_calls_ratio_per_pair": [c / max(b, 1e-9) for c, b in zip(calls, base_calls)]}
    return report


def _ci(t: tuple[float, float, float] | list[float], signed: bool = True) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(t[0])} [{f.format(t[1])}, {f.format(t[2])}]"


def markdown(report: dict) -> str:
    pairs, algos = report["pairs"], report["algos"]
    lines = [f"Seed pairs: {len(pairs)} ({', '.join(map(str, pairs)) or 'none finished'}); test questions: "
             f"{report['n_questions']}; intervals: paired bootstrap over questions x seed pairs (95%); "
             "counts: mean [min, max] over pairs.", ""]
    if not algos:
        return "\n".join(lines) + "\n"
    lines += ["| algorithm | accuracy | gain over SFT | Δ vs GRPO | arithmetic / lookup / two-step | executed tool "
              "calls / trajectory (× GRPO) | tool calls / question (eval) | branches / step | generated tokens / step "
              "| trained tokens / step | s / step |", "|---|---|---|---|---|---|---|---:|---:|---:|---:|"]
    sft = report["sft"]
    lines.append(f"| SFT (start) | {sft['accuracy']:.3f} | — | — | "
                 + " / ".join(f"{sft['per_kind'].get(k, float('nan')):.2f}" for k in KINDS.values())
                 + f" | — | {sft['tool_calls_per_question']:.2f} | — | — | — | — |")
    for a, r in algos.items():
        vs = report["vs_baseline"].get(a)
        t = r["train"]
        lines.append(
            f"| {a.upper()} | {_ci(r['accuracy'], signed=False)} | {_ci(r['gain_over_sft'])} | "
            f"{_ci(vs['accuracy_delta']) if vs else '—'} | "
            + " / ".join(f"{r['per_kind'].get(k, float('nan')):.2f}" for k in KINDS.values())
            + f" | {t['executed_tool_calls_per_traj'][0]:.2f}"
            + (f" (× {vs['executed_tool_calls_ratio']:.2f})" if vs else "")
            + f" | {r['eval_tool_calls_per_question'][0]:.2f} | {t['branches'][0]:.1f} | {t['tokens_generated'][0]:,.0f}"
            f" | {t['tokens_trained'][0]:,.0f} | {t['step_s'][0]:.0f} |")
    lines += ["", "Branching, per step (means over steps and pairs): the rule's draws are the tool results of "
              "trajectories whose prompt had a free slot; calls in trajectories count a branch's inherited calls.", "",
              "| algorithm | branches | draws | fire rate | entropy before tools | entropy after tools | executed calls / "
              "traj | calls in trajectories / traj |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a, r in algos.items():
        t = r["train"]

        def g(k, f="{:.2f}"):
            return f.format(t[k][0]) if k in t else "—"
        rate = (f"{t['branches'][0] / t['branch_draws'][0]:.2f}" if t.get("branch_draws", (0,))[0] else "—")
        lines.append(f"| {a.upper()} | {g('branches', '{:.1f}')} | {g('branch_draws', '{:.1f}')} | {rate} | "
                     f"{g('entropy_before_tools')} | {g('entropy_after_tools')} | {g('executed_tool_calls_per_traj')} | "
                     f"{g('tool_calls_in_traj_per_traj')} |")
    lines += ["", "Gain over SFT per seed pair (paired bootstrap over questions):", "",
              "| algorithm | " + " | ".join(f"pair {p}" for p in pairs) + " |", "|---|" + "---|" * len(pairs)]
    for a, r in algos.items():
        lines.append(f"| {a.upper()} | " + " | ".join(_ci(r["gain_over_sft_per_pair"][str(p)]) for p in pairs) + " |")
    lines += ["", "Config switches (on configs/quickstart.yaml, which is ARPO):", ""]
    lines += [f"- {a.upper()}: " + (", ".join(f"`{o}`" for o in r["overrides"]) or "none") for a, r in algos.items()]
    return "\n".join(lines) + "\n"


def picture(report: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"grpo": "tab:gray", "arpo": "tab:blue", "aepo": "tab:orange"}
    for a, r in report["algos"].items():
        acc, calls = r["accuracy"], r["train"]["executed_tool_calls_per_traj"]
        ax1.errorbar(calls[0], acc[0], yerr=[[acc[0] - acc[1]], [acc[2] - acc[0]]],
                     xerr=[[calls[0] - calls[1]], [calls[2] - calls[0]]], fmt="o", capsize=4, color=colors.get(a),
                     label=a.upper())
        curves = np.asarray(list(r["reward_curves"].values()))
        steps = np.arange(1, curves.shape[1] + 1)
        for c in curves:
            ax2.plot(steps, c, color=colors.get(a), alpha=0.2)
        ax2.plot(steps, curves.mean(0), color=colors.get(a), marker="o", label=a.upper())
    ax1.axhline(report["sft"]["accuracy"], color="black", ls="--", lw=1, label="SFT")
    ax1.set_xlabel("executed tool calls per trajectory (training; range over seed pairs)")
    ax1.set_ylabel("test accuracy (95% interval)")
    ax1.set_title(f"accuracy vs tool calls, {len(report['pairs'])} seed pair(s)")
    ax2.set_xlabel("RL step")
    ax2.set_ylabel("mean training reward")
    ax2.set_title("reward per step (thin: seed pairs; thick: mean)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_report(store: Store, targets: list[Path], algos: tuple[str, ...], meta: dict) -> dict:
    sft = store.sft()
    report = {**build_report(sft["eval"], store.runs(), algos), **meta, "precision": sft["precision"],
              "sft_sha256": sft["sft_sha256"]}
    md = markdown(report)
    for d in targets:
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / "compare_algorithms.json", report)
        (d / "compare_algorithms.md").write_text(md)
        if report["algos"]:
            picture(report, d / "compare_algorithms.png")
    print(md, flush=True)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4, help="seed pairs (each trains every algorithm once)")
    p.add_argument("--algos", default=",".join(ALGOS), help="comma-separated, from " + ", ".join(ALGO_OVERRIDES))
    p.add_argument("--rl_steps", type=int, default=None, help="RL steps per run (default: the quickstart's 13)")
    p.add_argument("--sft_steps", type=int, default=None,
                   help=f"SFT steps of the one SFT model (default: the quickstart's {SFT_STEPS})")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "compare")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results",
                   help="the finished runs (compare_algorithms/) and the report; commit them")
    p.add_argument("--report", action="store_true", help="only write the report from the stored runs")
    p.add_argument("--smoke", action="store_true", help="2 SFT and 2 RL steps, 30 test questions")
    p.add_argument("--tiny", action="store_true", help="the random tiny model (plumbing only)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="bf16 where the CPU has native bf16, else fp32 (auto); one per experiment "
                        "(the store refuses a mix)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides for every RL run")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = build_parser()
    a = p.parse_args(argv)
    algos = tuple(x for x in a.algos.split(",") if x)
    unknown = [x for x in algos if x not in ALGO_OVERRIDES]
    if unknown:
        p.error(f"--algos: unknown {unknown}; choose from {list(ALGO_OVERRIDES)}")
    if BASELINE not in algos:
        p.error(f"--algos must include the baseline {BASELINE!r}: every other algorithm is compared with it")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"{bad[0]!r} is not a Hydra override: write KEY=VALUE")
    results = Path(a.results)
    store = Store(results / "compare_algorithms")
    meta = {"machine": {"nproc": os.cpu_count(), "load_avg_start": list(os.getloadavg())},
            "overrides": a.overrides, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if a.report:
        if not (store.root / "sft.json").exists():
            p.error(f"--report: {store.root} holds no experiment yet")
        return write_report(store, [results, a.out], algos, meta)
    a.out.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(a.precision)
    exp = Experiment(a.out, a.rl_steps or (2 if a.smoke else 13), a.sft_steps or (2 if a.smoke else SFT_STEPS),
                     30 if a.smoke else None, a.tiny, a.overrides, precision)
    meta["rl_steps"] = exp.rl_steps
    sft_dir, sft_sha, sft_eval = exp.sft(store)
    store.bind(sft_sha, precision, sft_eval)
    for pair in range(a.pairs):
        for algo in algos:
            exp.run(algo, pair, sft_dir, store, sft_sha)
            write_report(store, [results, a.out], algos, meta)  # after every run: a partial experiment reports too
    return write_report(store, [results, a.out], algos, meta)


if __name__ == "__main__":
    main()
