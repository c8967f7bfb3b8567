"""Which device and which torch.distributed backend this process uses.

One rule for the whole code base ("Device independence" in the architecture notes): ``cuda`` when a
CUDA device is visible to this process, else ``cpu``. The process group is always able to reduce
CPU tensors: ``cpu:gloo,cuda:nccl`` on GPU (one group, each collective routed by its tensor's
device: CPU bookkeeping — loss counts, micro-batch counts, offloaded parameters and their
gradients — goes over gloo, everything on the GPU over NCCL), plain ``gloo`` on CPU. verl also
knows NPUs (``hccl``); we do not: there is no way to test them here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch

from verl_arpo.utils.cpu_info import cpu_vendor_and_flags, read_cpu_vendor_and_flags

__all__ = ["cpu_has_fast_bf16", "cuda_worker_env", "get_device_name", "get_dist_backend", "get_torch_device",
           "release_device_cache", "set_local_device", "without_cudnn_attention"]


def is_cuda_available() -> bool:
    """True when torch sees at least one CUDA device (``CUDA_VISIBLE_DEVICES`` is respected)."""
    return torch.cuda.is_available()


def get_device_name() -> str:
    """``"cuda"`` when a CUDA device is visible, else ``"cpu"``."""
    return "cuda" if is_cuda_available() else "cpu"


def get_dist_backend() -> str:
    """``"cpu:gloo,cuda:nccl"`` when a CUDA device is visible, else ``"gloo"``."""
    return "cpu:gloo,cuda:nccl" if is_cuda_available() else "gloo"


def get_torch_device():
    """The ``torch.cuda`` module on GPU machines, ``torch.cpu`` otherwise (for ``synchronize`` etc.)."""
    return torch.cuda if is_cuda_available() else torch.cpu


def set_local_device(local_rank: int) -> torch.device:
    """Select this process's device and return it.

    On CPU this is ``torch.device("cpu")``. On GPU: under Ray each worker sees only its own GPU(s)
    (Ray sets ``CUDA_VISIBLE_DEVICES``), so device ``local_rank`` may not exist; we then use
    ``local_rank % visible_count`` (index 0 when one GPU is visible, as under Ray).
    """
    if not is_cuda_available():
        return torch.device("cpu")
    index = int(local_rank) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# CPU flags of a native bf16 matrix multiply: Intel AMX, or AVX-512 BF16 (Intel Cooper Lake and later,
# AMD Zen 4 and later). Without them oneDNN emulates bf16 and a matmul is ~50x slower than in fp32
# (AMD EPYC Zen 3, AVX2 only: 0.6 against 29 GFLOP/s on one thread, docs/performance.md).
_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """True when this CPU multiplies bf16 matrices natively (one of `_BF16_FLAGS` in /proc/cpuinfo).
    bf16 compute then pays on the CPU (1.3-2x fp32 with AMX); without it, bf16 is emulated and far
    slower than fp32, so CPU runs should compute in fp32. Decided from the flags, not by timing, so
    the same machine always picks the same precision (and so the same numbers). Where the flags
    cannot be read (not Linux) the answer is False: fp32 is never the slow choice."""
    flags = (read_cpu_vendor_and_flags() if cpuinfo is None else cpu_vendor_and_flags(cpuinfo))[1]
    return any(f in flags for f in _BF16_FLAGS)


def release_device_cache(device) -> None:
    """On CUDA: wait for the queued kernels, then return the caching allocator's free blocks to the
    driver, so that memory allocated outside torch's allocator (vLLM's weights and KV cache when
    they wake) finds them. The update's peak otherwise stays reserved in torch's cache beside the
    engine (docs/gpu.md, "Memory around the wake"). A no-op on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


CUDA_ALLOC_CONF = "expandable_segments:True"


def cuda_worker_env(user_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of GPU training workers: PyTorch's expandable segments (fewer fragmented blocks
    between the update's differently sized activations; vLLM's sleep-mode pool turns them off around
    its own allocations), unless the user set PYTORCH_CUDA_ALLOC_CONF (in `user_env`, i.e.
    ray_init.runtime_env.env_vars, or in this process's environment): theirs wins."""
    if "PYTORCH_CUDA_ALLOC_CONF" in (user_env or {}) or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}


@contextlib.contextmanager
def without_cudnn_attention(device: torch.device | str) -> Iterator[None]:
    """Run model calls with cuDNN's SDPA kernel off (on CUDA; flash, memory-efficient and math
    attention stay as the user set them; the flag is restored afterwards). On the CPU: nothing.

    cuDNN attention builds an execution plan for every new shape. Decoding makes a new shape every
    step, and every training micro-batch has its own lengths: on an H200 the planning was 67% of a
    generate call's CPU time, and made a training forward + backward on new shapes 3.2-3.6x slower
    than with the memory-efficient kernel (on shapes seen before cuDNN was 1.14x faster; docs/gpu.md,
    "Verify on your GPU"). Backward runs the kernel its forward chose, but non-reentrant activation
    checkpointing re-runs the forward inside backward, and that re-run must pick the same kernel as
    the first run: wrap backward too. The flag is process-wide: model calls in one process must not
    run in parallel threads (none do: the engine, the actor and the critic take turns).
    """
    if torch.device(device).type != "cuda":
        yield
        return
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
