"""LocalWorkerGroup: the worker in the driver's process, driven like a RayWorkerGroup of one
(trainer.single_process; single_controller/local.py). No Ray here: these tests never start it."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.base import Worker
from verl_arpo.single_controller.decorator import Dispatch, register
from verl_arpo.single_controller.local import TIMEOUT_EXIT_CODE, LocalWorkerGroup

sys.path.insert(0, str(Path(__file__).parent))
from single_controller_workers import ToyWorker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class EditingWorker(Worker):
    """Edits what it is given and keeps what it returns, as a careless worker may."""

    def __init__(self):
        super().__init__()
        self.kept = None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double_in_place(self, data: DataProto) -> DataProto:
        data.batch["x"].mul_(2)          # the caller's batch must not change (Ray pickles it)
        data.meta_info["touched"] = True
        self.kept = DataProto.from_dict({"y": data.batch["x"]})
        return self.kept

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spoil_kept(self) -> None:
        self.kept.batch["y"].zero_()     # the driver's copy of the result must not change


def _batch(n: int = 4) -> DataProto:
    import numpy as np

    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)},
                               {"uid": np.array([f"u{i}" for i in range(n)], dtype=object)}, meta_info={"k": 1})


def test_dispatch_modes_give_what_a_group_of_one_gives():
    wg = LocalWorkerGroup(ToyWorker, scale=3)
    try:
        out = wg.scale_plus_rank(_batch())
        assert out.batch["y"].tolist() == [0.0, 3.0, 6.0, 9.0]           # x * 3 + rank 0
        assert list(out.non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3"]
        expanded = wg.expand(_batch(2), 3)                              # 3 rows per input row, in order
        assert expanded.batch["y"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert wg.tagged("t") == [("t", 0)]                             # ONE_TO_ALL: a list, one per rank
        assert wg.whoami() == (0, os.getpid())                          # RANK_ZERO: rank 0's answer, this process
        assert wg.apply(lambda x: x + 1, _batch(3)).batch["y"].tolist() == [1.0, 2.0, 3.0]
        assert wg.execute_rank_zero("tagged", "z") == ("z", 0)
        assert wg.execute_all("tagged", "z") == [("z", 0)]
        assert wg.setup_dist() == ["gloo"]                              # a 1-rank process group
        assert wg.all_reduce_sum([[1.5, 2.0]]) == [[1.5, 2.0]]
        assert wg.node_infos[0]["pid"] == os.getpid() and wg.node_infos[0]["world_size"] == 1
    finally:
        wg.shutdown()
    import torch.distributed as dist

    assert not dist.is_initialized()                                    # shutdown left the group
    with pytest.raises(RuntimeError, match="shut down; cannot call tagged"):
        wg.tagged("late")


def test_arguments_and_results_are_copies_as_under_ray():
    wg = LocalWorkerGroup(EditingWorker)
    try:
        batch = _batch()
        out = wg.double_in_place(batch)
        assert batch.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and "touched" not in batch.meta_info
        assert out.batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
        wg.spoil_kept()
        assert out.batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]
    finally:
        wg.shutdown()


def test_rank_environment_is_set_for_the_worker_and_restored_after(monkeypatch):
    monkeypatch.setenv("RANK", "7")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("VERL_ARPO_TEST_VAR", raising=False)
    wg = LocalWorkerGroup(ToyWorker, env_vars={"VERL_ARPO_TEST_VAR": "on"}, num_threads=1)
    try:
        seen = wg.env(["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "VERL_ARPO_TEST_VAR"])[0]
        assert seen == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "VERL_ARPO_TEST_VAR": "on"}
        assert torch.get_num_threads() == 1
    finally:
        wg.shutdown()
    assert os.environ["RANK"] == "7" and "LOCAL_WORLD_SIZE" not in os.environ and "VERL_ARPO_TEST_VAR" not in os.environ
    with pytest.raises(ValueError, match=r"cannot set \['RANK'\]"):
        LocalWorkerGroup(ToyWorker, env_vars={"RANK": "1"})


def test_non_blocking_calls_return_their_result_on_get():
    from single_controller_workers import FragileWorker

    wg = LocalWorkerGroup(FragileWorker)
    try:
        pending = wg.nap_later(0.0)
        assert pending.get() == [0]
        with pytest.raises(ValueError, match="bad input on rank 0"):   # the worker's own exception, unchanged
            wg.raise_on(0)
    finally:
        wg.shutdown()


def test_a_call_past_its_timeout_ends_the_process_naming_the_method(tmp_path):
    """A call in the driver's own thread cannot be interrupted: past call_timeout the process exits with
    the command line's timeout code (5), after naming the method and printing where it was."""
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from single_controller_workers import FragileWorker
        from verl_arpo.single_controller.local import LocalWorkerGroup
        wg = LocalWorkerGroup(FragileWorker, call_timeout=0.5)
        print("fast", wg.nap(0.0), flush=True)
        wg.nap(30.0)
        print("not reached", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == TIMEOUT_EXIT_CODE == 5, proc.stderr[-2000:]
    assert "fast [0]" in proc.stdout and "not reached" not in proc.stdout
    assert "FragileWorker.nap did not finish within 0.5s (trainer.worker_call_timeout)" in proc.stderr
    assert "in nap" in proc.stderr          # the main thread's stack shows where the call was
