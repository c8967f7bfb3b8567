"""Parts that need no Ray actors: Worker environment handling, pool shapes and node choice,
worker-group argument checks."""

import socket

import pytest
import torch.distributed as dist

from verl_arpo.single_controller.base import Worker, ephemeral_port_range, find_free_port
from verl_arpo.single_controller.decorator import Dispatch, register
from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_arpo.single_controller.ray import resource_pool as rp
from verl_arpo.utils.device import get_device_name, get_dist_backend

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_worker_reads_environment(clean_env):
    w = Worker()
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.master_addr, w.master_port) == (0, 1, 0, 1, None, None)
    for name, value in zip(ENV, ("3", "4", "1", "2", "10.0.0.1", "29500")):
        clean_env.setenv(name, value)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.master_addr, w.master_port) == (3, 4, 1, 2, "10.0.0.1", 29500)
    info = w.get_node_info()
    assert info["rank"] == 3 and info["hostname"] == socket.gethostname() and isinstance(info["pid"], int)
    clean_env.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        w.rank


def test_worker_process_group_outside_ray(clean_env):
    w = Worker()
    with pytest.raises(RuntimeError, match="MASTER_ADDR/MASTER_PORT are not set"):
        w.init_process_group()
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    port = find_free_port("127.0.0.1")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    try:
        w.init_process_group(timeout_seconds=30)
        w.init_process_group()  # idempotent
        assert dist.get_backend() == get_dist_backend() == "gloo" and get_device_name() == "cpu"
        assert dist.get_world_size() == 1
    finally:
        w.destroy_process_group()
    assert not dist.is_initialized()


def test_pool_shape_and_validation():
    pool = RayResourcePool([2, 3], use_gpu=True, cpus_per_bundle=2)
    assert pool.world_size == 5 and pool.store == [2, 3]
    assert pool.local_rank_list() == [0, 1, 0, 1, 2]
    assert pool.local_world_size_list() == [2, 2, 3, 3, 3]
    assert pool.bundle() == {"CPU": 2.0, "GPU": 1.0}
    assert RayResourcePool([1]).bundle() == {"CPU": 1.0}
    for bad in ([], [0], [2, -1]):
        with pytest.raises(ValueError, match="process_on_nodes"):
            RayResourcePool(bad)
    with pytest.raises(ValueError, match="max_colocate_count"):
        RayResourcePool([1], max_colocate_count=0)


def fake_cluster(monkeypatch, nodes, driver="a"):
    monkeypatch.setattr(rp.ray, "nodes", lambda: nodes)

    class Ctx:
        def get_node_id(self):
            return driver

    monkeypatch.setattr(rp.ray, "get_runtime_context", lambda: Ctx())


def node(node_id, ip, cpu, gpu=0, alive=True):
    res = {"CPU": float(cpu)}
    if gpu:
        res["GPU"] = float(gpu)
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Resources": res, "Alive": alive}


def test_pick_nodes_spreads_driver_first(monkeypatch):
    fake_cluster(monkeypatch, [node("c", "10.0.0.1", 8), node("b", "10.0.0.3", 8), node("a", "10.0.0.9", 8)])
    assert RayResourcePool([2, 2])._pick_nodes() == ["a", "c"]  # driver's node, then by IP
    assert RayResourcePool([1, 1, 1])._pick_nodes() == ["a", "c", "b"]
    assert RayResourcePool([4])._pick_nodes() == [None]  # one entry: let Ray choose
    assert RayResourcePool([1, 1], spread_nodes=False)._pick_nodes() == [None, None]


def test_pick_nodes_skips_small_dead_and_gpu_less_nodes(monkeypatch, caplog):
    fake_cluster(monkeypatch, [node("a", "10.0.0.1", 1), node("b", "10.0.0.2", 4), node("c", "10.0.0.3", 4, alive=False),
                               node("d", "10.0.0.4", 4, gpu=2)])
    assert RayResourcePool([2, 2])._pick_nodes() == ["b", "d"]
    assert RayResourcePool([2, 2], use_gpu=True)._pick_nodes() == [None, None]  # only one GPU node
    assert "may share a node" in caplog.text


def test_pool_needs_ray(monkeypatch):
    monkeypatch.setattr(rp.ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="call ray.init"):
        RayResourcePool([1]).get_placement_groups()


class Clashing(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self):
        return None


def test_worker_group_argument_checks():
    with pytest.raises(TypeError, match="subclass of verl_arpo.single_controller.base.Worker"):
        RayClassWithInitArgs(dict)
    pool = RayResourcePool([1])  # never reserved: every check below fails before Ray is touched
    with pytest.raises(ValueError, match=r"env_vars cannot set \['RANK'\]"):
        RayWorkerGroup(pool, RayClassWithInitArgs(Worker), env_vars={"RANK": "3"})
    with pytest.raises(ValueError, match="does not fit"):
        RayWorkerGroup(pool, RayClassWithInitArgs(Worker), num_cpus_per_worker=2)
    with pytest.raises(ValueError, match="cannot shadow RayWorkerGroup.shutdown"):
        RayWorkerGroup(pool, RayClassWithInitArgs(Clashing))


def test_find_free_port_avoids_the_ephemeral_range():
    """The rendezvous port is drawn below the range the kernel hands to outgoing connections (one of
    those took a probed port before rank 0 listened on it: EADDRINUSE in CI), and it can be bound."""
    low, high = ephemeral_port_range()
    assert 1024 <= low <= high
    ports = {find_free_port("127.0.0.1") for _ in range(20)}
    if low - 20000 >= 64:
        assert all(20000 <= p < low for p in ports)
        assert len(ports) > 1                       # drawn, not a fixed port
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_find_free_port_skips_a_port_in_use(monkeypatch):
    """A port something listens on is never returned: with the band shrunk to 64 ports, all but one
    of them taken, every draw returns the free one or falls back to an OS-picked port."""
    low, _ = ephemeral_port_range()
    base = find_free_port("127.0.0.1")
    if not 20000 <= base < low - 64:
        pytest.skip("no band below the ephemeral range on this host")
    holders = []
    for port in range(base, base + 64):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            holders.append(s)
        except OSError:
            s.close()
    try:
        monkeypatch.setattr("verl_arpo.single_controller.base._FIRST_PORT", base)
        monkeypatch.setattr("verl_arpo.single_controller.base.ephemeral_port_range", lambda: (base + 64, 60999))
        held = {h.getsockname()[1] for h in holders}
        for _ in range(10):
            assert find_free_port("127.0.0.1") not in held
    finally:
        for h in holders:
            h.close()
