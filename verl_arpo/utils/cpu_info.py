"""What /proc/cpuinfo says about this CPU, parsed in one place: its vendor and its flags. utils/device.py
picks the CPU's precision from them, utils/cpu_blas.py MKL's code path, and the benchmarks and experiments
record the SIMD flags beside every timing (docs/performance.md, "Precision on the CPU"). No torch import:
the quickstart's own process, which only starts stages, uses it too."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CPUINFO", "SIMD_FLAGS", "cpu_vendor_and_flags", "read_cpu_vendor_and_flags", "simd_flags"]

CPUINFO = Path("/proc/cpuinfo")
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The flags a CPU timing depends on: fp32 with AVX2 and FMA, native bf16 with AVX-512 BF16 or AMX."""


def cpu_vendor_and_flags(cpuinfo_text: str) -> tuple[str | None, set[str]]:
    """(the first processor's vendor_id, the union of every processor's flags) of /proc/cpuinfo's text;
    (None, set()) without them (an ARM CPU names no vendor_id and lists "Features", not "flags")."""
    vendor, flags = None, set()
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and vendor is None:
            vendor = value.strip()
        elif key == "flags":
            flags.update(value.split())
    return vendor, flags


def read_cpu_vendor_and_flags(cpuinfo: Path | None = None) -> tuple[str | None, set[str]]:
    """cpu_vendor_and_flags of this machine's /proc/cpuinfo (or `cpuinfo`); (None, set()) where it cannot be
    read (not Linux)."""
    try:
        return cpu_vendor_and_flags((cpuinfo or CPUINFO).read_text())
    except OSError:
        return None, set()


def simd_flags(cpuinfo: Path | None = None) -> list[str]:
    """The SIMD_FLAGS this CPU has, in SIMD_FLAGS's order."""
    flags = read_cpu_vendor_and_flags(cpuinfo)[1]
    return [f for f in SIMD_FLAGS if f in flags]
