"""The hf engine's weights are freed while the actor updates and refilled by the weight sync
(docs/gpu.md, "Host memory"): the real `ActorRolloutRefWorker` in this process (world size 1, FSDP2
on a 1-rank gloo group) driven by the real trainer step.

- during `update_policy` the engine holds no weight storage (free_cache_engine=true);
- after the step's sync every engine weight equals the actor's full parameter cast to the engine's
  dtype, and the tied embedding / LM head is still one tensor;
- an engine left discarded (an update whose sync never came) is refilled before the next rollout;
- with free_cache_engine=false the weights stay through the update.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from verl_arpo.single_controller.base import find_free_port

ROOT = Path(__file__).resolve().parents[2]


class _LocalGroup:
    """A worker group of one: the trainer's calls go straight to the worker."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return getattr(self.worker, name)


def _trainer_and_worker(model_dir, data_dir, out_dir, free_cache_engine: bool):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from verl_arpo.trainer.config import validate_config
    from verl_arpo.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl_arpo.utils.dataset.rl_dataset import RLHFDataset
    from verl_arpo.workers.reward_manager import load_reward_manager
    from verl_arpo.workers.fsdp_workers import ActorRolloutRefWorker

    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_dir}/train.parquet",
                 "data.val_files=null", f"trainer.default_local_dir={out_dir}", "data.max_prompt_length=64",
                 "data.max_response_length=24", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.rollout.initial_rollouts=null", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.optim.lr=1e-2", "~actor_rollout_ref.rollout.tools",
                 f"actor_rollout_ref.rollout.free_cache_engine={str(free_cache_engine).lower()}",
                 "trainer.n_gpus_per_node=1", "trainer.logger=[]", "trainer.val_before_train=false",
                 "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.total_training_steps=3"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config_name="cpu_tiny", overrides=overrides)
    cfg = validate_config(cfg)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = RayPPOTrainer(cfg, tok, RLHFDataset(cfg.data.train_files, tok, cfg.data), None,
                            load_reward_manager(cfg, tok, num_examine=0), None)
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, cfg.derived)
    worker.init_model(trainer.total_training_steps, False, 0)
    trainer.actor_rollout_wg = _LocalGroup(worker)
    trainer.n_workers = 1
    return trainer, worker


def _engine_equals_actor(worker) -> None:
    engine_params = dict(worker.engine.model.named_parameters())
    for name, p in worker.actor_module.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        assert torch.equal(engine_params[name], full.to(engine_params[name].dtype)), name
    model = worker.engine.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _toy_rows(tmp_path):
    import pandas as pd

    rows = [{"data_source": "arpo_toy_math", "prompt": [{"role": "user", "content": f"What is {i} + 3?"}],
             "ability": "math", "reward_model": {"ground_truth": str(i + 3), "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(6)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")


@pytest.fixture
def one_rank_env(monkeypatch):
    port = find_free_port("127.0.0.1")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_engine_weights_freed_during_update_and_refilled_by_sync(free_cache_engine, one_rank_env, tiny_model_dir,
                                                                  tmp_path):
    _toy_rows(tmp_path)
    trainer, worker = _trainer_and_worker(tiny_model_dir, tmp_path, tmp_path / "out", free_cache_engine)
    assert os.environ["WORLD_SIZE"] == "1"
    seen = []
    update_policy = worker.actor.update_policy

    def spy(data):   # what the engine holds while the actor updates
        seen.append(sum(p.numel() for p in worker.engine.model.parameters()))
        return update_policy(data)

    worker.actor.update_policy = spy
    before = {n: p.detach().clone() for n, p in worker.engine.model.named_parameters()}
    trainer.train_step(1)
    total = sum(t.numel() for t in before.values())
    assert seen == [0 if free_cache_engine else total]
    assert not worker.engine.weights_discarded
    assert any(not torch.equal(before[n], p) for n, p in worker.engine.model.named_parameters())  # the update moved them
    _engine_equals_actor(worker)

    # an update whose sync never came: the next rollout syncs first
    worker.engine.discard_weights()
    metrics = trainer.train_step(2)
    assert "timing_s/gen" in metrics and not worker.engine.weights_discarded
    _engine_equals_actor(worker)


def test_resume_loads_with_the_engine_asleep_and_refills_it(one_rank_env, tiny_model_dir, tmp_path):
    """[issue 48] The checkpoint (the optimizer state's dummy AdamW step: ~4x the shard) loads while
    the engine holds no weights; the sync after it leaves the engine equal to the loaded actor."""
    _toy_rows(tmp_path)
    trainer, worker = _trainer_and_worker(tiny_model_dir, tmp_path, tmp_path / "out", True)
    trainer.train_step(1)
    ckpt = tmp_path / "ckpt"
    worker.save_checkpoint(str(ckpt), global_step=1)
    saved = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in worker.actor_module.named_parameters()}
    trainer.train_step(2)   # the actor and the engine move on
    held = []
    load = worker.checkpoint_manager.load_checkpoint

    def spy(path):   # what the engine holds while the checkpoint loads
        held.append(sum(p.numel() for p in worker.engine.model.parameters()))
        return load(path)

    worker.checkpoint_manager.load_checkpoint = spy
    worker.load_checkpoint(str(ckpt))
    assert held == [0]
    for n, p in worker.actor_module.named_parameters():
        assert torch.equal((p.full_tensor() if hasattr(p, "full_tensor") else p).detach(), saved[n]), n
    _engine_equals_actor(worker)
    assert "timing_s/gen" in trainer.train_step(3)   # and the next rollout runs on it


def test_critic_hands_its_cached_blocks_back_after_each_phase(one_rank_env, tiny_model_dir, tmp_path, monkeypatch):
    """[issue 48] The critic returns the device cache after computing values and after its update
    (a no-op on the CPU: the call itself is what is checked), as the actor does before vLLM wakes."""
    from hydra import compose, initialize_config_dir

    import verl_arpo.workers.fsdp_workers as fw
    from verl_arpo.protocol import DataProto
    from verl_arpo.trainer.config import validate_config

    _toy_rows(tmp_path)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = validate_config(compose(config_name="cpu_tiny", overrides=[
            f"actor_rollout_ref.model.path={tiny_model_dir}", f"critic.model.path={tiny_model_dir}",
            f"data.train_files={tmp_path}/train.parquet", "data.val_files=null", "algorithm.adv_estimator=gae",
            "trainer.n_gpus_per_node=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.rollout.initial_rollouts=null", "critic.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2"]))
    critic = fw.CriticWorker(cfg.critic, cfg.derived)
    critic.init_model(2)
    calls = []
    monkeypatch.setattr(fw, "release_device_cache", lambda device: calls.append(str(device)))
    ids = torch.randint(3, 100, (2, 12))
    mask = torch.ones_like(ids)
    data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask,
                                        "position_ids": torch.arange(12).expand(2, 12), "responses": ids[:, 6:],
                                        "response_mask": mask[:, 6:]})
    values = critic.compute_values(data).batch["values"]
    assert calls == ["cpu"] and values.shape == (2, 6)
    data.batch["values"], data.batch["returns"] = values, torch.zeros_like(values)
    critic.update_critic(data)
    assert calls == ["cpu", "cpu"]
