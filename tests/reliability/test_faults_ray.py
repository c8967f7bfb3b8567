"""A Ray worker killed in the middle of a training step: the driver must fail fast (no hang) with
an error naming the dead worker (rank, node, pid) and the last complete checkpoint, and a restart
with resume_mode=auto must continue from that checkpoint.

The trainer runs in-process (`run_ppo`, the shared `ray_local` cluster, 2 ActorRolloutRefWorker
processes). During step 2 a thread SIGKILLs rank 1's process (its pid comes from the worker
group's node infos), either while the group generates (rollout) or while it updates the actor
(FSDP2 gloo collectives: rank 0 is then blocked on a peer that no longer exists).

Extends tests/single_controller/test_failures.py (a toy worker group) and tests/trainer/test_e2e.py
(the *driver* SIGKILLed between steps) to a worker dying inside a real step.
"""
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from rel_helpers import write_tool_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_tool_task(tmp_path_factory.mktemp("toy_data"), rows=6, valid_rows=2)


def _config(model_dir, data_dir, out_dir):
    from hydra import compose, initialize_config_dir

    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
                 f"data.val_files={data_dir}/valid.parquet", f"trainer.default_local_dir={out_dir}",
                 "data.max_prompt_length=64", "data.max_response_length=64", "trainer.logger=[jsonl]",
                 "trainer.total_training_steps=3", "trainer.save_freq=1",
                 "actor_rollout_ref.rollout.tools.call_limit=2",
                 f"actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file={out_dir}/search.sqlite"]
    from verl_arpo.trainer.config import validate_config

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return validate_config(compose(config_name="cpu_tiny", overrides=overrides))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
# the kill follows the call's submission by 20 ms: each of these calls takes longer than that even
# with the tiny model (a longer fixed delay sometimes landed in the *next* call on an idle machine)
@pytest.mark.parametrize("phase", ["generate_sequences", "update_actor", "save_checkpoint"])
def test_worker_killed_mid_step_fails_fast_naming_worker_and_checkpoint_then_resumes(
        phase, ray_local, tool_model_dir, toy_data, tmp_path, monkeypatch, capsys):
    from verl_arpo.trainer.ppo.ray_trainer import RayPPOTrainer, run_ppo

    cfg = _config(tool_model_dir, toy_data, tmp_path / "run")
    killed = {}
    original_step = RayPPOTrainer.train_step

    def train_step(self, step):
        """At step 2, SIGKILL rank 1 right after the group method `phase` is called (the patch
        stays on the group, so `save_checkpoint`, which fit() calls after train_step, is caught too)."""
        if step == 2:
            wg = self.actor_rollout_wg
            method = getattr(wg, phase)

            def with_kill(*args, **kwargs):
                info = wg.node_infos[1]

                def kill():
                    time.sleep(0.02)
                    killed.update(pid=info["pid"], ip=info["ip"], rank0=wg.node_infos[0]["pid"], t=time.monotonic())
                    os.kill(info["pid"], signal.SIGKILL)

                threading.Thread(target=kill, daemon=True).start()
                return method(*args, **kwargs)

            monkeypatch.setattr(wg, phase, with_kill)
        return original_step(self, step)

    monkeypatch.setattr(RayPPOTrainer, "train_step", train_step)
    with pytest.raises(RuntimeError) as info:
        run_ppo(cfg)
    waited = time.monotonic() - killed["t"]
    with capsys.disabled():
        print(f"[{phase}] the driver raised {waited:.1f} s after the kill")
    assert waited < 60, f"the driver took {waited:.0f} s to notice the dead worker"
    message = str(info.value)
    ckpt = str(tmp_path / "run" / "global_step_1")
    assert f"rank 1 (node {killed['ip']}, pid {killed['pid']})" in message and "died" in message, message
    assert f"ActorRolloutRefWorker.{phase}" in message, message
    assert f"training stopped at step 2; last complete checkpoint: {ckpt}" in message, message
    assert "trainer.resume_mode=auto" in message
    # the surviving rank (blocked in a collective, for update_actor) is not left running
    deadline = time.monotonic() + 30
    while _alive(killed["rank0"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(killed["rank0"])
    # nothing of step 2 was published: step 1 stays the checkpoint a restart uses
    run = tmp_path / "run"
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in run.iterdir() if "step" in p.name) == ["global_step_1"]  # no .partial left

    if phase != "update_actor":
        return
    # restart the same command: it resumes from step 1 and finishes the run
    monkeypatch.setattr(RayPPOTrainer, "train_step", original_step)
    capsys.readouterr()
    run_ppo(cfg)
    assert f"resumed from {ckpt} (step 1)" in capsys.readouterr().out
    lines = (tmp_path / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [1, 2, 3]
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
