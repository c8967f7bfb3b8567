"""Which device and which torch.distributed backend this process uses.

One rule for the whole code base ("Device independence" in the architecture notes): ``cuda`` when a
CUDA device is visible to this process, else ``cpu``. The process group is always able to reduce
CPU tensors: ``cpu:gloo,cuda:nccl`` on GPU (one group, each collective routed by its tensor's
device: CPU bookkeeping — loss counts, micro-batch counts, offloaded parameters and their
gradients — goes over gloo, everything on the GPU over NCCL), plain ``gloo`` on CPU. verl also
knows NPUs (``hccl``); we do not: there is no way to test them here.
"""

from __future__ import annotations

import torch

__all__ = ["get_device_name", "get_dist_backend", "get_torch_device", "set_local_device"]


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
