"""A real 2-worker Ray group: gloo all-reduce, every dispatch mode, rank-zero calls, node info."""

import os

import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.utils.threads import CHOSEN_BY_US, CPU_WAIT_VARS


@pytest.fixture
def group(toy_group):
    return toy_group


def make(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]}, meta_info={"temperature": 0.7})


def test_gloo_all_reduce(group):
    assert group.world_size == 2 and len(group.workers) == 2
    assert group.setup_dist() == ["gloo", "gloo"]
    # rank 0 holds [1, 2], rank 1 holds [3, 40]: both end with the sum [4, 42]
    assert group.all_reduce_sum([[1.0, 2.0], [3.0, 40.0]]) == [[4.0, 42.0], [4.0, 42.0]]


def test_environment_and_node_info(group):
    infos = group.node_infos
    assert [i["rank"] for i in infos] == [0, 1]
    assert [i["local_rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert {(i["master_addr"], i["master_port"]) for i in infos} == {(group.master_address, group.master_port)}
    assert infos[0]["ip"] == group.master_address
    assert len({i["pid"] for i in infos}) == 2
    env = group.env(["RANK", "LOCAL_WORLD_SIZE", "RAY_USAGE_STATS_ENABLED", "OMP_NUM_THREADS"])
    assert env == [
        {"RANK": "0", "LOCAL_WORLD_SIZE": "2", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"},
        {"RANK": "1", "LOCAL_WORLD_SIZE": "2", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"},
    ]
    # threads that sleep while they wait beside their siblings (utils/threads.py); a policy this
    # environment's user set is kept
    chosen = {k: os.environ.get(k) for k in CPU_WAIT_VARS}
    ours = os.environ.get(CHOSEN_BY_US) == "auto"
    expected = (chosen if any(chosen.values()) and not ours
                else {**chosen, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"})
    assert group.env(list(CPU_WAIT_VARS)) == [expected] * 2
    # MKL's AVX2 code path on an x86 CPU that is not Intel's (utils/cpu_blas.py), unless the user chose one
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    vendor = next((line.split(":")[1].strip() for line in info.splitlines() if line.startswith("vendor_id")), None)
    flags = next((set(line.split(":")[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    branch = os.environ.get("MKL_CBWR") or (
        "AVX2" if vendor not in (None, "GenuineIntel") and {"avx2", "fma"} <= flags else None)
    assert group.env(["MKL_CBWR"]) == [{"MKL_CBWR": branch}] * 2
    assert group.execute_all("get_node_info")[1]["pid"] == infos[1]["pid"]
    assert group.execute_rank_zero("get_node_info")["pid"] == infos[0]["pid"]


def test_one_to_all_and_rank_zero(group):
    assert group.tagged("hi") == [("hi", 0), ("hi", 1)]
    rank, pid = group.whoami()
    assert rank == 0 and pid == group.node_infos[0]["pid"]


def test_dp_compute_proto_with_padding(group):
    # 5 rows on 2 ranks -> padded to 6: rank 0 gets x=[0,1,2], rank 1 gets x=[3,4,0(pad)]
    out = group.scale_plus_rank(make(5))
    assert out.batch["y"].tolist() == [0, 10, 20, 31, 41]
    assert out.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4"]
    assert out.meta_info == {"temperature": 0.7}


def test_dp_compute_proto_k_outputs_per_input(group):
    out = group.expand(make(5), k=3)  # non-DataProto argument: broadcast
    assert out.batch["y"].tolist() == [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32, 40, 41, 42]
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(5) for _ in range(3)]


def test_dp_compute_proto_metrics_only(group):
    out = group.rows_seen(make(5))
    assert len(out) == 0
    assert out.meta_info["metrics"] == {"rows": [3, 3], "rank": [0, 1]}


def test_dp_compute_proto_with_func(group):
    out = group.apply(lambda t: t * t + 1, make(5))  # the function is shipped to both ranks
    assert out.batch["y"].tolist() == [1, 2, 5, 10, 17]
