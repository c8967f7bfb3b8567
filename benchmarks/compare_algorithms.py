"""What ARPO and AEPO buy: arms trained side by side from one SFT model over K seed pairs, each
evaluated on a split no choice was made on (docs/results.md).

    python benchmarks/compare_algorithms.py                     # the confirmatory run: 5 arms x 4 seed pairs
    python benchmarks/compare_algorithms.py --protocol tune X=Y # a tuning run, judged on the validation split
    python benchmarks/compare_algorithms.py --pairs 2           # fewer pairs (a later call with more adds the rest)
    python benchmarks/compare_algorithms.py --report            # tables and picture from the finished runs only
    python benchmarks/compare_algorithms.py --protocol tune --tiny --smoke   # plumbing: the random tiny model

Protocols (PROTOCOLS): `confirm` evaluates on rl_datasets/test_fresh.parquet (600 questions about
a world of entities no SFT or RL prompt mentions; make_task.py --fresh), with seed pairs 100...,
the config frozen (store/protocol.json holds it and its sha256, and a call with another config or
any override is refused); `tune` evaluates on rl_datasets/valid_fresh.parquet, the split every
tuning choice is judged on; `legacy` is issue 30's experiment on the old test split (history).
Both fresh protocols search the bundled corpus plus the fresh worlds, and train 2 mini-batches a
step (the second is off-policy, so the clips can bind).

Every run is `main_ppo --config-name=quickstart` from the same SFT model; an arm is only config
switches (ARMS: grpo, arpo (after_result), arpo_before_call, arpo_w0, aepo). Seed pair k sets
`data.seed=1+k` (which prompts each step trains, in which order) and
`actor_rollout_ref.rollout.seed=k` (sampling and branching): within a pair every arm trains the
same prompts in the same order, so the differences are paired. Runs go pair by pair.

Layout of --out (default outputs/compare):
  sft_model/, eval_sft_<store>.json  the one SFT model (the quickstart's SFT stage) and its evaluation
  runs/<store>/<arm>_pair<k>/      one run: rl/ (checkpoints, metrics.jsonl, rollout dumps), eval.json, logs/
                                   (legacy: runs/<arm>_pair<k>/)
  .../result.json                  written last and atomically: a run folder without it is half-done, and
                                   is never reported. Its training continues from its newest RL checkpoint
                                   (the trainer's resume, which continues as the uninterrupted run would:
                                   tests/trainer/test_e2e.py); merge and evaluation run again. Without a
                                   checkpoint it is deleted and run from scratch.
and in --results (default benchmarks/results, committed):
  <store>/sft.json                 the SFT model's sha256, the precision and its evaluation
  <store>/protocol.json            (confirm) the frozen config and its sha256
  <store>/<arm>_pair<k>.json       every finished run with its commit, CPU flags and load average (the
                                   report is built from these alone), so a fresh clone continues the
                                   experiment; a store from another SFT model or precision is refused
  <store>.json/.md/.png            the report

Intervals (compare_stats.py): the primary one is a t-interval over seed pairs of the paired
difference; beside it a bootstrap over pairs x questions and one over pairs x question templates.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from verl_arpo.quickstart import (  # noqa: E402  (after the path set-up: runs as a script)
    ALGO_OVERRIDES,
    STAGE_ENV,
    TEST_DATA,
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

from compare_stats import N_BOOT, cluster_bootstrap, mean_interval, paired_bootstrap, seed_t_interval  # noqa: E402,F401

BASELINE = "grpo"
KINDS = {"arpo_toy_math": "arithmetic", "arpo_toy_search": "lookup", "arpo_toy_multi": "two-step"}
TIMING = "actor_rollout_ref.rollout.entropy_timing"
ARMS: dict[str, list[str]] = {
    "grpo": ALGO_OVERRIDES["grpo"],
    "arpo": [*ALGO_OVERRIDES["arpo"], f"{TIMING}=after_result"],
    "arpo_before_call": [*ALGO_OVERRIDES["arpo"], f"{TIMING}=before_call"],
    "arpo_w0": [*ALGO_OVERRIDES["arpo"], "actor_rollout_ref.rollout.entropy_weight=0"],
    "aepo": ALGO_OVERRIDES["aepo"],
}
"""An arm is config switches on configs/quickstart.yaml (ARPO) and nothing else: one code path.
arpo_w0 branches at tool results with a fixed probability (entropy ignored): the ablation that
tells whether entropy matters, at the same budget. aepo keeps its pre-monitoring on
(`enable_dynamic_rollouts=true`, the AEPO paper's dynamic entropy-balanced rollout); the reference's
own AEPO launch scripts leave it off (REFERENCE_DEFAULTS)."""
REFERENCE_DEFAULTS = {"aepo": {"actor_rollout_ref.rollout.enable_dynamic_rollouts": False}}
FRESH_CORPUS = ROOT / "search_cache" / "local_corpus_fresh.jsonl"
TWO_MINI_BATCHES = ["actor_rollout_ref.actor.ppo_mini_batch_size=3"]
"""6 prompts a step in 2 mini-batches of 3: the second is off-policy, so PPO's and AEPO's clips can
bind (the reference scripts run 8 mini-batches a step; one mini-batch makes every ratio 1)."""


@dataclass(frozen=True)
class Protocol:
    """Which questions an experiment answers, which corpus its tools search, its arms and seeds."""

    store: str            # benchmarks/results/<store>/: its finished runs
    eval_data: Path       # the split every run (and the SFT model) is evaluated on
    corpus: Path | None   # the search corpus of training and evaluation (None: the bundled one)
    arms: tuple[str, ...]
    overrides: tuple[str, ...]   # for every run, after the arm's
    first_pair: int       # seed pairs first_pair, first_pair + 1, ...
    frozen: bool          # no command-line overrides; the store refuses runs of another config


PROTOCOLS = {
    # issue 30's experiment, kept for continuity: the old test split, chosen on it (docs/results.md, history)
    "legacy": Protocol("compare_algorithms", TEST_DATA, None, ("grpo", "arpo", "aepo"),
                       (f"{TIMING}=before_call",), 0, False),
    # tuning: the fresh validation split; any overrides
    "tune": Protocol("tune", ROOT / "rl_datasets" / "valid_fresh.parquet", FRESH_CORPUS, tuple(ARMS),
                     tuple(TWO_MINI_BATCHES), 50, False),
    # the confirmatory run: the fresh test split, the frozen config, new seed pairs 100...
    "confirm": Protocol("confirm", ROOT / "rl_datasets" / "test_fresh.parquet", FRESH_CORPUS, tuple(ARMS),
                        tuple(TWO_MINI_BATCHES), 100, True),
}


def seed_overrides(pair: int) -> list[str]:
    """Seed pair k: the data order seed and the rollout's sampling/branching seed (pair 0 = the quickstart's)."""
    return [f"data.seed={1 + pair}", f"actor_rollout_ref.rollout.seed={pair}"]


def corpus_overrides(protocol: Protocol) -> list[str]:
    """The search tool's corpus, relative to the project (the tool resolves it there), so that the
    frozen config's sha256 is the same in every clone."""
    return [] if protocol.corpus is None else [
        f"++actor_rollout_ref.rollout.tools.tool_instances.search.params.corpus_path={protocol.corpus.relative_to(ROOT)}"]


def file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def protocol_record(protocol: Protocol, rl_steps: int, precision: str, extra: list[str]) -> dict[str, Any]:
    """Everything that decides a run besides its seeds, and its sha256 (`config_sha256`): every
    arm's overrides, the configs, the code of the rollout and the update, the eval split and the
    corpus. A frozen store holds runs of one such record only."""
    files = ["configs/quickstart.yaml", "configs/ppo_trainer.yaml", "rl_datasets/train.parquet",
             "rl_datasets/sft_train.jsonl", str(protocol.eval_data.relative_to(ROOT))]
    if protocol.corpus is not None:
        files.append(str(protocol.corpus.relative_to(ROOT)))
    rec = {"eval_data": str(protocol.eval_data.relative_to(ROOT)), "rl_steps": rl_steps, "precision": precision,
           "arms": {a: [*ARMS[a], *protocol.overrides, *corpus_overrides(protocol), *extra] for a in protocol.arms},
           "reference_defaults": REFERENCE_DEFAULTS, "first_pair": protocol.first_pair,
           "files_sha256": {f: file_sha256(ROOT / f) for f in files}}
    import hashlib

    rec["config_sha256"] = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()
    return rec


def templates_of(data: Path) -> dict[str, str]:
    """question text -> its generator template (extra_info.template), for the clustered interval."""
    import pyarrow.parquet as pq

    rows = pq.read_table(data, columns=["extra_info"]).column("extra_info").to_pylist()
    return {r["question"]: r["template"] for r in rows if r and "template" in r}


# --------------------------------------------------------------------------- one run's record
def last_per_step(metrics_file: Path) -> list[dict]:
    """metrics.jsonl rows, one per step (a resumed run appends: the last line of a step counts)."""
    rows: dict[int, dict] = {}
    for line in open(metrics_file):
        m = json.loads(line)
        if "step" in m and "critic/score/mean" in m:
            rows[int(m["step"])] = m
    return [rows[s] for s in sorted(rows)]


def checkpointed_step(rl_dir: Path) -> int:
    """The step of the checkpoint an RL run's trainer resumes from — the newest intact one, found by the
    trainer's own finder (trainer.resume_mode=auto) — or 0 when there is none."""
    from verl_arpo.utils.checkpoint.layout import find_resumable_checkpoint, get_checkpoint_step

    path = find_resumable_checkpoint(str(rl_dir)) if rl_dir.is_dir() else None
    return get_checkpoint_step(path) if path else 0


def earlier_steps_s(metrics_file: Path, upto: int) -> float:
    """Seconds the logged steps 1..upto took (timing_s/step, the last line of each step counts)."""
    if upto <= 0 or not metrics_file.exists():
        return 0.0
    return sum(float(m.get("timing_s/step", 0.0)) for m in last_per_step(metrics_file) if m["step"] <= upto)


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
        "tokens_trained", "step_s", "rollout_s", "update_s", "entropy_before_tools", "entropy_after_tools",
        "prompts", "pg_clipfrac", "pg_clipfrac_lower", "branch_p_mean", "branch_draws_zero_dh",
        "tool_infra_failures")}
    for m in steps:
        with open(rollout_dir / f"rollout_{m['step']}.jsonl") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        trajectories = len(rows)
        out["prompts"].append(float(len({r.get("uid") for r in rows})))
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
        for k in ("pg_clipfrac", "pg_clipfrac_lower"):   # the mean over the step's micro-batches
            out[k].append(m.get(f"actor/{k}", float("nan")))
        out["branch_p_mean"].append(m.get("rollout/branch_p_mean", float("nan")))
        out["branch_draws_zero_dh"].append(m.get("rollout/branch_draws_zero_dh", float("nan")))
        # tool outages (service down, executor timeout): the outage policy acts only on these
        out["tool_infra_failures"].append(m.get("tools/infra_failures", float("nan")))
    return {"steps": len(steps), "per_step": out, "trajectories_per_step": trajectories,
            "mean": {k: float(np.nanmean(v)) if not np.all(np.isnan(v)) else None for k, v in out.items()}}


def eval_record(report: dict, templates: dict[str, str] | None = None) -> dict[str, Any]:
    """What the comparison keeps of a main_eval report: accuracy overall and per task type, tool calls
    per question, and each question's score (keyed by its text, so runs can be aligned and checked)
    and template (`templates`: question -> template, for the clustered interval)."""
    extra = {"templates": [templates.get(q["question"], "?") for q in report["samples"]]} if templates else {}
    return {**extra, "accuracy": report["overall"]["accuracy"],
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

    def freeze(self, record: dict, amend: str | None = None) -> None:
        """A frozen protocol: the first call writes protocol.json (the config, its sha256); a later
        one with another config is refused, so every stored run ran the same config.

        The one exception is an amendment (`--amend WHY`): a file that the freeze hashes changed in a
        way that cannot move a run (the arms, the eval split, the steps and the precision unchanged).
        It is recorded in protocol.json (the new hashes, why, when, the commit) and named in the report;
        each run keeps the config_sha256 it ran under, so a reader sees which runs came after it."""
        f = self.root / "protocol.json"
        if not f.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(f, record)
            return
        held = json.loads(f.read_text())
        accepted = [held["config_sha256"], *(a["config_sha256"] for a in held.get("amendments", []))]
        if record["config_sha256"] in accepted:
            return
        changed = sorted(k for k in (set(held) | set(record)) - {"amendments", "config_sha256"}
                         if held.get(k) != record.get(k))
        files = sorted(k for k in set(held["files_sha256"]) | set(record["files_sha256"])
                       if held["files_sha256"].get(k) != record["files_sha256"].get(k))
        if amend is None or changed != ["files_sha256"]:
            why = ("" if amend is None else " An amendment may change only the hashed files (here also "
                   f"{[k for k in changed if k != 'files_sha256']}).")
            raise SystemExit(f"{self.root} is frozen at config {held['config_sha256'][:12]}; this call's is "
                             f"{record['config_sha256'][:12]} (differs in {changed}: files {files}). A confirmatory "
                             "run cannot change its config: restore it, start a new experiment (another --results), "
                             "or, for a change that cannot move a run, record it with --amend WHY." + why)
        held.setdefault("amendments", []).append(
            {"config_sha256": record["config_sha256"], "files_sha256": record["files_sha256"], "files_changed": files,
             "why": amend, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit()})
        write_atomic(f, held)
        say(f"{f}: amendment recorded ({files}): {amend}")

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
def git_commit() -> str:
    import subprocess

    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "") if r.returncode == 0 else "unknown"


def cpu_flags() -> list[str]:
    """The CPU features that decide the speed of a run here (native bf16 or AVX2 only)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0].split())
    except (OSError, IndexError):
        return []
    return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma"})


class Experiment:
    def __init__(self, out: Path, rl_steps: int, sft_steps: int, test_limit: int | None, tiny: bool,
                 overrides: list[str], precision: str, protocol: Protocol = PROTOCOLS["legacy"]):
        self.out, self.rl_steps, self.sft_steps = out, rl_steps, sft_steps
        self.test_limit, self.tiny, self.overrides, self.precision = test_limit, tiny, overrides, precision
        self.protocol, self.env = protocol, dict(STAGE_ENV)
        self.runs_dir = out / "runs" if protocol.store == "compare_algorithms" else out / "runs" / protocol.store
        self.templates = templates_of(protocol.eval_data)

    def evaluate(self, model_dir: Path, out: Path, log: Path) -> None:
        """main_eval on the protocol's split, its tools searching the protocol's corpus."""
        args = eval_args(self.test_limit, self.precision)
        if self.protocol.corpus is not None:
            import yaml

            tools = yaml.safe_load((ROOT / "configs" / "tools" / "python_search_local.yaml").read_text())
            tools["tools"]["tool_instances"]["search"]["params"]["corpus_path"] = str(self.protocol.corpus.relative_to(ROOT))
            yml = self.out / f"tools_{self.protocol.store}.yaml"
            yml.write_text(yaml.safe_dump(tools))
            args += ["--tools", str(yml)]
        run_logged(eval_command(model_dir, args, out, self.protocol.eval_data), log, self.env)

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
        sft_dir = self.out / "sft_model"
        report = self.out / ("eval_sft.json" if self.protocol.store == "compare_algorithms"
                             else f"eval_sft_{self.protocol.store}.json")
        record = sft_record(self.sft_steps, 1, self.precision)
        if not sft_model_matches(sft_dir, record):   # none yet, or trained with other arguments
            for old in self.out.glob("eval_sft*.json"):
                old.unlink()
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
            self.evaluate(sft_dir, tmp, self.out / "logs" / f"eval_sft_{self.protocol.store}.log")
            os.replace(tmp, report)
        return sft_dir, sha, eval_record(json.loads(report.read_text()), self.templates)

    def run(self, algo: str, pair: int, sft_dir: Path, store: Store, sft_sha: str) -> dict:
        """One RL run, merged and evaluated; result.json is its completion marker, and the store gets a copy."""
        stored = store.get(algo, pair)
        if stored is not None:
            return stored
        d = self.runs_dir / f"{algo}_pair{pair}"
        done = d / "result.json"
        if done.exists():  # finished here before the store had it (this --out's SFT model: `sft_sha`)
            # its training numbers are read again from its logs, by this version's training_record
            result = {**json.loads(done.read_text()), "sft_sha256": sft_sha,
                      "train": training_record(d / "rl" / "logs" / "metrics.jsonl", d / "rl" / "rollout")}
            store.put(result)
            return result
        kept = checkpointed_step(d / "rl")
        if d.exists() and kept == 0:  # a killed run with nothing to continue: start it over
            say(f"{d.name}: half-done (no result.json, no RL checkpoint), starting it over")
            shutil.rmtree(d)
        elif d.exists():  # a killed run continues from its newest checkpoint; nothing after it is kept
            say(f"{d.name}: half-done (no result.json); RL checkpoint at step {kept} of {self.rl_steps}: "
                + ("training resumes there" if kept < self.rl_steps else "training is complete")
                + "; merge and evaluation run again")
            shutil.rmtree(d / "rl_model_hf", ignore_errors=True)
            (d / "eval.json").unlink(missing_ok=True)
        logs = d / "logs"
        overrides = [*ARMS[algo], *self.protocol.overrides, *corpus_overrides(self.protocol), *seed_overrides(pair),
                     *self.overrides]
        t0, load0 = time.perf_counter(), list(os.getloadavg())
        if kept < self.rl_steps:
            run_logged(rl_command(sft_dir, d / "rl", self.rl_steps, "arpo", d / "search_cache.sqlite", self.tiny,
                                  overrides, self.precision), logs / "rl.log", self.env, append=kept > 0)
        # a resumed run's earlier part: the step times its metrics logged up to the checkpoint (its
        # start-up, ~1 min, is not in them)
        t_rl = time.perf_counter() - t0 + earlier_steps_s(d / "rl" / "logs" / "metrics.jsonl", kept)
        run_logged(merge_command(d / "rl", d / "rl_model_hf"), logs / "merge.log", self.env)
        t1 = time.perf_counter()
        self.evaluate(d / "rl_model_hf", d / "eval.json", logs / "eval.log")
        t_eval = time.perf_counter() - t1
        result = {"algo": algo, "pair": pair, "precision": self.precision, "sft_sha256": sft_sha,
                  "overrides": overrides, "config_sha256": self.config_sha256, "commit": git_commit(),
                  "cpu_flags": cpu_flags(), "load_avg_start": load0,
                  "rl_steps": self.rl_steps, "train": training_record(d / "rl" / "logs" / "metrics.jsonl",
                                                                      d / "rl" / "rollout"),
                  "eval": eval_record(json.loads((d / "eval.json").read_text()), self.templates),
                  "wall_s": {"rl": round(t_rl, 1), "eval": round(t_eval, 1)},
                  **({"resumed_from_step": kept} if kept else {}),
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


BUDGETS = ("tokens_generated", "executed_tool_calls", "tool_calls_in_traj_per_traj", "tokens_trained", "step_s")
"""What an arm spends, per step and per prompt: generated tokens (the engine's, tool results
excluded), executed tool calls (pre-monitoring's included), tool calls inside each trajectory (a
branch counts the calls it shares with its parent), trained tokens and wall seconds."""


PROMPTS_PER_STEP = 6
"""configs/quickstart.yaml's data.train_batch_size (tests/benchmarks checks it)."""


def budgets(run: dict) -> dict[str, dict[str, float | None]]:
    """A run's budgets (BUDGETS), per step and per prompt (a step trains `prompts` prompts)."""
    m = run["train"]["mean"]
    traj = run["train"].get("trajectories_per_step") or 0
    prompts = m.get("prompts") or PROMPTS_PER_STEP   # runs stored before the dumps' prompts were counted
    per_step = {"tokens_generated": m.get("tokens_generated"), "tokens_trained": m.get("tokens_trained"),
                "step_s": m.get("step_s"), "tool_calls_in_traj_per_traj": m.get("tool_calls_in_traj_per_traj"),
                "executed_tool_calls": (m["executed_tool_calls_per_traj"] * traj
                                        if m.get("executed_tool_calls_per_traj") is not None and traj else None)}
    per_prompt = {k: (v / prompts if v is not None and prompts and k != "tool_calls_in_traj_per_traj" else None)
                  for k, v in per_step.items()}
    per_prompt["tool_calls_in_traj_per_traj"] = per_step["tool_calls_in_traj_per_traj"]
    return {"per_step": per_step, "per_prompt": per_prompt}


def _mean_of(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(kept)) if kept else None


def verdict(delta: tuple[float, float, float], name: str, base: str) -> str:
    """What the primary interval shows, in one sentence."""
    m, lo, hi = delta
    if math.isnan(lo):
        return f"{name} − {base}: one seed pair, no interval yet."
    if lo > 0:
        return f"{name} is more accurate than {base} (the seed-pair interval excludes 0)."
    if hi < 0:
        return f"{name} is less accurate than {base} (the seed-pair interval excludes 0)."
    return (f"{name} is not shown to differ from {base}: the seed-pair interval [{lo:+.3f}, {hi:+.3f}] includes 0 "
            f"(a difference larger than {max(abs(lo), abs(hi)):.3f} either way is unlikely).")


def build_report(sft: dict, runs: dict[tuple[str, int], dict], algos: tuple[str, ...]) -> dict[str, Any]:
    """The comparison over the pairs every arm finished; `sft` is the SFT model's eval_record.

    Intervals (compare_stats): `*_delta` / `gain_over_sft` are the primary t-intervals over seed
    pairs; `*_bootstrap` resample pairs × questions; `*_cluster` pairs × templates."""
    pairs = complete_pairs(runs, algos)
    report: dict[str, Any] = {"pairs": pairs, "n_questions": len(sft["correct"]), "sft": {
        "accuracy": sft["accuracy"], "per_kind": sft["per_kind"],
        "tool_calls_per_question": sft["tool_calls_per_question"]},
        "intervals": {"primary": "t-interval over seed pairs of the per-pair mean difference (95%)",
                      "bootstrap": "paired bootstrap over seed pairs x questions (95%)",
                      "cluster": "paired bootstrap over seed pairs x question templates (95%)"},
        "algos": {}, "vs_baseline": {}}
    if not pairs:
        return report
    sft_c = np.asarray(sft["correct"])
    templates = sft.get("templates")
    scores: dict[str, np.ndarray] = {}

    def intervals(diff: np.ndarray, key: str) -> dict[str, Any]:
        out = {key: seed_t_interval(diff), f"{key}_bootstrap": paired_bootstrap(diff)}
        if templates:
            out[f"{key}_cluster"] = cluster_bootstrap(diff, templates)
        return out

    for a in algos:
        rs = [runs[(a, p)] for p in pairs]
        for r in rs:
            if r["eval"]["questions"] != sft["questions"]:
                raise ValueError(f"{a} pair {r['pair']} was evaluated on other questions than the SFT model "
                                 "(the test split changed): delete its run folder and run it again")
        scores[a] = np.asarray([r["eval"]["correct"] for r in rs])  # K x Q
        train = {k: mean_interval([r["train"]["mean"][k] for r in rs if r["train"]["mean"].get(k) is not None])
                 for k in rs[0]["train"]["mean"] if any(r["train"]["mean"].get(k) is not None for r in rs)}
        spent = [budgets(r) for r in rs]
        report["algos"][a] = {
            "overrides": rs[0].get("overrides", ALGO_OVERRIDES.get(a, [])), "accuracy": paired_bootstrap(scores[a]),
            **intervals(scores[a] - sft_c[None, :], "gain_over_sft"),
            "gain_over_sft_per_pair": {str(r["pair"]): paired_bootstrap(scores[a][i:i + 1] - sft_c[None, :])
                                       for i, r in enumerate(rs)},
            "per_kind": {k: float(np.mean([r["eval"]["per_kind"][k] for r in rs])) for k in rs[0]["eval"]["per_kind"]},
            "eval_tool_calls_per_question": mean_interval([r["eval"]["tool_calls_per_question"] for r in rs]),
            "budgets": {unit: {k: _mean_of([b[unit][k] for b in spent]) for k in BUDGETS}
                        for unit in ("per_step", "per_prompt")},
            "train": train, "rl_s": mean_interval([r["wall_s"]["rl"] for r in rs]),
            "reward_curves": {str(r["pair"]): r["train"]["per_step"]["reward"] for r in rs}}
    if BASELINE in scores:
        base_calls = [runs[(BASELINE, p)]["train"]["mean"]["executed_tool_calls_per_traj"] for p in pairs]
        base_spent = report["algos"][BASELINE]["budgets"]["per_prompt"]
        for a in algos:
            if a == BASELINE:
                continue
            calls = [runs[(a, p)]["train"]["mean"]["executed_tool_calls_per_traj"] for p in pairs]
            diff = scores[a] - scores[BASELINE]
            spent = report["algos"][a]["budgets"]["per_prompt"]
            report["vs_baseline"][a] = {
                **intervals(diff, "accuracy_delta"),
                "accuracy_delta_per_pair": [float(x) for x in diff.mean(axis=1)],
                "budget_ratio": {k: (spent[k] / base_spent[k] if spent[k] is not None and base_spent[k] else None)
                                 for k in BUDGETS},
                "executed_tool_calls_ratio": float(np.mean(calls) / max(np.mean(base_calls), 1e-9)),
                "executed_tool_calls_ratio_per_pair": [c / max(b, 1e-9) for c, b in zip(calls, base_calls)]}
            report["vs_baseline"][a]["verdict"] = verdict(report["vs_baseline"][a]["accuracy_delta"], a.upper(),
                                                         BASELINE.upper())
    return report


def _ci(t: tuple[float, float, float] | list[float], signed: bool = True) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(t[0])} [{f.format(t[1])}, {f.format(t[2])}]"


def _ratio(x: float | None) -> str:
    return f"{x:.2f}×" if x is not None else "—"


def markdown(report: dict) -> str:
    pairs, algos = report["pairs"], report["algos"]
    lines = [f"Seed pairs: {len(pairs)} ({', '.join(map(str, pairs)) or 'none finished'}); questions: "
             f"{report['n_questions']}. Primary interval: {report['intervals']['primary']}; beside it the "
             f"{report['intervals']['bootstrap']} and the {report['intervals']['cluster']}. Counts: mean [min, max] "
             "over pairs.", ""]
    if not algos:
        return "\n".join(lines) + "\n"
    base = BASELINE.upper()
    lines += [f"| arm | accuracy | Δ vs {base} [t, seed pairs] | Δ [bootstrap] | Δ [template-clustered] | generated "
              f"tokens / prompt (× {base}) | executed tool calls / prompt (× {base}) | calls inside a trajectory "
              "(× GRPO) | trained tokens / step | s / step | clip fraction (lower) |",
              "|---|---|---|---|---|---|---|---|---:|---:|---|"]
    lines.append(f"| SFT (start) | {report['sft']['accuracy']:.3f} | — | — | — | — | — | — | — | — | — |")
    for a, r in algos.items():
        vs, bp, t = report["vs_baseline"].get(a), r["budgets"]["per_prompt"], r["train"]
        br = vs["budget_ratio"] if vs else {}

        def num(x, f="{:,.0f}"):
            return f.format(x) if x is not None else "—"
        clip = (f"{t['pg_clipfrac'][0]:.4f} ({t['pg_clipfrac_lower'][0]:.4f})" if "pg_clipfrac" in t else "—")
        lines.append(
            f"| {a.upper()} | {_ci(r['accuracy'], signed=False)} | {_ci(vs['accuracy_delta']) if vs else '—'} | "
            f"{_ci(vs['accuracy_delta_bootstrap']) if vs else '—'} | "
            f"{_ci(vs['accuracy_delta_cluster']) if vs and 'accuracy_delta_cluster' in vs else '—'} | "
            f"{num(bp['tokens_generated'])} ({_ratio(br.get('tokens_generated'))}) | "
            f"{num(bp['executed_tool_calls'], '{:.2f}')} ({_ratio(br.get('executed_tool_calls'))}) | "
            f"{num(bp['tool_calls_in_traj_per_traj'], '{:.2f}')} ({_ratio(br.get('tool_calls_in_traj_per_traj'))}) | "
            f"{num(r['budgets']['per_step']['tokens_trained'])} | {num(r['budgets']['per_step']['step_s'])} | {clip} |")
    lines += [""] + [f"- {vs['verdict']}" for vs in report["vs_baseline"].values()]
    lines += ["", "Gain over SFT: " + "; ".join(
        f"{a.upper()} {_ci(r['gain_over_sft'])} (t), {_ci(r['gain_over_sft_bootstrap'])} (bootstrap)"
        + (f", {_ci(r['gain_over_sft_cluster'])} (clustered)" if "gain_over_sft_cluster" in r else "")
        for a, r in algos.items()) + ".", ""]
    lines += ["| arm | arithmetic / lookup / two-step | tool calls / question (eval) | branches / step | draws / step | "
              "fire rate | mean p of a draw | draws at ΔH = 0 / step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for a, r in algos.items():
        t = r["train"]

        def g(k, f="{:.2f}"):
            return f.format(t[k][0]) if k in t else "—"
        rate = (f"{t['branches'][0] / t['branch_draws'][0]:.2f}" if t.get("branch_draws", (0,))[0] else "—")
        lines.append(f"| {a.upper()} | " + " / ".join(f"{r['per_kind'].get(k, float('nan')):.2f}" for k in KINDS.values())
                     + f" | {r['eval_tool_calls_per_question'][0]:.2f} | {g('branches', '{:.1f}')} | "
                     f"{g('branch_draws', '{:.1f}')} | {rate} | {g('branch_p_mean', '{:.3f}')} | "
                     f"{g('branch_draws_zero_dh', '{:.1f}')} |")
    lines += ["", f"Δ vs {base} per seed pair:", "", "| arm | " + " | ".join(f"pair {p}" for p in pairs) + " |",
              "|---|" + "---|" * len(pairs)]
    for a, vs in report["vs_baseline"].items():
        lines.append(f"| {a.upper()} | " + " | ".join(f"{x:+.3f}" for x in vs["accuracy_delta_per_pair"]) + " |")
    lines += ["", "Config switches (on configs/quickstart.yaml, which is ARPO; seeds excluded):", ""]
    lines += [f"- {a.upper()}: " + (", ".join(f"`{o}`" for o in r["overrides"] if not o.startswith(("data.seed=",
              "actor_rollout_ref.rollout.seed="))) or "none") for a, r in algos.items()]
    if report.get("config_sha256"):
        lines += ["", f"Frozen config sha256: `{report['config_sha256']}`."]
    for am in report.get("amendments", []):
        ran = [f"{r['algo']} pair {r['pair']}" for r in report.get("runs_by_config", {}).get(am["config_sha256"], [])]
        lines += [f"Amended {am['time'][:10]} (commit {am['commit']}, now `{am['config_sha256'][:12]}`; "
                  f"{', '.join(am['files_changed'])}): {am['why']}" + (f" Runs under it: {', '.join(ran)}." if ran else "")]
    resumed = report.get("resumed_runs", [])
    if resumed:
        lines += ["", "Resumed after a stop, from their RL checkpoint (training continues as the uninterrupted run "
                  "would; their RL seconds are the resumed part plus the earlier steps' logged times, without the "
                  "first part's start-up): " + ", ".join(f"{r['algo']} pair {r['pair']} (from step {r['step']})"
                                                         for r in resumed) + "."]
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


def resumed_runs(runs: dict[tuple[str, int], dict]) -> list[dict]:
    """The runs that continued from an RL checkpoint after a stop, and from which step."""
    return [{"algo": algo, "pair": pair, "step": r["resumed_from_step"]}
            for (algo, pair), r in sorted(runs.items()) if r.get("resumed_from_step")]


def runs_by_config(runs: dict[tuple[str, int], dict]) -> dict[str, list[dict]]:
    """Which runs ran under which config_sha256 (a frozen store's original or an amendment)."""
    out: dict[str, list[dict]] = {}
    for (algo, pair), r in sorted(runs.items()):
        out.setdefault(r.get("config_sha256") or "?", []).append({"algo": algo, "pair": pair})
    return out


def write_report(store: Store, targets: list[Path], algos: tuple[str, ...], meta: dict,
                 protocol: Protocol = PROTOCOLS["legacy"]) -> dict:
    sft = store.sft()
    sft_eval = dict(sft["eval"])
    if "templates" not in sft_eval:   # a store from before templates were kept: the split file has them
        by_q = templates_of(protocol.eval_data)
        sft_eval["templates"] = [by_q.get(q, "?") for q in sft_eval["questions"]]
    frozen = store.root / "protocol.json"
    report = {**build_report(sft_eval, store.runs(), algos), **meta, "precision": sft["precision"],
              "sft_sha256": sft["sft_sha256"], "protocol": protocol.store,
              "config_sha256": json.loads(frozen.read_text())["config_sha256"] if frozen.exists() else None,
              "amendments": json.loads(frozen.read_text()).get("amendments", []) if frozen.exists() else [],
              "runs_by_config": runs_by_config(store.runs()), "resumed_runs": resumed_runs(store.runs())}
    md = markdown(report)
    for d in targets:
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / f"{protocol.store}.json", report)
        (d / f"{protocol.store}.md").write_text(md)
        if report["algos"]:
            picture(report, d / f"{protocol.store}.png")
    print(md, flush=True)
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="confirm",
                   help="confirm: the frozen config on the fresh test split, seed pairs 100...; tune: the fresh "
                        "validation split (every tuning choice), pairs 50...; legacy: issue 30's experiment on the "
                        "old test split")
    p.add_argument("--pairs", type=int, default=4, help="seed pairs (each trains every arm once)")
    p.add_argument("--algos", default=None, help="comma-separated arms, from " + ", ".join(ARMS)
                   + " (default: the protocol's)")
    p.add_argument("--rl_steps", type=int, default=None, help="RL steps per run (default: the quickstart's 13)")
    p.add_argument("--sft_steps", type=int, default=None,
                   help=f"SFT steps of the one SFT model (default: the quickstart's {SFT_STEPS})")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "compare")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results",
                   help="the finished runs (<protocol store>/) and the report; commit them")
    p.add_argument("--report", action="store_true", help="only write the report from the stored runs")
    p.add_argument("--smoke", action="store_true", help="2 SFT and 2 RL steps, 30 test questions")
    p.add_argument("--tiny", action="store_true", help="the random tiny model (plumbing only)")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="bf16 where the CPU has native bf16, else fp32 (auto); one per experiment "
                        "(the store refuses a mix)")
    p.add_argument("--amend", default=None, metavar="WHY",
                   help="a frozen store: record a change of its hashed files that cannot move a run (say why)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides for every RL run (refused by the frozen confirm protocol)")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = build_parser()
    a = p.parse_args(argv)
    protocol = PROTOCOLS[a.protocol]
    algos = tuple(x for x in a.algos.split(",") if x) if a.algos else protocol.arms
    unknown = [x for x in algos if x not in ARMS]
    if unknown:
        p.error(f"--algos: unknown {unknown}; choose from {list(ARMS)}")
    if BASELINE not in algos:
        p.error(f"--algos must include the baseline {BASELINE!r}: every other arm is compared with it")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"{bad[0]!r} is not a Hydra override: write KEY=VALUE")
    if protocol.frozen and a.overrides:
        p.error(f"--protocol {a.protocol} runs a frozen config: overrides {a.overrides} are refused (tune them with "
                "--protocol tune, on the validation split)")
    results = Path(a.results)
    store = Store(results / protocol.store)
    meta = {"machine": {"nproc": os.cpu_count(), "cpu_flags": cpu_flags(), "load_avg_start": list(os.getloadavg())},
            "overrides": a.overrides, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if a.report:
        if not (store.root / "sft.json").exists():
            p.error(f"--report: {store.root} holds no experiment yet")
        return write_report(store, [results, a.out], algos, meta, protocol)
    a.out.mkdir(parents=True, exist_ok=True)
    precision = resolve_precision(a.precision)
    exp = Experiment(a.out, a.rl_steps or (2 if a.smoke else 13), a.sft_steps or (2 if a.smoke else SFT_STEPS),
                     30 if a.smoke else None, a.tiny, a.overrides, precision, protocol)
    record = protocol_record(protocol, exp.rl_steps, precision, a.overrides)
    exp.config_sha256 = record["config_sha256"]
    if protocol.frozen:
        store.freeze(record, a.amend)   # before any run: the config every run of this store uses
    meta["rl_steps"] = exp.rl_steps
    sft_dir, sft_sha, sft_eval = exp.sft(store)
    store.bind(sft_sha, precision, sft_eval)
    for pair in range(protocol.first_pair, protocol.first_pair + a.pairs):
        for algo in algos:
            exp.run(algo, pair, sft_dir, store, sft_sha)
            write_report(store, [results, a.out], algos, meta, protocol)  # after every run: a partial one reports too
    return write_report(store, [results, a.out], algos, meta, protocol)


if __name__ == "__main__":
    main()
