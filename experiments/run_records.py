"""One run directory of the algorithm comparison, read back: its steps' metrics, the checkpoint it
resumes from, whether it may resume at all, and the records the comparison keeps of its training
and its evaluation (experiments/README.md)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from comparison_report import KINDS

from verl_arpo.utils.tracking import training_steps

def last_per_step(metrics_file: Path) -> list[dict]:
    """metrics.jsonl rows, one per step (a resumed run appends: the last line of a step counts)."""
    return training_steps(metrics_file)


def checkpointed_step(rl_dir: Path) -> int:
    """The step of the checkpoint an RL run's trainer resumes from — the newest intact one, found by the
    trainer's own finder (trainer.resume_mode=auto) — or 0 when there is none."""
    from verl_arpo.utils.checkpoint.layout import find_resumable_checkpoint, get_checkpoint_step

    path = find_resumable_checkpoint(str(rl_dir)) if rl_dir.is_dir() else None
    return get_checkpoint_step(path) if path else 0


RUN_IDENTITY = "run.json"


def resume_refusal(run_dir: Path, identity: dict, kept: int) -> str | None:
    """Why a stopped run in `run_dir` must start over instead of continuing from its checkpoint at step
    `kept`, or None when it may continue: no checkpoint; a checkpoint past this call's rl_steps; a run
    begun under another config, step count, precision, SFT model or overrides (`run.json`, written when
    it began; runs from before that record continue when the rest holds); or a metrics log without
    every step up to the checkpoint (a kill between the checkpoint and its step's log line), whose
    record would silently lack that step."""
    if kept == 0:
        return "no RL checkpoint"
    if kept > identity["rl_steps"]:
        return f"its checkpoint is at step {kept}, past this run's {identity['rl_steps']} steps"
    recorded = run_dir / RUN_IDENTITY
    if recorded.exists():
        began = json.loads(recorded.read_text())
        changed = sorted(k for k in identity if began.get(k) != identity[k])
        if changed:
            return f"it began under another {', '.join(changed)}"
    metrics = run_dir / "rl" / "logs" / "metrics.jsonl"
    logged = {m["step"] for m in last_per_step(metrics)} if metrics.exists() else set()
    missing = sorted(set(range(1, kept + 1)) - logged)
    if missing:
        return f"its metrics log lacks step(s) {missing[:5]} before its checkpoint at step {kept}"
    return None


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
