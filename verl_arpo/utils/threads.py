"""How CPU threads wait, set in the environment of every process that computes on the CPU
(docs/performance.md, "Threads on a busy machine"). No torch import: the quickstart's own process,
which only starts stages, uses it too.

A thread of an OpenMP team that has no work waits for the next parallel region, either spinning or
asleep. Spinning is faster when the cores are ours alone (a sleeping thread costs a wake-up at every
region, and torch opens one for each op on a large tensor); it is ruinous when another job holds a
core the team waits on. So a process that starts on an idle machine spins briefly
(`GOMP_SPINCOUNT=3000`), and one that starts on a busy machine, or a worker that shares the machine
with its siblings, sleeps (`OMP_WAIT_POLICY=PASSIVE`). The choice changes only how idle threads wait,
never how the work is split: the numbers computed are the same."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from verl_arpo.utils.cpu_blas import mkl_branch_env

__all__ = ["CPU_WAIT_VARS", "CHOSEN_BY_US", "IDLE_BELOW_CORES", "SPIN_WHEN_IDLE", "busy_cores",
           "cpu_process_env", "cpu_thread_env", "cpu_times", "wait_env"]

CPU_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

CHOSEN_BY_US = "VERL_ARPO_CPU_WAIT"
"""Set (to "auto") beside the wait variables we chose, so that a process started with them (a stage
of the quickstart) keeps the choice, and tells it from one the user made."""

SPIN_WHEN_IDLE = "3000"
"""GOMP_SPINCOUNT on an idle machine. Measured on a 2-core AMX Xeon (docs/performance.md, "Threads on
a busy machine"): the quickstart's evaluation of 150 questions generated in 37 s against 54 s asleep,
and beside one busy process in 71 s against 55 (30,000 spins: 34 s idle, 144 s busy)."""

IDLE_BELOW_CORES = 0.5
"""The machine is idle when the other work on this process's cores adds up to less than this."""


def cpu_times(stat_text: str, cpus: set[int] | None = None) -> dict[int, tuple[int, int]]:
    """{cpu: (all time, idle time)} in clock ticks from /proc/stat's per-CPU lines, for `cpus` (None:
    all): all = user + nice + system + idle + iowait + irq + softirq + steal (guest time is inside user,
    so not added again), idle = idle + iowait."""
    out = {}
    for line in stat_text.splitlines():
        name, *fields = line.split() or [""]
        if not name.startswith("cpu") or not name[3:].isdigit() or len(fields) < 5:
            continue
        cpu = int(name[3:])
        if cpus is None or cpu in cpus:
            v = [int(x) for x in fields[:8]]
            out[cpu] = (sum(v), v[3] + v[4])
    return out


def busy_cores(window_s: float = 0.25, stat: Path = Path("/proc/stat"),
               cpus: set[int] | None = None) -> float | None:
    """Cores' worth of time that the CPUs this process may run on (or `cpus`) spent on anything but
    idling over the next `window_s` seconds: Σ over them of 1 − Δidle / Δall (`cpu_times`). None
    without /proc/stat (not Linux)."""
    if cpus is None and hasattr(os, "sched_getaffinity"):
        cpus = os.sched_getaffinity(0)
    try:
        before = cpu_times(stat.read_text(), cpus)
        time.sleep(window_s)
        after = cpu_times(stat.read_text(), cpus)
    except OSError:
        return None
    if not before:
        return None
    busy = 0.0
    for cpu, (all0, idle0) in before.items():
        all1, idle1 = after.get(cpu, (all0, idle0))
        if all1 > all0:
            busy += 1.0 - (idle1 - idle0) / (all1 - all0)
    return busy


def wait_env(busy: float | None) -> dict[str, str]:
    """The wait variables for a process that starts while `busy` cores' worth of other work runs
    (None: unknown): a short spin when idle, asleep otherwise."""
    if busy is not None and busy < IDLE_BELOW_CORES:
        return {"GOMP_SPINCOUNT": SPIN_WHEN_IDLE, CHOSEN_BY_US: "auto"}
    return {"OMP_WAIT_POLICY": "PASSIVE", CHOSEN_BY_US: "auto"}


def cpu_thread_env(user_env: Mapping[str, str] | None = None, alone: bool = True) -> dict[str, str]:
    """Environment of a process that computes with several CPU threads, chosen when it starts. The
    user's wait variables (in `user_env`, or in this process's environment without our mark) win: then
    nothing. A process started with our choice keeps it. Otherwise `wait_env` of the machine's load
    now, or, for a worker that shares the machine with its siblings (`alone=False`: the siblings are
    the load), asleep, whatever this process was started with.

    libgomp reads these when it loads (with torch), so they must be in the environment a process
    starts with."""
    ours = os.environ.get(CHOSEN_BY_US) == "auto"
    users = any(k in (user_env or {}) for k in CPU_WAIT_VARS) or (
        not ours and any(k in os.environ for k in CPU_WAIT_VARS))
    if users:
        return {}
    if not alone:   # GOMP_SPINCOUNT outranks the policy in libgomp: 0 undoes a spin count inherited from us
        return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", CHOSEN_BY_US: "auto"}
    if ours:
        return {}
    return wait_env(busy_cores())


def cpu_process_env(user_env: Mapping[str, str] | None = None, alone: bool = True) -> dict[str, str]:
    """The environment a process that computes on the CPU starts with: how its threads wait
    (`cpu_thread_env`) and MKL's code path for its fp32 products (cpu_blas.py)."""
    return {**mkl_branch_env(user_env), **cpu_thread_env(user_env, alone)}
