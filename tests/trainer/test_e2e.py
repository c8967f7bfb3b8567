"""End to end on CPU: 2 Ray worker processes (FSDP2 on gloo), the HF engine, real tools.

The policy is the tiny model over-fitted to call tools (conftest.tool_model_dir), so rollouts run
the sandbox and BM25 search for real. Covers GRPO, ARPO, AEPO (all three flags), the critic and
reference paths, SIGKILL + resume determinism, and merging a checkpoint to Hugging Face format.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]

ALGOS = {
    "grpo": ["actor_rollout_ref.actor.ppo_mini_batch_size=2"],  # one mini-batch: strictly on-policy
    "arpo": ["actor_rollout_ref.rollout.initial_rollouts=2", "trainer.val_before_train=true", "trainer.test_freq=2",
             "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
             "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
             "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.model.use_remove_padding=true"],
    "arpo_async": ["actor_rollout_ref.rollout.initial_rollouts=2", "actor_rollout_ref.rollout.mode=async_with_tool",
                   "trainer.val_before_train=true", "trainer.test_freq=2"],
    "aepo": ["actor_rollout_ref.rollout.initial_rollouts=2", "actor_rollout_ref.rollout.branch_rule=aepo",
             "actor_rollout_ref.rollout.enable_dynamic_rollouts=true",
             "actor_rollout_ref.actor.enable_entropy_balanced_clipping=true",
             "actor_rollout_ref.actor.enable_entropy_balanced_advantage=true"],
    "lora_kl": ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
                "actor_rollout_ref.actor.optim.lr=1e-2"],
    "gae_kl": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
               "actor_rollout_ref.actor.kl_loss_coef=0.01", "trainer.critic_warmup=0"],
}


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy_data")
    rows = [{"data_source": "arpo_toy_math", "prompt": [{"role": "user", "content": "What is 12 * 34?"}],
             "ability": "math", "reward_model": {"ground_truth": "408", "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(6)]
    pd.DataFrame(rows).to_parquet(d / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(d / "valid.parquet")
    return d


def _overrides(model_dir, data_dir, out_dir, extra=()):
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
            f"data.val_files={data_dir}/valid.parquet", f"trainer.default_local_dir={out_dir}",
            "data.max_prompt_length=64", "data.max_response_length=64", "trainer.logger=[jsonl]",
            "actor_rollout_ref.rollout.tools.call_limit=2", "actor_rollout_ref.rollout.seed=3",
            f"actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file={out_dir}/search.sqlite",
            *extra]


def _compose(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="cpu_tiny", overrides=overrides)


def _typed(overrides):
    """The typed config the trainer takes, built and checked once (as main_ppo does)."""
    from verl_arpo.trainer.config import validate_config

    return validate_config(_compose(overrides))


def _jsonl(out_dir):
    with open(Path(out_dir) / "logs" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


REQUIRED = ["critic/score/mean", "critic/advantages/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
            "response_length/mean", "timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/weight_sync", "perf/throughput", "rollout/tokens_generated",
            "tools/calls_per_traj"]


@pytest.mark.parametrize("algo", ["grpo", "arpo", "arpo_async", "aepo", pytest.param("lora_kl", marks=pytest.mark.slow),
                                  pytest.param("gae_kl", marks=pytest.mark.slow)])
def test_two_steps_each_algorithm(algo, ray_local, tool_model_dir, toy_data, tmp_path):
    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo

    cfg = validate_config(_compose(_overrides(tool_model_dir, toy_data, tmp_path, ALGOS[algo])))
    run_ppo(cfg)
    all_lines = _jsonl(tmp_path)
    lines = [m for m in all_lines if m["step"] > 0]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        for key in REQUIRED + (["critic/vf_loss", "critic/values/mean"] if algo == "gae_kl" else []):
            assert key in m, key
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, (int, float)))
        assert m["tools/calls"] > 0  # the over-fitted policy really called the sandbox / search
    for m in lines:  # on-policy (one mini-batch) the update's own forward replaces the old-log-prob pass
        assert ("timing_s/old_log_prob" in m) == (algo != "grpo"), algo
    if algo == "grpo":
        assert "timing_s/ref" not in lines[0]  # [fix] no reference forward without a KL weight
        assert lines[0].get("rollout/branches", 0) == 0
    if algo == "arpo":  # validation before training and at the last step, sampled n=2 → pass@k
        for m in (all_lines[0], lines[-1]):
            assert 0.0 <= m["val/arpo_toy_math/score/mean"] <= 1.0
            assert m["val/arpo_toy_math/pass@2"] >= m["val/arpo_toy_math/pass@1"]
    if algo in ("lora_kl", "gae_kl"):
        assert "timing_s/ref" in lines[0] and "actor/kl_loss" in lines[0]
    if algo == "aepo":
        assert lines[0]["rollout/pre_monitor_tool_calls"] > 0
    if algo == "arpo_async":  # no round barriers: the engine reports how busy it was
        assert all(0 < m["rollout/engine_busy_fraction"] <= 1 for m in lines)
        assert "val/arpo_toy_math/score/mean" in all_lines[0]


def _run_main(overrides, address, log_path):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "verl_arpo.trainer.main_ppo", "--config-name=cpu_tiny",
           f"ray_init.address={address}", *overrides]
    return subprocess.Popen(cmd, cwd=log_path.parent, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.slow
def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted_run(ray_local, tool_model_dir, toy_data, tmp_path):
    address = ray_local.get_runtime_context().gcs_address
    extra = ["trainer.total_training_steps=3", "trainer.save_freq=1", "actor_rollout_ref.rollout.initial_rollouts=2"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    p = _run_main(_overrides(tool_model_dir, toy_data, full, extra), address, tmp_path / "full.log")
    assert p.wait(timeout=600) == 0, (tmp_path / "full.log").read_text()[-3000:]

    p = _run_main(_overrides(tool_model_dir, toy_data, cut, extra), address, tmp_path / "cut.log")
    tracker = cut / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 600
    while time.time() < deadline and not (tracker.exists() and tracker.read_text().strip() == "2"):
        assert p.poll() is None, (tmp_path / "cut.log").read_text()[-3000:]
        time.sleep(0.2)
    p.send_signal(signal.SIGKILL)
    p.wait()
    p = _run_main(_overrides(tool_model_dir, toy_data, cut, extra), address, tmp_path / "resume.log")
    assert p.wait(timeout=600) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert "resumed from" in (tmp_path / "resume.log").read_text()

    def by_step(lines):
        return {m["step"]: m for m in lines}

    a, b = by_step(_jsonl(full)), by_step(_jsonl(cut))
    skip = ("timing_s/", "perf/", "tools/time", "timing")
    for key, value in a[3].items():
        # cache hit counts depend on what the killed run had already cached (results are identical)
        if key.startswith(skip) or "time" in key or "cache_" in key:
            continue
        assert b[3][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_merge_checkpoint_matches_trainer_model(ray_local, tool_model_dir, toy_data, tmp_path):
    """Train one step, save, merge to HF; the merged model's log-probs equal the live actor's."""
    from transformers import AutoModelForCausalLM

    from verl_arpo.trainer.ppo.ray_trainer import run_ppo
    from verl_arpo.utils.torch_functional import logprobs_from_logits

    secret = "svc-E2E-0123456789"  # a credential for the workers, kept out of Ray's logged runtime_env
    cfg = _typed(_overrides(tool_model_dir, toy_data, tmp_path / "run",
                            ["trainer.total_training_steps=1", "trainer.save_freq=1",
                             f"+ray_init.runtime_env.env_vars.E2E_SERVICE_TOKEN={secret}"]))
    _, trainer = run_ppo(cfg, keep_workers=True)
    try:
        import ray

        seen = ray.get([w.__ray_call__.remote(lambda self: os.environ.get("E2E_SERVICE_TOKEN"))
                        for w in trainer.actor_rollout_wg.workers])
        assert seen == [secret] * len(seen)  # every worker got it (by a method call) before init_model
        batch = trainer._collate(trainer.train_dataset, [0, 1])
        batch, _ = trainer._rollout(batch, step=99)
        live = trainer.actor_rollout_wg.compute_log_prob(batch).batch["old_log_probs"]
    finally:
        trainer.shutdown()
    assert not trainer.reward_fn.scoring.started   # the scoring processes stop with the trainer
    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, str(ROOT / "merge_ckpt" / "convert_verl_to_hf.py"), "--verl_checkpoint",
                        str(tmp_path / "run" / "global_step_1"), "--output_dir", str(hf_dir), "--model_type", "qwen2"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    b = batch.batch
    R = b["responses"].shape[-1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    lp = logprobs_from_logits(logits[:, -R - 1:-1], b["responses"])
    mask = b["response_mask"].bool()
    assert torch.allclose(lp[mask], live[mask], atol=1e-4)


def test_non_finite_updates_are_counted_and_stop_the_run(ray_local, tool_model_dir, toy_data, tmp_path, monkeypatch):
    """From step 2 on the advantages are NaN (what a broken estimator or reward would hand the
    workers): the real workers' loss and gradient norm are non-finite, the optimizer step is
    skipped, the counts are logged every step, and the run stops after
    trainer.max_consecutive_skipped_steps=2 in a row with an error saying why."""
    from verl_arpo.trainer.ppo import ray_trainer

    original = ray_trainer.compute_advantage

    def poisoned(batch, *args, **kwargs):
        original(batch, *args, **kwargs)
        if batch.meta_info["global_steps"] >= 2:
            batch.batch["advantages"] = torch.full_like(batch.batch["advantages"], float("nan"))

    monkeypatch.setattr(ray_trainer, "compute_advantage", poisoned)
    cfg = _typed(_overrides(tool_model_dir, toy_data, tmp_path, ["trainer.total_training_steps=4",
                                                                  "trainer.max_consecutive_skipped_steps=2",
                                                                  "trainer.val_before_train=false"]))
    with pytest.raises(RuntimeError, match=r"2 consecutive training steps had only non-finite gradient norms "
                                           r"\(trainer.max_consecutive_skipped_steps=2\)") as info:
        ray_trainer.run_ppo(cfg)
    assert "training stopped at step 3" in str(info.value)
    lines = [m for m in _jsonl(tmp_path) if m["step"] > 0]
    assert [m["step"] for m in lines] == [1, 2]  # step 3 raised before it was logged
    first, second = lines
    assert (first["training/skipped_step"], first["actor/skipped_optimizer_steps"]) == (0.0, 0.0)
    # cpu_tiny: 2 mini-batches per update, each its own optimizer step
    assert first["actor/optimizer_steps"] == 2.0 and first["actor/non_finite_losses"] == 0.0
    assert (second["training/skipped_step"], second["training/consecutive_skipped_steps"]) == (1.0, 1.0)
    assert second["actor/skipped_optimizer_steps"] == 2.0 and second["actor/non_finite_losses"] >= 2.0
    assert math.isnan(second["actor/grad_norm"])
    assert first["reward/non_finite_scores"] == 0.0


def test_a_worker_call_past_its_timeout_ends_the_run_naming_it(ray_local, tool_model_dir, toy_data, tmp_path):
    """trainer.worker_call_timeout reaches the worker groups (it used to be: wait forever): a call
    that takes longer ends in an error naming the method and the ranks."""
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo

    cfg = _typed(_overrides(tool_model_dir, toy_data, tmp_path, ["trainer.worker_call_timeout=0.01"]))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"init_model.* did not finish within 0.01s on rank"):
        run_ppo(cfg)
    assert time.monotonic() - t0 < 120


def test_save_freq_minus_one_never_saves_and_val_only_validates_the_last_checkpoint(ray_local, tool_model_dir, toy_data,
                                                                                     tmp_path):
    """[issue 33, item 3] trainer.save_freq=-1 means never save, as in verl; save_freq=N saves every N steps
    and at the end. trainer.val_only=true then validates the last checkpoint and stops."""
    from verl_arpo.trainer.ppo.ray_trainer import run_ppo

    never = _overrides(tool_model_dir, toy_data, tmp_path / "never", ["trainer.total_training_steps=1",
                                                                       "trainer.save_freq=-1", "trainer.val_before_train=false",
                                                                       "trainer.test_freq=-1"])
    run_ppo(_typed(never))
    assert not list((tmp_path / "never").glob("global_step_*"))
    assert not (tmp_path / "never" / "latest_checkpointed_iteration.txt").exists()
    base = _overrides(tool_model_dir, toy_data, tmp_path, ["trainer.total_training_steps=2", "trainer.save_freq=3",
                                                           "trainer.val_before_train=false", "trainer.test_freq=-1"])
    run_ppo(_typed(base))
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2"]   # the end, not step 3
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    metrics = run_ppo(_typed(base + ["trainer.val_only=true"]))
    assert "val/arpo_toy_math/score/mean" in metrics and not any(k.startswith("actor/") for k in metrics)
    lines = _jsonl(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 2]  # two training steps, then the validation at step 2
    assert "val/arpo_toy_math/score/mean" in lines[-1]


def test_validation_generations_are_logged_and_dumped(ray_local, tool_model_dir, toy_data, tmp_path, capsys):
    """[issue 33, item 3] verl's trainer.log_val_generations=N and trainer.validation_data_dir, read back
    from what the run wrote: every generation in <dir>/<step>.jsonl (their scores give the logged
    validation means again), and N of them — the same prompts at every validation — on the console,
    in logs/val_generations.jsonl and as tensorboard text."""
    from collections import defaultdict

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verl_arpo.trainer.ppo.ray_trainer import run_ppo

    val_dir = tmp_path / "val"
    run_ppo(_typed(_overrides(tool_model_dir, toy_data, tmp_path, [
        "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.val_before_train=true",
        "trainer.test_freq=1", "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "trainer.log_val_generations=3",
        f"trainer.validation_data_dir={val_dir}", "trainer.logger=[console,jsonl,tensorboard]"])))
    console = capsys.readouterr().out
    metrics = {m["step"]: m for m in _jsonl(tmp_path)}
    n_val = len(pd.read_parquet(Path(toy_data) / "valid.parquet"))
    dumped = {}
    for step in (0, 1):
        rows = [json.loads(line) for line in (val_dir / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 2 * n_val and all(r["step"] == step for r in rows)
        assert all({"input", "output", "score", "data_source", "uid"} <= set(r) for r in rows)
        by_source = defaultdict(list)
        for r in rows:
            by_source[r["data_source"]].append(r["score"])
        for source, scores in by_source.items():  # the dump's scores are the ones the metrics came from
            assert metrics[step][f"val/{source}/score/mean"] == pytest.approx(sum(scores) / len(scores))
        dumped[step] = rows
    logged = [json.loads(line) for line in (tmp_path / "logs" / "val_generations.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [0, 1]
    for entry in logged:
        assert len(entry["samples"]) == 3
        for s in entry["samples"]:  # each one is a real generation of that validation
            assert any((s["input"], s["output"], s["score"]) == (r["input"], r["output"], r["score"])
                       for r in dumped[entry["step"]])
        assert f"[validation generations] step {entry['step']}: 3 sample(s)" in console
    assert sorted(s["input"] for s in logged[0]["samples"]) == sorted(s["input"] for s in logged[1]["samples"])
    assert logged[1]["samples"][0]["output"].strip() and logged[1]["samples"][0]["output"].strip()[:40] in console
    events = EventAccumulator(str(tmp_path / "logs" / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("val/generations/text_summary")
    assert [e.step for e in texts] == [0, 1]
    assert logged[1]["samples"][0]["input"].strip()[:40] in texts[1].tensor_proto.string_val[0].decode()
