"""Session fixtures: one Ray instance (4 logical CPUs on this 2-core machine; actors ask for
0.5 CPU), one shared 2-bundle pool that admits two groups, and one 2-rank ``ToyWorker`` group.
Everything is shut down at the end; a Ray instance started by someone else is reused and left
running."""

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    import single_controller_workers

    # The test workers live in a module only this pytest process can import: ship them by value.
    ray.cloudpickle.register_pickle_by_value(single_controller_workers)
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def shared_pool(ray_session):
    """Two bundles of 1 CPU on one node; up to two groups (0.5 CPU per actor)."""
    from verl_arpo.single_controller.ray import RayResourcePool

    pool = RayResourcePool([2], use_gpu=False, cpus_per_bundle=1, max_colocate_count=2, name_prefix="shared")
    yield pool
    pool.remove()


@pytest.fixture(scope="session")
def toy_group(shared_pool):
    from single_controller_workers import ToyWorker

    from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    wg = RayWorkerGroup(shared_pool, RayClassWithInitArgs(ToyWorker, scale=10), name_prefix="toy", call_timeout=120)
    yield wg
    wg.shutdown()
