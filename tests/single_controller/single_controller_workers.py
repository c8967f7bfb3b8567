"""Worker classes used by the single-controller tests (shipped to Ray by value, see conftest)."""

import os
import time

import torch
import torch.distributed as dist

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.base import Worker
from verl_arpo.single_controller.decorator import Dispatch, register


class ToyWorker(Worker):
    """Small deterministic methods, one per dispatch mode."""

    def __init__(self, scale: int = 10):
        super().__init__()
        self.scale = scale

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setup_dist(self) -> str:
        self.init_process_group()
        return dist.get_backend()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def tagged(self, tag: str) -> tuple:
        return tag, self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, names: list[str]) -> dict:
        return {n: os.environ.get(n) for n in names}

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def whoami(self) -> tuple:
        return self.rank, os.getpid()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def scale_plus_rank(self, data: DataProto) -> DataProto:
        """y = x * scale + rank: shows which rank handled which row."""
        y = data.batch["x"] * self.scale + self.rank
        return DataProto.from_dict({"y": y}, {"uid": data.non_tensor_batch["uid"]}, meta_info=dict(data.meta_info))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def expand(self, data: DataProto, k: int) -> DataProto:
        """k outputs per input row, contiguous: y = x * scale + copy index."""
        rep = data.repeat(k, interleave=True)
        y = rep.batch["x"] * self.scale + torch.arange(len(rep)) % k
        return DataProto.from_dict({"y": y}, {"uid": rep.non_tensor_batch["uid"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def rows_seen(self, data: DataProto) -> DataProto:
        """Metrics only, no rows (like update_actor)."""
        return DataProto(meta_info={"metrics": {"rows": len(data), "rank": self.rank}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def apply(self, fn, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": fn(data.batch["x"])})


class DistWorker(Worker):
    """torch.distributed only (no DataProto): a cheap second group for the colocation test."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setup_dist(self) -> str:
        self.init_process_group()
        return dist.get_backend()

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()


class FragileWorker(Worker):
    """Methods that fail in the ways a real run can (imports neither torch nor DataProto)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def crash_on(self, rank_to_die: int, others_sleep: float) -> int:
        if self.rank == rank_to_die:
            os._exit(1)
        time.sleep(others_sleep)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nap_later(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_on(self, rank_to_fail: int) -> int:
        if self.rank == rank_to_fail:
            raise ValueError(f"bad input on rank {self.rank}")
        return self.rank


class BrokenInitWorker(Worker):
    """Rank 1's constructor fails (e.g. a wrong model path)."""

    def __init__(self):
        super().__init__()
        if self.rank == 1:
            raise FileNotFoundError("no model at /nonexistent")
