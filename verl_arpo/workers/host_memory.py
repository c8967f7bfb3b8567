"""Memory of a worker: its host RSS per phase of a step, read from /proc (high-water mark and current
size), the device's allocator, and giving freed memory back (docs/gpu.md, "Host memory").

    HOST_MEMORY             the per-phase monitor (`with HOST_MEMORY.phase("rollout"): ...`)
    memory_metrics          perf/* memory metrics of a step
    release_host_memory     glibc's malloc_trim after a phase that freed much
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch


logger = logging.getLogger(__name__)


def _read_hwm() -> int | None:
    """This process's resident high-water mark in bytes (VmHWM); None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the resident high-water mark to the current RSS
    except OSError:  # a kernel or sandbox without the reset: peaks then run from the process start
        pass


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class HostMemoryPhases:
    """Resident host memory per named phase of a worker (docs/gpu.md, "Host memory").

    The kernel keeps one high-water mark per process (VmHWM), which /proc/self/clear_refs resets to the
    current RSS. At every phase boundary the mark is read, folded into the running peak of each open
    phase (phases nest: "update" holds "update/backward") and of the window that `memory_metrics`
    reports, then reset. A phase reports its resident memory at entry and its peak; peak − entry is
    what the phase itself allocates. One instance per process: `HOST_MEMORY`. Because the phases
    reset VmHWM, code that wants a peak across them reads `HOST_MEMORY.take_window_peak()`, not VmHWM.
    """

    def __init__(self) -> None:
        self._open: list[str] = []
        self.entry: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.window_peak = 0
        self.device: dict[str, tuple[int, int]] = {}  # top-level phase -> device bytes used at entry, at exit

    def _fold(self) -> None:
        hwm = _read_hwm()
        if hwm is None:
            return
        self.window_peak = max(self.window_peak, hwm)
        for name in self._open:
            self.peak[name] = max(self.peak.get(name, 0), hwm)
        _reset_hwm()

    @contextlib.contextmanager
    def phase(self, name: str):
        """The span of `name`; repeated spans of one name (micro-batches) keep the first entry and the
        largest peak until `metrics()` hands them out."""
        self._fold()  # what came before belongs to the phases already open
        rss = _rss()
        if rss is not None:
            self.entry.setdefault(name, rss)
        # the device as the driver sees it (vLLM's own pools included), for top-level phases only: a
        # reading synchronises the device, which is cheap per phase and not per micro-batch
        dev_entry = _device_used() if "/" not in name else None
        self._open.append(name)
        try:
            yield
        finally:
            self._fold()
            self._open.remove(name)
            if dev_entry is not None:
                self.device[name] = (self.device.get(name, (dev_entry,))[0], _device_used())

    def metrics(self) -> dict[str, float]:
        """perf/cpu_memory_peak_gb/<phase> and perf/cpu_memory_entry_gb/<phase> of every phase closed
        since the last call (then forgotten)."""
        done = [n for n in self.peak if n not in self._open]
        out = {f"perf/cpu_memory_peak_gb/{n}": self.peak.pop(n) / 2**30 for n in done}
        out.update({f"perf/cpu_memory_entry_gb/{n}": self.entry.pop(n) / 2**30 for n in done if n in self.entry})
        for n in [n for n in self.device if n not in self._open]:  # CUDA only: perf/gpu_memory_{entry,exit}_gb/<phase>
            entry, exit_ = self.device.pop(n)
            out[f"perf/gpu_memory_entry_gb/{n}"], out[f"perf/gpu_memory_exit_gb/{n}"] = entry / 2**30, exit_ / 2**30
        return out

    def take_window_peak(self) -> int | None:
        """The resident peak since the last call (then a new window starts); None without /proc."""
        self._fold()
        peak, self.window_peak = self.window_peak, 0
        return peak or None


HOST_MEMORY = HostMemoryPhases()


def _device_used() -> int | None:
    """Bytes in use on this process's CUDA device as the driver reports them (other processes' and
    vLLM's allocations included); None where CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def memory_metrics(device: torch.device) -> dict[str, float]:
    """verl's memory metrics of this worker: perf/max_memory_allocated_gb and perf/max_memory_reserved_gb
    (device peaks since the last call, which resets them; CUDA only), perf/cpu_memory_used_gb (this
    process's resident host memory now) and perf/cpu_memory_peak_gb (its resident peak since the last
    call; Linux only), plus the per-phase host peaks of `HOST_MEMORY` closed since the last call."""
    out = {}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    rss, peak = _rss(), HOST_MEMORY.take_window_peak()
    if rss is not None:
        out["perf/cpu_memory_used_gb"] = rss / 2**30
    if peak is not None:
        out["perf/cpu_memory_peak_gb"] = peak / 2**30
    out.update(HOST_MEMORY.metrics())
    return out


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc `malloc_trim(0)`; a no-op elsewhere).

    Tensors of a few MB come from malloc's heap, and freed chunks in its middle stay resident: over
    the quickstart's steps a worker grew 2.9 → 4.5 GB with nothing alive to show for it; with a trim
    after each update it stayed at 2.0–2.1 GB (docs/gpu.md, "Host memory"). Workers call it at the
    end of every phase."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim this way
        pass
