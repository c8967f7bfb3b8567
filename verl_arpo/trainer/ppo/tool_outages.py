"""Tool outages: a trajectory whose tool call hit an *infrastructure* failure (the search API down
or rate-limited past its retries, a connection refused, a call past its timeout) is not the model's
doing, and training on it teaches the model that tools fail (docs/tools.md, "Tool outages").

`apply_outage_policy` runs after the rewards and before the advantages, with
`actor_rollout_ref.rollout.tools.infra_failure_policy`:

    keep        train it as is (the behaviour before issue 51)
    mask        its response mask becomes 0 (it trains nothing) and it moves to a group of its own,
                so its reward leaves its siblings' baseline
    drop_group  every trajectory of its prompt gets response mask 0 (shapes stay; nothing of the
                group trains)

Every affected trajectory is counted in metrics and named in the rollout dump (`excluded_reason`).
The model's own errors (bad code, an empty query, no results) are results, always kept.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from verl_arpo.protocol import DataProto, as_object_array

POLICIES = ("mask", "drop_group", "keep")


class ToolOutageError(RuntimeError):
    """A step's share of trajectories hit by tool infrastructure failures passed the stop rate."""


def infra_failures(batch: DataProto) -> list[list[str]]:
    """Per trajectory, the tags of its tool calls that failed for infrastructure reasons."""
    calls = batch.non_tensor_batch.get("tool_calls")
    if calls is None:
        return [[] for _ in range(len(batch))]
    return [[c.get("tag", "?") for c in (row or []) if c.get("infra")] for row in calls]


def apply_outage_policy(batch: DataProto, policy: str, failed: list[list[str]] | None = None) -> dict[str, float]:
    """Apply `policy` in place (see the module docstring); returns the step's outage metrics.
    `failed`: infra_failures(batch), when the caller has it already."""
    if policy not in POLICIES:
        raise ValueError(f"unknown infra_failure_policy {policy!r}; accepted: {list(POLICIES)}")
    failed = infra_failures(batch) if failed is None else failed
    hit = [i for i, tags in enumerate(failed) if tags]
    n = len(batch)
    metrics = {"tools/infra_failed_trajectories": float(len(hit)),
               "tools/infra_failed_share": len(hit) / n if n else 0.0}
    for tag, count in Counter(t for tags in failed for t in set(tags)).items():
        metrics[f"tools/{tag}/infra_failed_trajectories"] = float(count)
    reasons = [""] * n
    uid = list(batch.non_tensor_batch["uid"])
    mask = batch.batch["response_mask"]
    if hit and policy == "mask":
        for i in hit:
            mask[i] = 0
            uid[i] = f"{uid[i]}#outage{i}"   # a group of its own: its reward leaves the siblings' baseline
            reasons[i] = "tool_outage_masked"
        metrics["tools/infra_masked_trajectories"] = float(len(hit))
    elif hit and policy == "drop_group":
        groups = {uid[i] for i in hit}
        rows = [i for i, u in enumerate(uid) if u in groups]
        for i in rows:
            mask[i] = 0
            reasons[i] = "tool_outage_group_dropped"
        metrics["tools/infra_dropped_groups"] = float(len(groups))
        metrics["tools/infra_dropped_trajectories"] = float(len(rows))
    batch.non_tensor_batch["uid"] = as_object_array(uid)
    batch.non_tensor_batch["excluded_reason"] = as_object_array(reasons)
    return metrics


def outage_stop_message(failed: list[list[str]], rate: float, stop_rate: float, step: int,
                        checkpoint: str | None) -> str:
    """The one line a run stops with (`failed`: infra_failures of the step's batch): the tools, the
    share, the checkpoint and how to resume."""
    tools = Counter(t for tags in failed for t in set(tags))
    named = ", ".join(f"{tag} ({count} trajectories)" for tag, count in tools.most_common())
    where = checkpoint or "none (nothing trained yet)"
    return (f"tool outage at step {step}: {rate:.0%} of the step's trajectories hit infrastructure failures of "
            f"{named}, more than actor_rollout_ref.rollout.tools.infra_failure_stop_rate={stop_rate:g}; the step was "
            f"not trained. Last checkpoint: {where}. Fix the tool's service, then rerun the same command with "
            "trainer.resume_mode=auto")


def share_failed(failed: list[list[str]]) -> float:
    """The share of trajectories with an infrastructure failure (`failed`: infra_failures(batch))."""
    return float(np.mean([bool(tags) for tags in failed])) if failed else 0.0
