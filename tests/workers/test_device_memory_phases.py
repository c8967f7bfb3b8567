"""Device memory per worker phase (CUDA only, so read through a stand-in for the driver's counter):
each top-level phase reports the device bytes in use at its first entry and its last exit
(perf/gpu_memory_{entry,exit}_gb/<phase>); micro-batch phases ("update/forward") are not read, since
every reading synchronises the device."""
from verl_arpo.workers import host_memory
from verl_arpo.workers.host_memory import HostMemoryPhases


def test_entry_and_exit_of_each_top_level_phase(monkeypatch):
    readings = iter([1, 2, 3, 4, 5, 6])  # GiB, in the order the phases read them
    monkeypatch.setattr(host_memory, "_device_used", lambda: next(readings) * 2**30)
    mem = HostMemoryPhases()
    with mem.phase("rollout"):       # reads 1 (entry) and 2 (exit)
        pass
    with mem.phase("update"):        # reads 3 ...
        with mem.phase("update/forward"):  # not read
            pass
    with mem.phase("update"):        # ... a second span reads 4 and 5: the first entry, the last exit stay
        pass                         # (the first span's exit read 4, the second's entry 5, its exit 6)
    m = mem.metrics()
    gpu = {k: v for k, v in m.items() if k.startswith("perf/gpu_memory_")}
    assert gpu == {"perf/gpu_memory_entry_gb/rollout": 1.0, "perf/gpu_memory_exit_gb/rollout": 2.0,
                   "perf/gpu_memory_entry_gb/update": 3.0, "perf/gpu_memory_exit_gb/update": 6.0}
    assert not any(k.startswith("perf/gpu_memory_") for k in mem.metrics())  # handed out once


def test_no_device_readings_off_cuda():
    mem = HostMemoryPhases()
    with mem.phase("rollout"):
        pass
    assert host_memory._device_used() is None
    assert not any(k.startswith("perf/gpu_memory_") for k in mem.metrics())
