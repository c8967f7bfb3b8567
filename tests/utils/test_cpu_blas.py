"""MKL's code path for fp32 products (verl_arpo/utils/cpu_blas.py): AVX2 on x86 CPUs that are not Intel's,
nothing on Intel's or elsewhere, the user's value over ours, and read by MKL at its first product."""
import os
import subprocess
import sys

import pytest

from verl_arpo.utils import cpu_info
from verl_arpo.utils.cpu_blas import MKL_BRANCH_VAR, mkl_branch_env
from verl_arpo.utils.threads import CHOSEN_BY_US, cpu_process_env

# /proc/cpuinfo of two processors each, as the kernel writes them
AMD_ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "flags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16\n\n"
            "processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx fma avx2 avx512f\n")
AMD_OLD = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx\n"
INTEL = ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx fma avx2 avx512f amx_bf16\n\n"
         "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx fma avx2 avx512f amx_bf16\n")
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes\nCPU implementer\t: 0x41\n"


@pytest.fixture
def no_user_value(monkeypatch):
    monkeypatch.delenv(MKL_BRANCH_VAR, raising=False)


def _cpuinfo(tmp_path, text):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, expected", [(AMD_ZEN4, {MKL_BRANCH_VAR: "AVX2"}), (AMD_OLD, {}), (INTEL, {}),
                                            (ARM, {})])
def test_avx2_only_on_an_x86_cpu_that_is_not_intels_and_can_run_it(tmp_path, no_user_value, text, expected):
    assert mkl_branch_env(cpuinfo=_cpuinfo(tmp_path, text)) == expected


def test_no_cpuinfo_sets_nothing(tmp_path, no_user_value):
    assert mkl_branch_env(cpuinfo=tmp_path / "missing") == {}


def test_the_users_value_wins_and_is_carried_on(tmp_path, monkeypatch):
    amd = _cpuinfo(tmp_path, AMD_ZEN4)
    assert mkl_branch_env({MKL_BRANCH_VAR: "AUTO"}, cpuinfo=amd) == {MKL_BRANCH_VAR: "AUTO"}
    assert mkl_branch_env({MKL_BRANCH_VAR: ""}, cpuinfo=amd) == {MKL_BRANCH_VAR: ""}   # the opt-out: MKL's own
    monkeypatch.setenv(MKL_BRANCH_VAR, "COMPATIBLE")
    assert mkl_branch_env(cpuinfo=amd) == {MKL_BRANCH_VAR: "COMPATIBLE"}
    assert mkl_branch_env({MKL_BRANCH_VAR: "AVX"}, cpuinfo=_cpuinfo(tmp_path, INTEL)) == {MKL_BRANCH_VAR: "AVX"}


def test_a_process_gets_the_branch_beside_how_its_threads_wait(tmp_path, monkeypatch, no_user_value):
    monkeypatch.setattr(cpu_info, "CPUINFO", _cpuinfo(tmp_path, AMD_ZEN4))
    env = cpu_process_env(alone=False)
    assert env[MKL_BRANCH_VAR] == "AVX2" and env[CHOSEN_BY_US] == "auto" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setattr(cpu_info, "CPUINFO", _cpuinfo(tmp_path, INTEL))
    assert MKL_BRANCH_VAR not in cpu_process_env(alone=False)


# 7 rows: where MKL's generic path rounds differently from its COMPATIBLE branch (1 thread) and from its AVX2
# branch and reproducible mode (2 threads) on an AMD EPYC
_PRODUCT = ("import hashlib, os, sys, torch\n"
            "if sys.argv[1] != '-': os.environ['MKL_CBWR'] = sys.argv[1]\n"
            "g = torch.Generator().manual_seed(0)\n"
            "w, x = torch.randn(1536, 576, generator=g), torch.randn(7, 576, generator=g)\n"
            "print(hashlib.sha1(torch.nn.functional.linear(x, w).numpy().tobytes()).hexdigest())\n")


def _product(env_value: str | None, late: str = "-", threads: int = 1) -> str:
    env = {k: v for k, v in os.environ.items() if k != MKL_BRANCH_VAR}
    if env_value is not None:
        env[MKL_BRANCH_VAR] = env_value
    out = subprocess.run([sys.executable, "-c", _PRODUCT, late], env={**env, "OMP_NUM_THREADS": str(threads)},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_mkl_reads_the_branch_at_its_first_product_not_when_torch_loads():
    """What lets main_ppo, main_sft and main_eval set it in their own environment: a value set after torch
    is imported (but before any product) computes what the same value set at the start computes."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("torch is not built with MKL here")
    early, late, default = _product("COMPATIBLE"), _product(None, late="COMPATIBLE"), _product(None)
    if early == default:
        pytest.skip("on this CPU MKL's own path computes the COMPATIBLE branch's numbers: nothing to tell apart")
    assert late == early


def test_an_empty_value_keeps_mkls_own_pick_where_auto_would_not():
    """The opt-out the docs give: `MKL_CBWR=` computes what no MKL_CBWR computes. `AUTO` is MKL's reproducible
    mode, which on an AMD EPYC rounds like the AVX2 branch."""
    import torch

    if not torch.backends.mkl.is_available():
        pytest.skip("torch is not built with MKL here")
    own, empty, reproducible = (_product(value, threads=2) for value in (None, "", "AUTO"))
    if own == reproducible:
        pytest.skip("on this CPU MKL's own path computes the reproducible mode's numbers: nothing to tell apart")
    assert empty == own
