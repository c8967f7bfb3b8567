"""Rollout dumps: one JSONL file per training step, one line per trajectory.

Written when `trainer.rollout_data_dir` is set, after rewards and advantages are known, with every
line masked (`mask_text`: a tool result that echoes a credential loses it):

    {"step", "uid", "traj_id", "parent_id", "branch_round", "branch_pos", "prompt", "response",
     "response_mask": [[value, run_length], ...],      # run-length encoded loss mask
     "tool_calls": [{"tag", "content", "result", "seconds", "ok"}, ...],
     "round_entropies": [...], "num_tool_calls", "finish_reason", "reward", "advantage",
     "branch_decisions": [{"step", "round", "h", "h_initial", "delta_h", "p", "u", "branched", "child"}, ...],
     "excluded_reason": "" | "tool_outage_masked" | "tool_outage_group_dropped"}   (tool_calls[*].infra: an outage)

`branch_decisions` holds the branch draws made on this trajectory's own rounds (none are inherited),
so a rule's fire rate over a dump is Σ branched / Σ draws.

`python -m verl_arpo.utils.rollout_tree <dump.jsonl>` draws one prompt's branching tree from it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from verl_arpo.utils.secrets import mask_text


def run_length_encode(values) -> list[list[int]]:
    """[1, 1, 0, 0, 0, 1] → [[1, 2], [0, 3], [1, 1]]."""
    out: list[list[int]] = []
    for v in values:
        v = int(v)
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def run_length_decode(runs) -> list[int]:
    return [int(v) for v, k in runs for _ in range(int(k))]


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    return x


def rollout_records(batch, tokenizer, step: int) -> list[dict]:
    """Build the dump records of a DataProto that went through rollout (+ reward/advantage)."""
    b, nt = batch.batch, batch.non_tensor_batch
    R = b["responses"].shape[-1]
    resp_attn = b["attention_mask"][:, -R:]
    prompt_attn = b["attention_mask"][:, :-R]
    records = []
    for i in range(len(batch)):
        L = int(resp_attn[i].sum())
        mask = b["response_mask"][i, :L].tolist() if "response_mask" in b.keys() else [1] * L
        rec = {
            "step": step,
            "prompt": tokenizer.decode(b["prompts"][i][prompt_attn[i].bool()].tolist(), skip_special_tokens=False),
            "response": tokenizer.decode(b["responses"][i, :L].tolist(), skip_special_tokens=False),
            "response_mask": run_length_encode(mask),
        }
        for key in ("uid", "traj_id", "parent_id", "branch_round", "branch_pos", "num_tool_calls",
                    "round_entropies", "tool_calls", "finish_reason", "data_source", "branch_decisions",
                    "excluded_reason"):
            if key in nt:
                rec[key] = _plain(nt[key][i])
        if "token_level_scores" in b.keys():
            rec["reward"] = float(b["token_level_scores"][i].sum())
        if "advantages" in b.keys() and sum(mask) > 0:
            m = b["response_mask"][i, :L].bool() if "response_mask" in b.keys() else slice(None)
            rec["advantage"] = float(b["advantages"][i, :L][m].mean())
        records.append(rec)
    return records


def dump_rollout(batch, tokenizer, step: int, out_dir: str | os.PathLike) -> Path:
    """Write `<out_dir>/rollout_<step>.jsonl` (atomically: a crash never leaves half a file)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rollout_{step}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in rollout_records(batch, tokenizer, step):
            f.write(mask_text(json.dumps(rec, ensure_ascii=False)) + "\n")   # a tool result may echo a key
    os.replace(tmp, path)
    return path


def read_dump(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
