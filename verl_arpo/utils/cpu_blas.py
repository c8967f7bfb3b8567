"""Which of MKL's code paths a CPU process computes its fp32 matrix products with (docs/performance.md,
"MKL's code path on CPUs that are not Intel's"). No torch import: the quickstart's own process, which only
starts stages, uses it too.

torch's CPU wheels do fp32 matrix products with MKL's sgemm. MKL picks its kernels by the CPU's vendor: on
an x86 CPU that is not Intel's (AMD's EPYC and Ryzen) it runs a generic code path that does not use AVX2,
however new the CPU. Its `MKL_CBWR` variable (conditional numerical reproducibility) names the branch
to run instead. `AVX2` runs the AVX2 kernels, which every x86 CPU with AVX2 and FMA can run. On a 2-core
Zen 4 EPYC it made the fp32 generation of 16 rows in one process of 2 threads 1.4x faster: on the
generic path a product of 2 to 11 rows took as long as that many products of one row, and the AVX2 path
was 1.7-2.9x faster there. With 1 thread (each of the quickstart's RL workers) both paths ran as fast, and
the quickstart's fp32 stages gave the same trajectories, losses and answers on both. Its errors against
a float64 reference are the generic path's (relative RMS 2-4e-7 on SmolLM2's weights, every shape measured).

It changes only fp32 products: bf16 ones go to oneDNN, whatever MKL_CBWR says. The quickstart's
`--smoke` run in bf16 gave the same SFT and RL models, trajectories and answers with and without it.
On an Intel CPU MKL already picks its best branch, so nothing is set there. A value the user sets
wins. An empty one (`MKL_CBWR=`) keeps MKL's own pick; `AUTO` does not, because it turns on MKL's
reproducible mode, which on the Zen 4 EPYC computed what `AVX2` computes, as fast."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from verl_arpo.utils.cpu_info import read_cpu_vendor_and_flags

__all__ = ["MKL_BRANCH_VAR", "MKL_BRANCH", "MKL_OWN", "mkl_branch_env"]

MKL_BRANCH_VAR = "MKL_CBWR"
MKL_BRANCH = "AVX2"
"""The branch set on an x86 CPU that is not Intel's. On the Zen 4 EPYC (avx512f), `AVX512` computed the same
numbers at the same speed as `AVX2`, and `AVX2` also runs on CPUs without AVX-512 (Zen 2 and 3)."""
MKL_OWN = ""
"""The value that keeps MKL's own pick (MKL ignores an empty MKL_CBWR): the user's way to opt out."""

def mkl_branch_env(user_env: Mapping[str, str] | None = None, cpuinfo: Path | None = None) -> dict[str, str]:
    """{"MKL_CBWR": value} for a process that starts now: the user's value (in `user_env`, else in this
    process's environment), carried on as it is; else `AVX2` on an x86 CPU that is not Intel's and has
    AVX2 and FMA; else nothing (Intel CPUs, other architectures, no /proc/cpuinfo).

    MKL reads the variable at its first product, so a process may set it in its own environment any time
    before it computes."""
    for env in (user_env or {}, os.environ):
        if MKL_BRANCH_VAR in env:
            return {MKL_BRANCH_VAR: env[MKL_BRANCH_VAR]}
    vendor, flags = read_cpu_vendor_and_flags(cpuinfo)
    if vendor is None or vendor == "GenuineIntel" or not {"avx2", "fma"} <= flags:
        return {}
    return {MKL_BRANCH_VAR: MKL_BRANCH}
