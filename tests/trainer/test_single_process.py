"""trainer.single_process: the one worker in the driver's process, no Ray (docs/performance.md, "One
process on a laptop"). The same run as with one Ray worker: every metric that is not a time equal."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "single_controller"))
from test_e2e import _compose, _jsonl, _overrides, toy_data  # noqa: E402,F401 (toy_data: a fixture)

ONE_WORKER = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.initial_rollouts=2"]


def _comparable(metrics: dict) -> dict:
    """What does not depend on the clock or the process layout (times, rates, memory)."""
    return {k: v for k, v in metrics.items()
            if not any(s in k for s in ("time", "timing", "perf/", "memory", "_s/", "per_s"))}


def test_single_process_run_equals_a_one_worker_ray_run_and_never_imports_ray(ray_local, tool_model_dir, toy_data,
                                                                               tmp_path):
    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo

    single, ray_run = tmp_path / "single", tmp_path / "ray"
    # the command line, in a fresh process: trains without starting (or importing) Ray
    args = [f"{a}" for a in _overrides(tool_model_dir, toy_data, single, ONE_WORKER + ["trainer.single_process=true"])]
    probe = ("import atexit, os, runpy, sys\n"
             "atexit.register(lambda: print('ray imported:', 'ray' in sys.modules, flush=True))\n"
             "atexit.register(lambda: print('wait:', os.environ.get('VERL_ARPO_CPU_WAIT'),\n"
             "                                  os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), flush=True))\n"
             f"sys.argv = ['main_ppo', '--config-name=cpu_tiny', *{args!r}]\n"
             "runpy.run_module('verl_arpo.trainer.main_ppo', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "VERL_ARPO_CPU_WAIT")}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ray imported: False" in proc.stdout
    # this process computes: how its OpenMP threads wait was chosen before torch loaded (utils/threads.py)
    assert ("wait: auto PASSIVE None" in proc.stdout) != ("wait: auto None 3000" in proc.stdout)
    assert "in the driver's process: trainer.single_process" in proc.stdout

    # the same run with one Ray worker (a separate process), in this test's Ray
    run_ppo(validate_config(_compose(_overrides(tool_model_dir, toy_data, ray_run, ONE_WORKER))))
    a, b = _jsonl(single), _jsonl(ray_run)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["tools/calls"] > 0                       # the tools really ran in both
        assert _comparable(x) == _comparable(y)           # sampled tokens, rewards, losses, grad norms: identical


@pytest.mark.parametrize("extra, key", [
    (["trainer.n_gpus_per_node=2"], "trainer.single_process"),
    (["trainer.n_gpus_per_node=1", "trainer.nnodes=2"], "trainer.single_process"),
    (["trainer.n_gpus_per_node=1", "ray_init.address=127.0.0.1:6379"], "ray_init.address"),
    (["trainer.n_gpus_per_node=1", "ray_init.include_dashboard=true"], "ray_init.include_dashboard"),
    (["trainer.n_gpus_per_node=1", "+ray_init.runtime_env.working_dir=/tmp"], "ray_init.runtime_env"),
])
def test_settings_single_process_cannot_honour_are_refused_by_name(extra, key):
    from verl_arpo.config import ConfigError
    from verl_arpo.trainer.config import validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(_compose(["trainer.single_process=true", *extra]))
    assert key in str(err.value) and "single_process" in str(err.value)


def test_single_process_applies_ray_init_env_vars_and_num_cpus(tool_model_dir, toy_data, tmp_path, monkeypatch):
    """What a Ray worker gets from ray_init (runtime_env.env_vars, its CPU share as threads) the
    in-process worker gets too: no key of ray_init is accepted and then ignored."""
    import torch

    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import RayPPOTrainer

    monkeypatch.delenv("VERL_ARPO_PROBE", raising=False)
    cfg = validate_config(_compose(_overrides(tool_model_dir, toy_data, tmp_path, [
        "trainer.single_process=true", "trainer.n_gpus_per_node=1", "ray_init.num_cpus=1",
        "+ray_init.runtime_env.env_vars.VERL_ARPO_PROBE=seen"])))
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)   # only the group factory: no datasets, no model
    trainer.config, trainer.device = cfg, "cpu"
    threads = torch.get_num_threads()
    try:
        from single_controller_workers import ToyWorker

        group = trainer._local_group_factory()(ToyWorker, "probe")
        try:
            assert group.env(["VERL_ARPO_PROBE"]) == [{"VERL_ARPO_PROBE": "seen"}]
            assert torch.get_num_threads() == 1      # ray_init.num_cpus=1 caps the worker's share
        finally:
            group.shutdown()
    finally:
        torch.set_num_threads(threads)
