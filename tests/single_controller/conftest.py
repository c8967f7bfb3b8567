"""One Ray instance for the whole pytest session (4 logical CPUs on this 2-core machine: workers
ask for 0.5–1 CPU), shut down at the end. If another fixture already started Ray, it is reused
and left running."""

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
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 1024**2, log_to_driver=False)
        started = True
    yield ray
    if started:
        ray.shutdown()
