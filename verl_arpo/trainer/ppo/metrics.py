"""Training metrics with verl's names (critic/score/mean, response_length/mean, timing_s/gen, ...)
plus validation summaries (mean score per data_source, unbiased pass@k)."""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from time import perf_counter
from collections.abc import Iterable

import numpy as np
import torch

from verl_arpo.utils.stats import pass_at_k


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def compute_data_metrics(batch, use_critic: bool = False) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch."""
    b = batch.batch
    R = b["responses"].shape[-1]
    resp_attn = b["attention_mask"][:, -R:]
    mask = b["response_mask"].bool() if "response_mask" in b.keys() else resp_attn.bool()
    response_len = resp_attn.sum(-1).float()
    prompt_len = b["attention_mask"][:, :-R].sum(-1).float()
    m: dict[str, float] = {}
    m.update(_stats("critic/score", b["token_level_scores"].sum(-1)))
    m.update(_stats("critic/rewards", b["token_level_rewards"].sum(-1)))
    m.update(_stats("critic/advantages", b["advantages"][mask]))
    m.update(_stats("critic/returns", b["returns"][mask]))
    if use_critic and "values" in b.keys():
        m.update(_stats("critic/values", b["values"][mask]))
    m.update(_stats("response_length", response_len))
    m["response_length/clip_ratio"] = (response_len >= R).float().mean().item()
    m.update(_stats("prompt_length", prompt_len))
    m["response_length/model_tokens_mean"] = mask.sum(-1).float().mean().item()
    nt = batch.non_tensor_batch
    if "num_tool_calls" in nt:
        calls = np.asarray(nt["num_tool_calls"], dtype=float)
        m["tools/calls_per_traj"] = float(calls.mean())
        m["tools/traj_with_calls"] = float((calls > 0).mean())
    return m


def compute_timing_metrics(timing: dict[str, float]) -> dict[str, float]:
    return {f"timing_s/{k}": float(v) for k, v in timing.items()}


def compute_throughput_metrics(batch, timing: dict[str, float], n_workers: int) -> dict[str, float]:
    """perf/throughput = tokens (prompt + response) per second per worker over the whole step."""
    tokens = int(batch.batch["attention_mask"].sum())
    step = timing.get("step", 0.0) or 1e-9
    return {"perf/total_num_tokens": float(tokens), "perf/time_per_step": step,
            "perf/throughput": tokens / step / max(1, n_workers)}


@contextmanager
def timed(name: str, timing: dict[str, float]):
    t0 = perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + perf_counter() - t0


def validation_metrics(data_sources: Iterable[str], uids: Iterable, scores: Iterable[float],
                       n: int, correct_threshold: float = 1.0) -> dict[str, float]:
    """val/<data_source>/score/mean over all samples; with n > 1 also pass@1 and pass@n per source
    (a sample counts as correct when its score ≥ correct_threshold; F1-style scores below 1 count
    as partial in the mean only)."""
    per_source: dict[str, list[float]] = defaultdict(list)
    groups: dict[tuple, list[float]] = defaultdict(list)
    for ds, uid, s in zip(data_sources, uids, scores):
        per_source[ds].append(float(s))
        groups[(ds, uid)].append(float(s))
    out: dict[str, float] = {}
    for ds, vals in per_source.items():
        out[f"val/{ds}/score/mean"] = float(np.mean(vals))
        if n > 1:
            gs = [g for (d, _), g in groups.items() if d == ds]
            for k in sorted({1, n}):
                out[f"val/{ds}/pass@{k}"] = float(np.mean(
                    [pass_at_k(len(g), sum(x >= correct_threshold for x in g), k) for g in gs]))
    if per_source:
        out["val/score/mean"] = float(np.mean([s for v in per_source.values() for s in v]))
    return out
