"""What ARPO and AEPO buy: arms trained side by side from one SFT model over K seed pairs, each
evaluated on a split no choice was made on (docs/results.md).

    python experiments/compare_algorithms.py                     # the confirmatory run: 5 arms x 4 seed pairs
    python experiments/compare_algorithms.py --protocol tune X=Y # a tuning run, judged on the validation split
    python experiments/compare_algorithms.py --pairs 2           # fewer pairs (a later call with more adds the rest)
    python experiments/compare_algorithms.py --report            # tables and picture from the finished runs only
    python experiments/compare_algorithms.py --protocol tune --tiny --smoke   # plumbing: the random tiny model

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
and in --results (default experiments/results, committed):
  <store>/sft.json                 the SFT model's sha256, the precision and its evaluation
  <store>/protocol.json            (confirm) the frozen config and its sha256
  <store>/<arm>_pair<k>.json       every finished run with its commit, CPU flags and load average (the
                                   report is built from these alone), so a fresh clone continues the
                                   experiment; a store from another SFT model or precision is refused
  <store>.json/.md/.png            the report

Intervals (verl_arpo/utils/stats.py): the primary one is a t-interval over seed pairs of the paired
difference; beside it a bootstrap over pairs x questions and one over pairs x question templates.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))   # comparison_report.py beside this script

from verl_arpo.quickstart import (  # noqa: E402  (after the path set-up: runs as a script)
    ALGO_OVERRIDES,
    KEEP_FREED_MEMORY_ENV,
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

from run_records import (RUN_IDENTITY, checkpointed_step, earlier_steps_s, eval_record,  # noqa: E402,F401
                         last_per_step, resume_refusal, training_record, write_atomic)
from comparison_report import (BASELINE, BUDGETS, KINDS, PROMPTS_PER_STEP, budgets, build_report,  # noqa: E402,F401
                               complete_pairs, cpu_kind, markdown, other_start_runs, picture, resumed_runs,
                               runs_by_config, verdict)

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

    store: str            # experiments/results/<store>/: its finished runs
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
    """Everything that decides a run besides its seeds and its code, and its sha256 (`config_sha256`):
    every arm's overrides, the configs, the training data, the eval split and the corpus (by sha256).
    The code is not hashed: each run records its commit. A frozen store holds runs of one such
    record only."""
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
def git_commit(checkout: Path = ROOT) -> str:
    """The checkout's short commit, with "+dirty" when tracked files differ from it."""
    import subprocess

    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout,
                           capture_output=True, text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "") if r.returncode == 0 else "unknown"


def cpu_flags() -> list[str]:
    """The CPU features that decide the speed of a run here (native bf16 or AVX2 only)."""
    from verl_arpo.utils.cpu_info import simd_flags

    return sorted(simd_flags())


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
        run_logged(eval_command(model_dir, args, out, self.protocol.eval_data), log,
                   {**self.env, **KEEP_FREED_MEMORY_ENV})

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
            train_sft(self.base_model(), sft_dir, record, self.out / "logs" / "sft.log",
                      {**self.env, **KEEP_FREED_MEMORY_ENV})
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
        overrides = [*ARMS[algo], *self.protocol.overrides, *corpus_overrides(self.protocol), *seed_overrides(pair),
                     *self.overrides]
        identity = {"config_sha256": self.config_sha256, "rl_steps": self.rl_steps, "precision": self.precision,
                    "sft_sha256": sft_sha, "overrides": overrides}
        kept = checkpointed_step(d / "rl")
        why_not = resume_refusal(d, identity, kept) if d.exists() else None
        if d.exists() and why_not:  # a killed run with nothing (or nothing right) to continue: start it over
            say(f"{d.name}: half-done (no result.json), {why_not}: starting it over")
            shutil.rmtree(d)
            kept = 0
        elif d.exists():  # a killed run continues from its newest checkpoint; nothing after it is kept
            say(f"{d.name}: half-done (no result.json); RL checkpoint at step {kept} of {self.rl_steps}: "
                + ("training resumes there" if kept < self.rl_steps else "training is complete")
                + "; merge and evaluation run again")
            shutil.rmtree(d / "rl_model_hf", ignore_errors=True)
            (d / "eval.json").unlink(missing_ok=True)
        logs = d / "logs"
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / RUN_IDENTITY, identity)   # what a resumed run must match (resume_refusal)
        t0, load0 = time.perf_counter(), list(os.getloadavg())
        if kept < self.rl_steps:
            run_logged(rl_command(sft_dir, d / "rl", self.rl_steps, "arpo", d / "search_cache.sqlite", self.tiny,
                                  overrides, self.precision), logs / "rl.log", self.env, append=kept > 0)
        # a resumed run's earlier part: the step times its metrics logged up to the checkpoint (its
        # start-up, ~1 min, is not in them)
        t_rl = time.perf_counter() - t0 + earlier_steps_s(d / "rl" / "logs" / "metrics.jsonl", kept)
        # the final step's checkpoint by name, not whatever the tracker file names
        run_logged(merge_command(d / "rl" / f"global_step_{self.rl_steps}", d / "rl_model_hf"), logs / "merge.log",
                   self.env)
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



def write_report(store: Store, targets: list[Path], algos: tuple[str, ...], meta: dict,
                 protocol: Protocol = PROTOCOLS["legacy"]) -> dict:
    sft = store.sft()
    sft_eval = dict(sft["eval"])
    if "templates" not in sft_eval:   # a store from before templates were kept: the split file has them
        by_q = templates_of(protocol.eval_data)
        sft_eval["templates"] = [by_q.get(q, "?") for q in sft_eval["questions"]]
    frozen = store.root / "protocol.json"
    runs = store.runs()   # every stored record, read once
    report = {**build_report(sft_eval, runs, algos, sft["sft_sha256"]), **meta, "precision": sft["precision"],
              "sft_sha256": sft["sft_sha256"], "protocol": protocol.store,
              "config_sha256": json.loads(frozen.read_text())["config_sha256"] if frozen.exists() else None,
              "amendments": json.loads(frozen.read_text()).get("amendments", []) if frozen.exists() else [],
              "runs_by_config": runs_by_config(runs), "resumed_runs": resumed_runs(runs)}
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
    p.add_argument("--results", type=Path, default=ROOT / "experiments" / "results",
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
