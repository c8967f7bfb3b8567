"""Validation generations, as verl's `trainer.log_val_generations` and `trainer.validation_data_dir`
(docs/configuration.md).

    records = validation_records(batch, tokenizer, step)   # one per validation trajectory
    dump_validation(records, out_dir, step)                 # validation_data_dir: <dir>/<step>.jsonl, all of them
    samples = pick_samples(records, n)                      # log_val_generations: the same n prompts every time
    tracker.log_generations(samples, step)                  # console block, jsonl line, tensorboard text, wandb table

A record holds verl's keys `input` (the prompt as the model saw it), `output` (the response, tool
results included), `score` (the summed reward) and `step`, plus `data_source`, `uid`,
`num_tool_calls` and `finish_reason`. Everything written goes through `mask_text`: a tool result
that echoes a credential is masked like any log line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from verl_arpo.utils.rollout_dump import rollout_records
from verl_arpo.utils.secrets import mask_text

__all__ = ["validation_records", "pick_samples", "dump_validation", "format_block", "SAMPLE_SEED"]

SAMPLE_SEED = 42
"""The shuffle that picks which validation samples are logged (fixed, as verl's, so every
validation shows the same prompts and a reader can follow them over training)."""
_KEEP = ("data_source", "uid", "num_tool_calls", "finish_reason")


def validation_records(batch, tokenizer, step: int) -> list[dict[str, Any]]:
    """One record per trajectory of a scored validation batch (prompts, responses, token_level_scores)."""
    out = []
    for rec in rollout_records(batch, tokenizer, step):
        row = {"step": step, "input": rec["prompt"], "output": rec["response"], "score": rec.get("reward")}
        row.update({k: rec[k] for k in _KEEP if k in rec})
        out.append(row)
    return out


def pick_samples(records: list[dict], n: int, seed: int = SAMPLE_SEED) -> list[dict]:
    """`n` records: ordered by input (then output), shuffled with a fixed seed, the first n."""
    if n <= 0 or not records:
        return []
    ordered = sorted(records, key=lambda r: (r["input"], r["output"]))
    order = np.random.RandomState(seed).permutation(len(ordered))
    return [ordered[i] for i in order[:n]]


def dump_validation(records: list[dict], out_dir: str | os.PathLike, step: int) -> Path:
    """`<out_dir>/<step>.jsonl` with every record (atomically: never half a file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(mask_text(json.dumps(rec, ensure_ascii=False)) + "\n")
    os.replace(tmp, path)
    return path


def format_block(samples: list[dict], step: int) -> str:
    """The console block: each sample's input, output and score."""
    lines = [f"[validation generations] step {step}: {len(samples)} sample(s)"]
    for i, s in enumerate(samples, 1):
        score = s.get("score")
        lines += [f"--- sample {i}/{len(samples)} | score {score if score is None else f'{score:.4g}'} | "
                  f"{s.get('data_source', '')}", "[input]", s["input"].rstrip(), "[output]", s["output"].rstrip()]
    return mask_text("\n".join(lines))
