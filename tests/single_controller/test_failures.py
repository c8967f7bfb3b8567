"""Failures surface as errors naming the rank, node and method, within a bounded time."""

import time

import pytest
from single_controller_workers import BrokenInitWorker, FragileWorker

from verl_arpo.single_controller.ray import (
    PendingCall,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    WorkerGroupError,
    WorkerGroupTimeoutError,
)


@pytest.fixture
def fragile(ray_session):
    pool = RayResourcePool([2], cpus_per_bundle=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(FragileWorker), name_prefix="fragile")
    yield wg
    wg.shutdown()
    pool.remove()


def test_exception_timeout_and_death(fragile):
    ip = fragile.node_infos[1]["ip"]

    # 0. a non-blocking method returns at once; .get() collects
    pending = fragile.nap_later(0.2)
    assert isinstance(pending, PendingCall) and pending.get(timeout=30) == [0, 1]

    # 1. an exception in the method keeps its type and gains a note naming rank and method
    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        fragile.raise_on(1)
    assert any("FragileWorker.raise_on" in n and "rank 1" in n for n in info.value.__notes__)
    assert fragile.nap(0) == [0, 1]  # the group is still usable

    # 2. a bounded wait: the call takes 1.5 s, the group allows 0.3 s
    fragile.call_timeout = 0.3
    start = time.monotonic()
    with pytest.raises(WorkerGroupTimeoutError, match="FragileWorker.nap did not finish within 0.3s") as info:
        fragile.nap(1.5)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, RuntimeError)
    assert time.monotonic() - start < 1.2
    fragile.call_timeout = None

    # 3. rank 1 dies (os._exit) while rank 0 would sleep for a minute: reported at once, no hang
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        fragile.crash_on(1, 60.0)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert isinstance(info.value, WorkerGroupError)
    assert "rank 1" in message and f"node {ip}" in message and "FragileWorker.crash_on" in message and "died" in message
    assert elapsed < 20, elapsed


def test_constructor_failure_names_the_rank(ray_session):
    pool = RayResourcePool([2], cpus_per_bundle=0.5)
    try:
        with pytest.raises(WorkerGroupError, match=r"rank 1 .*died during BrokenInitWorker.get_node_info.*no model at /nonexistent"):
            RayWorkerGroup(pool, RayClassWithInitArgs(BrokenInitWorker), init_timeout=60)
    finally:
        pool.remove()
