"""How CPU threads wait, set in the environment of every process that computes on the CPU
(docs/performance.md, "Threads on a busy machine"). No torch import: the quickstart's own process,
which only starts stages, uses it too."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CPU_WAIT_VARS", "cpu_thread_env"]

CPU_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def cpu_thread_env(user_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of every process that computes with several CPU threads: OpenMP threads that wait
    for work sleep (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning, unless the user set a wait
    policy (in `user_env`, or in this process's environment): theirs wins.

    Why (docs/performance.md, "Threads on a busy machine"): with the default policy a waiting thread
    spins for ~300,000 iterations, so two threads on two cores that another job also uses spend most
    of the machine waiting on each other; a decode step of SmolLM2-135M on 2 threads took ~11× as
    long. The wait policy changes only how idle threads wait, not how work is split, so the numbers
    computed are the same. libgomp reads it when it loads (with torch), so it must be in the
    environment a process starts with."""
    if any(k in (user_env or {}) or k in os.environ for k in CPU_WAIT_VARS):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}
