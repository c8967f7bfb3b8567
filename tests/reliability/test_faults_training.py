"""Preemption and resuming the right thing, with the real entry point (`python -m
verl_arpo.trainer.main_ppo --config-name=cpu_tiny`, its own Ray cluster, 2 CPU workers):

- SIGTERM during a step: the step finishes, is checkpointed, the run exits 143; the resumed run's
  metrics equal an uninterrupted run's, step by step, and it continues the same wandb run;
- SIGTERM with a grace period too short for the step: the process exits 143 within the grace, and
  the last complete checkpoint stays the one resume uses;
- a damaged newest checkpoint: resume falls back to the previous one with a warning;
- a second run on a directory in use stops at start-up; a run with another model, data or
  algorithm refuses to resume (trainer.force_resume overrides).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rel_helpers import write_tool_task

ROOT = Path(__file__).resolve().parents[2]
# metrics that depend on wall time or on what a cache already held, not on the training itself
_VOLATILE = ("timing", "time_", "perf/", "throughput", "memory", "cache_", "/calls_per_s", "abandoned")

# a Ray address where no cluster listens: a run that got as far as joining its cluster would fail
# there, so a refusal made with it set came before any cluster or worker started
NO_CLUSTER = "ray_init.address=127.0.0.1:9"


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_tool_task(tmp_path_factory.mktemp("toy_data"), rows=8)


def _cmd(model_dir, data_dir, out_dir, *extra):
    return [sys.executable, "-m", "verl_arpo.trainer.main_ppo", "--config-name=cpu_tiny",
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
            "data.val_files=null", "trainer.val_before_train=false", "trainer.test_freq=-1",
            f"trainer.default_local_dir={out_dir}", "data.max_prompt_length=64", "data.max_response_length=64",
            "data.train_batch_size=2", "trainer.logger=[console,jsonl]", "trainer.total_training_steps=4",
            "trainer.save_freq=100", "actor_rollout_ref.rollout.tools.call_limit=2",
            f"actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file={out_dir}/search.sqlite",
            f"hydra.run.dir={out_dir}/hydra", *extra]


def _env():
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


def _metrics(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not any(s in k for s in _VOLATILE)} for r in rows}


def _run_until(cmd, log, pattern, then):
    """Start `cmd`; when its output shows `pattern`, call `then(proc)`; return (exit code, output)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while proc.poll() is None and pattern not in Path(log).read_text():
            assert time.monotonic() < deadline, Path(log).read_text()[-3000:]
            time.sleep(0.05)
        if proc.poll() is None:
            then(proc)
        rc = proc.wait(timeout=600)
    return rc, Path(log).read_text()


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_in_flight_and_the_resumed_run_matches(tool_model_dir, toy_data, tmp_path):
    ref, cut = tmp_path / "reference", tmp_path / "preempted"
    r = subprocess.run(_cmd(tool_model_dir, toy_data, ref), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sent = {}

    def sigterm(proc):
        sent["t"] = time.monotonic()
        proc.send_signal(signal.SIGTERM)

    # step 1 is logged: step 2 is in flight when the signal arrives
    wandb = "trainer.logger=[console,jsonl,wandb]"
    rc, out = _run_until(_cmd(tool_model_dir, toy_data, cut, "trainer.preemption_grace_s=300", wandb),
                         tmp_path / "cut.log", "step 1/4", sigterm)
    assert rc == 143, out[-3000:]
    assert "SIGTERM: finishing the step in flight" in out and "preempted (SIGTERM) after step 2" in out
    assert (cut / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(_metrics(cut)) == [1, 2]
    r = subprocess.run(_cmd(tool_model_dir, toy_data, cut, wandb), cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {cut / 'global_step_2'} (step 2)" in r.stdout
    # the resumed run continued the same wandb run (its id was stored in the checkpoint)
    runs = sorted((cut / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.rsplit("-", 1)[1] for p in runs}) == 1, runs
    got, want = _metrics(cut), _metrics(ref)
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == want[step], (step, {k: (got[step].get(k), v) for k, v in want[step].items()
                                                if got[step].get(k) != v})


@pytest.mark.slow
def test_sigterm_to_the_process_group_as_timeout_sends_it_gives_the_same_run(tool_model_dir, toy_data, tmp_path):
    """[issue 34, item 2] `timeout -s TERM`, shell job control and Slurm signal every process of the
    job, not the driver alone. The local Ray cluster lives in its own session, so the step in flight
    still finishes, is checkpointed, the run exits 143, and the resumed run equals a run never cut."""
    ref, cut = tmp_path / "reference", tmp_path / "preempted"
    r = subprocess.run(_cmd(tool_model_dir, toy_data, ref), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # `timeout` runs the command in its own process group; sent SIGTERM itself (as at expiry), it
    # passes the signal on to the command and then to its whole group: kill(0, SIGTERM)
    cmd = ["timeout", "-s", "TERM", "900", *_cmd(tool_model_dir, toy_data, cut, "trainer.preemption_grace_s=300")]
    rc, out = _run_until(cmd, tmp_path / "cut.log", "step 1/4", lambda proc: proc.send_signal(signal.SIGTERM))
    assert rc == 143, out[-3000:]
    assert "preempted (SIGTERM) after step 2" in out, out[-3000:]
    assert (cut / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    r = subprocess.run(_cmd(tool_model_dir, toy_data, cut), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got, want = _metrics(cut), _metrics(ref)
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        # the rollout engine's own entropies after a resume can move in the 8th digit (fp32 rounding;
        # the same happens with SIGTERM to the pid): everything else is equal to the bit
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-8), step
        exact = [k for k in want[step] if not k.startswith(("rollout/entropy", "mismatch/"))]
        assert {k: got[step][k] for k in exact} == {k: want[step][k] for k in exact}, step


@pytest.mark.slow
def test_sigterm_with_a_short_grace_exits_in_time_keeping_the_last_checkpoint(tool_model_dir, toy_data, tmp_path):
    run = tmp_path / "run"
    sent = {}

    def sigterm(proc):
        sent["t"] = time.monotonic()
        proc.send_signal(signal.SIGTERM)

    # checkpoints at steps 1 and 2; the signal lands in step 3 with 1 s of grace, while a scorer that
    # takes 0.5 s per trajectory (4 s per step) keeps the step from finishing in time
    slow = tmp_path / "slow_reward.py"
    slow.write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    time.sleep(0.5)\n    return 0.0\n")
    rc, out = _run_until(_cmd(tool_model_dir, toy_data, run, "trainer.save_freq=1", "trainer.preemption_grace_s=1",
                              f"custom_reward_function.path={slow}"),
                         tmp_path / "run.log", "step 2/4", sigterm)
    took = time.monotonic() - sent["t"]
    assert rc == 143 and took < 15, (rc, took, out[-3000:])
    assert "grace period of 1 s is over" in out
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    from verl_arpo.utils.checkpoint import find_resumable_checkpoint

    assert find_resumable_checkpoint(str(run)) == str(run / "global_step_2")


def _two_checkpoints(model_dir, data_dir, run):
    r = subprocess.run(_cmd(model_dir, data_dir, run, "trainer.save_freq=1", "trainer.total_training_steps=2"),
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def finished_run(tool_model_dir, toy_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("two_ckpts") / "run"
    _two_checkpoints(tool_model_dir, toy_data, run)
    return run


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, caplog):
    import shutil

    from verl_arpo.utils.checkpoint import find_latest_ckpt_path, find_resumable_checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shard = next((run / "global_step_2" / "actor" / "model").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the middle of the weights: same size
    shard.write_bytes(bytes(data))
    assert find_latest_ckpt_path(str(run)) == str(run / "global_step_2")  # the marker alone says "complete"
    with caplog.at_level("WARNING"):
        assert find_resumable_checkpoint(str(run)) == str(run / "global_step_1")
    assert "global_step_2 is damaged" in caplog.text and "checksum mismatch" in caplog.text
    (run / "global_step_1" / "data.pt").write_bytes(b"")  # truncated: a size mismatch
    with caplog.at_level("WARNING"):
        assert find_resumable_checkpoint(str(run)) is None
    assert "data.pt: 0 bytes, expected" in caplog.text


def _lock_holder(directory) -> subprocess.Popen:
    """Another process holding the run lock of `directory` (until it is killed)."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from verl_arpo.utils.checkpoint.integrity import RunDirLock\n"
                               f"RunDirLock({str(directory)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_one_directory_one_run(tmp_path):
    """A second run on a directory in use stops at once, naming the holder; the lock dies with
    its process (even SIGKILLed)."""
    from verl_arpo.utils.checkpoint.integrity import RunDirLock, RunDirLockedError

    holder = _lock_holder(tmp_path)
    try:
        with pytest.raises(RunDirLockedError, match=rf"pid {holder.pid} on .*default_local_dir"):
            RunDirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunDirLock(str(tmp_path)):  # the killed holder released it
        pass


def test_a_changed_run_refuses_to_resume_unless_forced(finished_run, tool_model_dir, toy_data, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    changed = _cmd(tool_model_dir, toy_data, run, "trainer.total_training_steps=3",
                   "algorithm.adv_estimator=rloo")
    # refused before any cluster starts: an unreachable ray_init.address is never tried
    r = subprocess.run(changed + [NO_CLUSTER], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 4, r.stderr[-3000:]   # [issue 51] a refusal: one line, its own exit code
    assert "Traceback" not in r.stderr and "Error executing job" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("[verl_arpo] checkpoint ")
    err = r.stdout + r.stderr
    assert "belongs to a different run" in err and "algorithm.adv_estimator: was 'grpo', now 'rloo'" in err
    assert "trainer.force_resume=true" in err
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # nothing was trained
    r = subprocess.run(changed + ["trainer.force_resume=true"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {run / 'global_step_2'} (step 2)" in r.stdout


def test_a_finished_run_says_so_instead_of_finishing_silently(finished_run, tool_model_dir, toy_data, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    r = subprocess.run(_cmd(tool_model_dir, toy_data, run, "trainer.total_training_steps=2"), cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "is already complete (step 2 >= total_training_steps=2): nothing to train" in r.stdout


def test_the_fingerprint_sees_a_same_size_change_anywhere_in_a_weight_file(tmp_path):
    """[issue 34, item 4] Only the first MiB of each weight file was hashed: a same-size fine-tune with
    frozen embeddings, swapped into the folder, resumed silently. Whole files count now; a fingerprint
    written before (no crc32) still compares equal to an unchanged model."""
    from verl_arpo.utils.checkpoint.integrity import fingerprint_differences, run_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    weights = bytearray(range(256)) * (3 * 4096 * 4)   # 12 MiB
    (model / "model.safetensors").write_bytes(bytes(weights))
    (model / "config.json").write_text("{}")
    config = {"actor_rollout_ref": {"model": {"path": str(model)}}, "data": {"train_files": []}}
    before = run_fingerprint(config)
    weights[8 << 20] ^= 0xFF          # one byte at 8 MiB, past the old 1 MiB head; same size
    (model / "model.safetensors").write_bytes(bytes(weights))
    after = run_fingerprint(config)
    assert before["model"]["weights"][0]["size"] == after["model"]["weights"][0]["size"]
    assert before["model"]["weights"][0]["head"] == after["model"]["weights"][0]["head"]
    assert [d for d in fingerprint_differences(before, after) if d.startswith("model:")]
    older = json.loads(json.dumps(after))
    for record in older["model"]["weights"]:
        record.pop("crc32")
    assert fingerprint_differences(older, after) == []


def test_a_resume_path_without_its_completeness_marker_is_refused(finished_run, tool_model_dir, toy_data, tmp_path):
    """[issue 34, item 4] A resume_path without checkpoint_complete.json (a save cut short) loaded
    unverified; it is refused now, naming the marker, and nothing trains."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "global_step_2" / "checkpoint_complete.json").unlink()
    r = subprocess.run(_cmd(tool_model_dir, toy_data, run, "trainer.total_training_steps=3",
                            "trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / 'global_step_2'}",
                            NO_CLUSTER),
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode != 0
    assert "has no checkpoint_complete.json" in r.stdout + r.stderr   # before the (absent) cluster was tried
    assert not (run / "global_step_3").exists()


def test_a_second_run_is_refused_before_its_workers_start(tool_model_dir, toy_data, tmp_path):
    """[issue 34, item 6] The run lock was taken in fit(), after every worker had loaded its model: a
    second run on a directory in use spent its whole start-up before it was refused. It is taken
    before the cluster now (main_ppo.run: RunDirectory.claim), so no worker ever reports its rank and
    an unreachable ray_init.address is never tried."""
    holder = _lock_holder(tmp_path)
    try:
        r = subprocess.run(_cmd(tool_model_dir, toy_data, tmp_path, NO_CLUSTER), cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=600)
    finally:
        holder.kill()
        holder.wait()
    out = r.stdout + r.stderr
    assert r.returncode != 0 and f"another run is using trainer.default_local_dir={tmp_path}" in out
    assert f"pid {holder.pid}" in out and "worker ranks on nodes" not in out
    assert r.returncode == 3   # the lock's refusal, not a failure to join the (absent) cluster


def test_the_consecutive_skip_count_is_checkpointed(finished_run):
    """[issue 34, item 6] The count that stops a run after max_consecutive_skipped_steps steps with
    only non-finite gradients restarted at 0 on resume; it is saved with each step and restored."""
    from verl_arpo.utils.checkpoint import load_dataloader_state

    logged = _metrics(finished_run)
    for step in (1, 2):
        state = load_dataloader_state(str(finished_run / f"global_step_{step}"))
        assert state["consecutive_skipped"] == logged[step]["training/consecutive_skipped_steps"]


def _job(model_dir, data_dir, run, *extra):
    """The typed config `_cmd` would make (composed and checked in this process)."""
    from hydra import compose, initialize_config_dir

    from verl_arpo.trainer.config import validate_config

    overrides = [a for a in _cmd(model_dir, data_dir, run, *extra)[4:] if not a.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return validate_config(compose(config_name="cpu_tiny", overrides=overrides))


def test_a_claim_answers_the_first_resume_point_and_a_refused_claim_frees_the_folder(
        finished_run, tool_model_dir, toy_data, tmp_path):
    """main_ppo.run claims the run directory before Ray starts: the lock and the checked resume point.
    The trainer's first resume_point() is the claim's answer; a refused claim (another run's
    checkpoint) leaves the folder unlocked, so the user's next, corrected run is not refused as
    'in use'."""
    import shutil

    from verl_arpo.trainer.ppo.run_directory import DifferentRunError, RunDirectory
    from verl_arpo.utils.checkpoint.integrity import RunDirLock, RunDirLockedError

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    changed = RunDirectory(_job(tool_model_dir, toy_data, run, "algorithm.adv_estimator=rloo"))
    with pytest.raises(DifferentRunError, match="algorithm.adv_estimator: was 'grpo', now 'rloo'"):
        changed.claim()
    with RunDirLock(str(run)):   # free again
        pass

    same = RunDirectory(_job(tool_model_dir, toy_data, run, "trainer.total_training_steps=3")).claim()
    try:
        with pytest.raises(RunDirLockedError):
            RunDirLock(str(run)).acquire()           # held from the claim on
        shutil.rmtree(run / "global_step_2")         # what a fresh look would see now
        assert same.resume_point() == str(run / "global_step_2")   # the claim's answer, once
        assert same.resume_point() == str(run / "global_step_1")   # then a fresh look
    finally:
        same.release_lock()
