"""Issue 51, item 2: a cluster too small for the configured workers stops within seconds, before
any model loads, with one line naming trainer.n_gpus_per_node / trainer.nnodes, what the cluster
has and the fix (exit code 2, as every config refusal), instead of waiting out the 120 s
reservation and ending in a traceback."""
import subprocess
import sys
import time

import pytest
from rel_helpers import write_tool_task
from test_faults_training import NO_CLUSTER, ROOT, _cmd, _env


def test_a_pool_the_cluster_can_never_hold_is_refused_at_once(ray_local):
    from verl_arpo.single_controller.ray.resource_pool import ClusterTooSmallError, RayResourcePool

    t0 = time.monotonic()
    with pytest.raises(ClusterTooSmallError) as err:
        RayResourcePool([64], cpus_per_bundle=1.0).get_placement_groups()   # 64 CPUs on an 8-CPU node
    assert time.monotonic() - t0 < 10
    assert err.value.per_node == {"CPU": 64.0} and err.value.nodes_needed == 1
    assert err.value.nodes and all(n["CPU"] < 64 for n in err.value.nodes)
    RayResourcePool([2], cpus_per_bundle=1.0).check_capacity()   # one that fits passes (busy or not)


def test_eight_workers_on_a_two_cpu_cluster_stop_in_seconds_naming_the_keys(tiny_model_dir, tmp_path):
    (tmp_path / "data").mkdir()
    data = write_tool_task(tmp_path / "data", rows=4)
    cmd = [a if a != "data.train_batch_size=2" else "data.train_batch_size=4"    # batches that split over 8 workers
           for a in _cmd(tiny_model_dir, data, tmp_path / "out", "trainer.n_gpus_per_node=8", "ray_init.num_cpus=2",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=4")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = err[-1]
    assert "trainer.n_gpus_per_node=8 x trainer.nnodes=1" in last and "--config-name=cpu_tiny" in last, last
    assert "'CPU': 2.0" in last and "Traceback" not in proc.stderr
    assert took < 100, took          # the reservation's own timeout is 120 s
    assert "Loading weights" not in proc.stdout + proc.stderr   # no model was loaded


def test_run_refusals_have_their_own_exit_codes():
    """[issue 51, item 3] each refusal at run time maps to one exit code; other failures keep their traceback."""
    from verl_arpo.single_controller.ray.base import WorkerGroupTimeoutError
    from verl_arpo.trainer.main_ppo import run_refusal
    from verl_arpo.trainer.ppo.run_directory import DifferentRunError
    from verl_arpo.utils.checkpoint.integrity import RunDirLockedError

    assert run_refusal(RunDirLockedError("x"))[0] == 3
    assert run_refusal(DifferentRunError("x"))[0] == 4
    code, advice = run_refusal(WorkerGroupTimeoutError("update_actor did not finish within 5s on rank 1"))
    assert code == 5 and "trainer.worker_call_timeout" in advice and "resume_mode=auto" in advice
    assert run_refusal(RuntimeError("a bug")) is None and run_refusal(KeyError("k")) is None


def test_a_locked_run_directory_is_one_line_and_exit_3(tiny_model_dir, tmp_path):
    from test_faults_training import _lock_holder

    (tmp_path / "data").mkdir()
    data = write_tool_task(tmp_path / "data", rows=4)
    out = tmp_path / "out"
    out.mkdir()
    holder = _lock_holder(out)
    try:
        # NO_CLUSTER: an unreachable Ray address, never tried when the lock is checked first
        proc = subprocess.run(_cmd(tiny_model_dir, data, out, NO_CLUSTER), cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=300)
        full = subprocess.run(_cmd(tiny_model_dir, data, out, NO_CLUSTER), cwd=ROOT,
                              env={**_env(), "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[verl_arpo] another run is using trainer.default_local_dir=") and last.endswith("(exit 3)")
    assert f"pid {holder.pid}" in last and "Traceback" not in proc.stderr
    assert full.returncode != 0 and "Traceback" in full.stderr and "RunDirLockedError" in full.stderr
