"""The driver loop: `RayPPOTrainer.fit()` orchestrates the worker groups through one step at a time.

    prompts ─▶ rollout (agent loop: tools, ARPO/AEPO branching) ─▶ rewards (score on the last sampled
    token) ─▶ old log-probs (+ entropy) ─▶ [ref log-probs, only if a KL term has weight] ─▶
    [values, if GAE] ─▶ advantages (registered estimator) ─▶ [critic update] ─▶ actor update ─▶
    weight sync to the engines ─▶ metrics, rollout dump, validation, checkpoint

The driver holds no model: it moves DataProtos between worker groups (Ray actors) and computes the
cheap parts itself (rewards, advantages, metrics). Checkpoints are written into a staging folder
and published atomically, so a run killed at any moment resumes from the last complete step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import numpy as np
import torch

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.algos import core_algos
from verl_arpo.utils.dataset.batch_order import epoch_order
from verl_arpo.trainer.config import resolve_device
from verl_arpo.trainer.ppo.run_directory import RunDirectory
from verl_arpo.config import JobConfig
from verl_arpo.trainer.ppo.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    timed,
    validation_metrics,
)

logger = logging.getLogger(__name__)

# rollout metrics that add up over data-parallel ranks; every other one is averaged
_SUMMED = ("branches", "branch_draws", "fresh_refills", "duplicates", "tokens_generated", "tokens_in_trajectories",
           "pre_monitor_tool_calls", "/calls", "/successes", "/failures", "infra_failures", "/timeouts", "/retries", "hits", "misses",
           "cache_write_errors", "cache_writes")


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps were skipped for non-finite gradients."""


_MAXED = ("perf/max_memory_", "perf/cpu_memory_peak_gb", "perf/cpu_memory_entry_gb", "perf/gpu_memory_")


def reduce_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Lists (one entry per rank or per micro-batch) → one number: summed for counts, the largest for
    memory peaks (the rank that runs out first is the one that matters), else the mean."""
    out = {}
    for k, v in metrics.items():
        vals = np.asarray(v if isinstance(v, (list, tuple, np.ndarray)) else [v], dtype=float)
        if vals.size == 0:
            continue
        out[k] = float(vals.sum() if k.endswith(_SUMMED) else vals.max() if k.startswith(_MAXED) else vals.mean())
    if "rollout/tokens_generated" in out and out.get("rollout/tokens_in_trajectories"):
        out["rollout/generated_per_traj_token"] = out["rollout/tokens_generated"] / out["rollout/tokens_in_trajectories"]
    if out.get("rollout/branch_draws"):  # how often the branch rule fired when it was asked
        out["rollout/branch_fire_rate"] = out.get("rollout/branches", 0.0) / out["rollout/branch_draws"]
    return out


def cpu_threads_per_worker(node_cpus: float, workers_per_node: int) -> int:
    """CPUs each worker reserves (and uses as torch threads) when training on CPU: an equal share of
    its node's cores, at least 1. One worker on a 2-core machine then computes with 2 threads
    instead of leaving a core idle; 2 workers get 1 each (README, "Performance")."""
    return max(1, int(node_cpus) // max(1, workers_per_node))


def _machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _node_cpus(nnodes: int) -> float:
    """Cores a node can give its workers: Ray's logical CPUs per node, but never more than this
    machine's cores (a test cluster may declare 8 logical CPUs on 2 cores)."""
    import ray

    logical = float(ray.cluster_resources().get("CPU", 1)) / max(1, nnodes)
    return min(logical, float(_machine_cores()))


def compute_advantage(batch: DataProto, adv_estimator: str, gamma: float = 1.0, lam: float = 1.0,
                      norm_adv_by_std_in_grpo: bool = True, config: Any = None) -> DataProto:
    """Fill `advantages` and `returns` with the registered estimator named by algorithm.adv_estimator."""
    fn = core_algos.get_adv_estimator_fn(adv_estimator)
    b = batch.batch
    if adv_estimator == "gae":
        adv, ret = fn(b["token_level_rewards"], b["values"], b["response_mask"], gamma=gamma, lam=lam)
    elif adv_estimator == "grpo":
        adv, ret = fn(b["token_level_rewards"], b["response_mask"], batch.non_tensor_batch["uid"],
                      norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    elif adv_estimator == "rloo":
        adv, ret = fn(b["token_level_rewards"], b["response_mask"], batch.non_tensor_batch["uid"])
    else:  # estimators registered by users take the verl keyword set
        adv, ret = fn(token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"],
                      index=batch.non_tensor_batch.get("uid"), config=config, gamma=gamma)
    b["advantages"], b["returns"] = adv, ret
    return batch


class RayPPOTrainer:
    """Owns the worker groups, the data order, tracking and checkpoints; `fit()` runs training."""

    def __init__(self, config: JobConfig, tokenizer, train_dataset, val_dataset, reward_fn, val_reward_fn,
                 run_dir: RunDirectory | None = None):
        self.tokenizer = tokenizer
        self.train_dataset, self.val_dataset = train_dataset, val_dataset
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.config: JobConfig = _typed(config)
        config = self.config
        self.device = resolve_device(config.trainer.device)   # auto: the Ray cluster's GPUs decide
        derived = config.derived
        self.use_critic = derived.need_critic
        self.use_kl_in_reward = derived.kl_in_reward_active
        # [fix] the reference paid for a reference forward even with every KL weight at 0
        self.use_reference_policy = derived.need_ref
        self.on_policy = derived.on_policy
        self.kl_ctrl = core_algos.get_kl_controller(config.algorithm.kl_ctrl) if self.use_kl_in_reward else None
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.batch_size = int(config.data.train_batch_size)
        self.steps_per_epoch = len(train_dataset) // self.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"data.train_batch_size={self.batch_size} is larger than the training set "
                             f"({len(train_dataset)} rows): lower it")
        # data.stratify_by: each batch holds every value of that column in its share of the data
        self.train_strata = (train_dataset.column(config.data.stratify_by, "data.stratify_by")
                             if config.data.stratify_by else None)
        total = config.trainer.total_training_steps
        self.total_training_steps = int(total) if total else int(config.trainer.total_epochs) * self.steps_per_epoch
        self.n_workers = derived.world_size
        self.global_steps = 0
        self.consecutive_skipped = 0
        self.wandb_run_id: str | None = None  # continued by a resumed run (stored in data.pt)
        self.last_checkpoint: str | None = None
        self._val_samples: list[dict] = []   # picked by validate, logged with its step's metrics
        # its lock is held from init_workers (or the caller's claim(), before the cluster) to shutdown
        self.run_dir = run_dir if run_dir is not None else RunDirectory(config)

    # ------------------------------------------------------------------ workers
    def init_workers(self):
        self.run_dir.acquire_lock()
        from verl_arpo.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker

        cfg = self.config
        make_group = self._local_group_factory() if cfg.trainer.single_process else self._ray_group_factory()
        self.actor_rollout_wg = make_group(ActorRolloutRefWorker, "actor_rollout_ref", config=cfg.actor_rollout_ref,
                                           derived=cfg.derived, role="actor_rollout_ref")
        # the credentials init_ray kept out of Ray's (logged) runtime_env; before init_model: the
        # tools read their keys when they are built
        secrets = cfg.ray_init.worker_env.secrets
        if secrets:
            self.actor_rollout_wg.execute_all("set_environment", secrets)
        self.actor_rollout_wg.init_model(self.total_training_steps, self.use_reference_policy, int(cfg.trainer.seed))
        infos = self.actor_rollout_wg.execute_all("get_node_info")  # after init_model: the process group exists
        print("[verl_arpo] worker ranks on nodes: " + ", ".join(
            f"rank {i['rank']} on {i['ip']} (pid {i['pid']}, GLOO_SOCKET_IFNAME={i.get('gloo_socket_ifname') or '-'})"
            for i in infos) + f"; MASTER_ADDR={infos[0]['master_addr']}:{infos[0]['master_port']}"
            + (" (in the driver's process: trainer.single_process)" if cfg.trainer.single_process else ""), flush=True)
        if self.use_critic:
            self.critic_wg = make_group(CriticWorker, "critic", config=cfg.critic, derived=cfg.derived,
                                        seed=int(cfg.trainer.seed))
            if secrets:
                self.critic_wg.execute_all("set_environment", secrets)
            self.critic_wg.init_model(self.total_training_steps)

    def _call_timeout(self) -> float | None:
        t = self.config.trainer.worker_call_timeout
        return float(t) if t else None

    def _ray_group_factory(self):
        """`make_group(worker_cls, name_prefix, **init_kwargs)` for Ray actors: one per slot of a placement
        group sized by trainer.nnodes × n_gpus_per_node (a critic shares each slot with the actor)."""
        from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl_arpo.single_controller.ray.resource_pool import ClusterTooSmallError
        from verl_arpo.config import ConfigError
        from verl_arpo.utils.device import cuda_worker_env

        cfg = self.config
        use_gpu = self.device == "cuda"
        nodes = [int(cfg.trainer.n_gpus_per_node)] * int(cfg.trainer.nnodes)
        # GPU workers keep 1 CPU each (their compute is on the device); CPU workers split the cores
        cpus = 1 if use_gpu else cpu_threads_per_worker(_node_cpus(int(cfg.trainer.nnodes)), nodes[0])
        self.resource_pool = RayResourcePool(nodes, use_gpu=use_gpu, max_colocate_count=2 if self.use_critic else 1,
                                             cpus_per_bundle=cpus)
        try:   # [reliability: issue 51] seconds, not the reservation's timeout, before any model loads
            self.resource_pool.check_capacity()
        except ClusterTooSmallError as exc:
            unit = "GPUs" if use_gpu else "CPUs"
            fix = ("--config-name=cpu_tiny, or trainer.n_gpus_per_node=<CPUs per node, e.g. 2>" if not use_gpu
                   else "trainer.n_gpus_per_node=<the GPUs a node has>")
            raise ConfigError([("trainer.n_gpus_per_node", f"trainer.n_gpus_per_node={nodes[0]} x trainer.nnodes="
                               f"{len(nodes)}: the cluster cannot hold {exc.workers_per_node} workers on each of "
                               f"{exc.nodes_needed} node(s) (each needs {exc.per_node}; its nodes have {exc.nodes} "
                               f"{unit}); set {fix}")]) from None
        env = cuda_worker_env(cfg.ray_init.worker_env.public) if use_gpu else {}

        def make_group(worker_cls, name_prefix, **init_kwargs):
            return RayWorkerGroup(self.resource_pool, RayClassWithInitArgs(worker_cls, **init_kwargs),
                                  name_prefix=name_prefix, call_timeout=self._call_timeout(), env_vars=env)
        return make_group

    def _local_group_factory(self):
        """`make_group(worker_cls, name_prefix, **init_kwargs)` for trainer.single_process: the worker in
        this process (single_controller/local.py), with what a Ray worker would get: ray_init's env_vars in
        the environment, and on a CPU all the cores Ray would give it as torch threads (capped by
        ray_init.num_cpus, and by OMP_NUM_THREADS when env_vars sets it)."""
        from verl_arpo.single_controller.local import LocalWorkerGroup
        from verl_arpo.utils.device import cuda_worker_env

        cfg = self.config
        public = dict(cfg.ray_init.worker_env.public)
        env = {**public, **cuda_worker_env(public)} if self.device == "cuda" else public
        threads = None
        if self.device != "cuda":
            threads = cpu_threads_per_worker(min(cfg.ray_init.num_cpus or _machine_cores(), _machine_cores()), 1)
            if str(env.get("OMP_NUM_THREADS", "")).isdigit():
                threads = int(env["OMP_NUM_THREADS"])

        def make_group(worker_cls, name_prefix, **init_kwargs):
            return LocalWorkerGroup(worker_cls, name_prefix=name_prefix, env_vars=env,
                                    call_timeout=self._call_timeout(), num_threads=threads, **init_kwargs)
        return make_group

    def shutdown(self):
        """Kill the worker actors, release the placement groups (a driver may train again) and the run lock,
        and stop the reward scoring processes (scoring_pool.py: none may still be stopping when the
        interpreter exits)."""
        self.run_dir.release_lock()
        for reward_fn in {id(f): f for f in (self.reward_fn, self.val_reward_fn) if f is not None}.values():
            close = getattr(reward_fn, "close", None)   # a user's reward function may be a plain callable
            if close is not None:
                close()
        for name in ("critic_wg", "actor_rollout_wg"):
            wg = getattr(self, name, None)
            if wg is not None:
                wg.shutdown()
        pool = getattr(self, "resource_pool", None)
        if pool is not None:
            pool.remove()

    # ------------------------------------------------------------------ checkpoints (run_directory.py)
    def _checkpointed_groups(self) -> dict:
        return {"actor": self.actor_rollout_wg, **({"critic": self.critic_wg} if self.use_critic else {})}

    def save_checkpoint(self, step: int) -> str:
        state = {"kl_coef": self.kl_ctrl.value if self.kl_ctrl else None,
                 "consecutive_skipped": self.consecutive_skipped, "wandb_run_id": self.wandb_run_id}
        self.last_checkpoint = self.run_dir.save(step, self._checkpointed_groups(), state)
        return self.last_checkpoint

    def load_checkpoint(self) -> int:
        """Resume per trainer.resume_mode; returns the step the checkpoint finished (0 = fresh)."""
        path = self.run_dir.resume_point()
        if path is None:
            return 0
        state = self.run_dir.load_state(path)
        for name, group in self._checkpointed_groups().items():
            group.load_checkpoint(os.path.join(path, name))
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = state["kl_coef"]
        self.wandb_run_id = state.get("wandb_run_id")
        self.consecutive_skipped = int(state.get("consecutive_skipped") or 0)   # the skip limit spans a resume
        self.last_checkpoint = path
        step = int(state["global_step"])
        print(f"[verl_arpo] resumed from {path} (step {step})", flush=True)
        if step >= self.total_training_steps:
            print(f"[verl_arpo] the run in {self.run_dir.root} is already complete (step {step} >= "
                  f"total_training_steps={self.total_training_steps}): nothing to train. Raise "
                  "trainer.total_training_steps to continue it, or use a new trainer.default_local_dir", flush=True)
        return step

    # ------------------------------------------------------------------ data order (resumable)
    def _batch_indices(self, step: int) -> np.ndarray:
        """Row indices of training step `step` (1-based): epoch = (step−1) // steps_per_epoch, order
        = a permutation seeded by (data.seed, epoch), stratified by `data.stratify_by` when set, so a
        resumed run sees exactly the same batches."""
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        data = self.config.data
        order = epoch_order(len(self.train_dataset), data.seed, epoch, data.shuffle, self.train_strata)
        return order[k * self.batch_size:(k + 1) * self.batch_size]

    def _collate(self, dataset, indices) -> DataProto:
        from verl_arpo.utils.dataset.rl_dataset import collate_fn

        return DataProto.from_single_dict(collate_fn([dataset[int(i)] for i in indices]))

    # ------------------------------------------------------------------ one step
    def _rollout(self, batch: DataProto, step: int, validate: bool = False) -> tuple[DataProto, dict]:
        batch.non_tensor_batch["uid"] = as_object_array([f"{'v' if validate else 's'}{step}-{i}" for i in range(len(batch))])
        # The prompt columns leave the batch here: only the rollout reads them, and its output holds the
        # prompt + response layout the update trains on, so nothing is repeated n-fold below. The
        # rollout takes the unpadded ids (raw_prompt_ids) and pads once, when it builds that layout; a
        # dataset without them sends its padded tensors. raw_prompt: the hermes format's sanity check.
        padded = [k for k in ("input_ids", "attention_mask", "position_ids") if k in batch.batch.keys()]
        if "raw_prompt_ids" in batch.non_tensor_batch:
            batch.pop(batch_keys=padded)
            gen = batch.pop(non_tensor_batch_keys=["raw_prompt_ids"])
        else:
            gen = batch.pop(batch_keys=padded)
        gen.non_tensor_batch["uid"] = batch.non_tensor_batch["uid"]
        if "raw_prompt" in batch.non_tensor_batch:
            gen.non_tensor_batch["raw_prompt"] = batch.non_tensor_batch.pop("raw_prompt")
        gen.meta_info = {"global_steps": step, "validate": validate}
        out = self.actor_rollout_wg.generate_sequences(gen)
        n = len(out) // len(batch)
        merged = batch.repeat(n, interleave=True).union(out)
        return merged, out.meta_info.get("metrics", {})

    def _balance_batch(self, batch: DataProto) -> None:
        """Reorder trajectories so every data-parallel rank gets a similar number of tokens."""
        from verl_arpo.utils.seqlen_balancing import balance_batch_indices

        seqlens = batch.batch["attention_mask"].sum(-1).tolist()
        # prefix sharing computes a prompt once per micro-batch: keep each prompt's rows on one rank.
        # Weighing a group by its prefix tree (balance_batch_indices' `tokens`) changes which rank trains
        # what; it waits for its 4-seed-pair check (docs/performance.md, "The ranks balanced by the tokens
        # they train").
        share = self.config.actor_rollout_ref.model.use_prefix_sharing
        groups = batch.non_tensor_batch["uid"] if share else None
        order = balance_batch_indices(seqlens, self.n_workers, groups=groups)
        batch.reorder(torch.as_tensor(np.asarray(order), dtype=torch.long))

    def _score(self, batch: DataProto, reward_fn, metrics: dict | None = None) -> dict:
        """token_level_scores into `batch`; the manager's own counters into `metrics`; returns the
        per-row extra info."""
        result = reward_fn(batch, return_dict=True)
        batch.batch["token_level_scores"] = result["reward_tensor"]
        if metrics is not None:
            metrics.update(result.get("reward_metrics", {}))
        return result.get("reward_extra_info", {})

    def _tool_outages(self, batch: DataProto, step: int, metrics: dict) -> None:
        """The outage policy (tool_outages.py) on this step's batch; past the stop rate, save what
        the previous steps trained and stop with one line naming the tools."""
        from verl_arpo.trainer.ppo import tool_outages

        tools, failed = self.config.actor_rollout_ref.rollout.tools, tool_outages.infra_failures(batch)
        rate, stop_rate = tool_outages.share_failed(failed), tools.infra_failure_stop_rate
        if stop_rate is not None and rate > stop_rate:
            if step > 1 and (self.last_checkpoint is None or not self.last_checkpoint.endswith(f"global_step_{step - 1}")):
                self.save_checkpoint(step - 1)   # the model as the last trained step left it
            raise tool_outages.ToolOutageError(
                tool_outages.outage_stop_message(failed, rate, stop_rate, step, self.last_checkpoint))
        metrics.update(tool_outages.apply_outage_policy(batch, tools.infra_failure_policy, failed))

    def train_step(self, step: int) -> dict[str, float]:
        cfg, timing, metrics = self.config, {}, {}
        with timed("step", timing):
            batch = self._collate(self.train_dataset, self._batch_indices(step))
            with timed("gen", timing):
                batch, gen_metrics = self._rollout(batch, step)
            metrics.update(reduce_metrics(gen_metrics))
            batch.meta_info["global_steps"] = step
            if cfg.trainer.balance_batch:
                self._balance_batch(batch)
            with timed("reward", timing):
                extra = self._score(batch, self.reward_fn, metrics)
            self._tool_outages(batch, step, metrics)
            # Two entropies: actor/entropy is H of the policy that generated the batch (π_old, as in
            # verl), actor/update_entropy the mean H over the update's forwards (after earlier steps).
            # one epoch, one mini-batch, nothing else reading π_old (JobConfig.derived.on_policy): the
            # old-log-prob pass would recompute exactly what the update's first forward computes
            on_policy = self.on_policy
            if not on_policy:  # else the update's own forward gives π_old (detached)
                with timed("old_log_prob", timing):
                    lp = self.actor_rollout_wg.compute_log_prob(batch)
                    tokens = batch.batch["response_mask"].sum().clamp(min=1)
                    metrics["actor/entropy"] = (lp.batch.pop("entropy_sum").sum() / tokens).item()
                    batch = batch.union(lp)
            if self.use_reference_policy:
                with timed("ref", timing):
                    batch = batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))
            if self.use_critic:
                with timed("values", timing):
                    batch = batch.union(self.critic_wg.compute_values(batch))
            with timed("adv", timing):
                b = batch.batch
                if self.use_kl_in_reward:
                    b["token_level_rewards"], kl = core_algos.apply_kl_penalty_to_rewards(
                        b["token_level_scores"], b["old_log_probs"], b["ref_log_prob"], b["response_mask"],
                        self.kl_ctrl.value, cfg.algorithm.kl_penalty)
                    metrics.update({"actor/reward_kl_penalty": kl.item(), "actor/reward_kl_penalty_coeff": self.kl_ctrl.value})
                    self.kl_ctrl.update(kl.item(), n_steps=self.batch_size)
                else:
                    b["token_level_rewards"] = b["token_level_scores"]
                compute_advantage(batch, cfg.algorithm.adv_estimator, float(cfg.algorithm.gamma), float(cfg.algorithm.lam),
                                  bool(cfg.algorithm.norm_adv_by_std_in_grpo), cfg.algorithm)
            if self.use_critic:
                with timed("update_critic", timing):
                    metrics.update(reduce_metrics(self.critic_wg.update_critic(batch).meta_info["metrics"]))
            if int(cfg.trainer.critic_warmup) < step:
                with timed("update_actor", timing):
                    metrics.update(reduce_metrics(self.actor_rollout_wg.update_actor(batch).meta_info["metrics"]))
                self._count_skipped_update(metrics)  # on-policy, the update reported actor/entropy itself
                with timed("weight_sync", timing):
                    self.actor_rollout_wg.sync_rollout_weights()
            for key, vals in (extra or {}).items():
                nums = [float(v) for v in vals if isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)]
                if nums and key != "score":
                    metrics[f"reward/{key}/mean"] = float(np.mean(nums))
            if cfg.trainer.rollout_data_dir:
                with timed("dump", timing):
                    from verl_arpo.utils.rollout_dump import dump_rollout

                    dump_rollout(batch, self.tokenizer, step, cfg.trainer.rollout_data_dir)
        metrics.update(compute_data_metrics(batch, use_critic=self.use_critic))
        metrics.update(compute_timing_metrics(timing))
        metrics.update(compute_throughput_metrics(batch, timing, self.n_workers))
        return metrics

    def _count_skipped_update(self, metrics: dict[str, float]) -> None:
        """training/skipped_step (every optimizer step of this update had a non-finite gradient
        norm), training/consecutive_skipped_steps; past trainer.max_consecutive_skipped_steps in a
        row the run stops: the policy is not learning and each step only costs time."""
        steps = metrics.get("actor/optimizer_steps", 0.0)
        skipped = steps > 0 and metrics.get("actor/skipped_optimizer_steps", 0.0) >= steps
        self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
        metrics["training/skipped_step"] = float(skipped)
        metrics["training/consecutive_skipped_steps"] = float(self.consecutive_skipped)
        limit = int(self.config.trainer.max_consecutive_skipped_steps)
        if skipped:
            logger.warning("step %d: every optimizer step was skipped (non-finite gradient norm; non-finite "
                           "losses %d, non-finite rewards %d); %d in a row", self.global_steps,
                           int(metrics.get("actor/non_finite_losses", 0)),
                           int(metrics.get("reward/non_finite_scores", 0)), self.consecutive_skipped)
        if limit > 0 and self.consecutive_skipped >= limit:
            raise NonFiniteTrainingError(
                f"{self.consecutive_skipped} consecutive training steps had only non-finite gradient norms "
                f"(trainer.max_consecutive_skipped_steps={limit}); last non-finite losses: "
                f"{int(metrics.get('actor/non_finite_losses', 0))}, non-finite rewards: "
                f"{int(metrics.get('reward/non_finite_scores', 0))}. Lower the learning rate, check the reward "
                "function, or resume from the last checkpoint")

    # ------------------------------------------------------------------ validation
    def _log(self, tracker, metrics: dict, step: int) -> None:
        """One step's metrics, then the validation samples picked at this step (if any)."""
        tracker.log(metrics, step=step)
        samples, self._val_samples = self._val_samples, []
        tracker.log_generations(samples, step)

    def validate(self, step: int) -> dict[str, float]:
        """Validation metrics; with trainer.validation_data_dir every generation is written to
        `<dir>/<step>.jsonl`, and trainer.log_val_generations of them are logged with the metrics
        (utils/val_generations.py)."""
        from verl_arpo.utils.val_generations import dump_validation, pick_samples, validation_records

        if self.val_dataset is None or self.val_reward_fn is None:
            return {}
        t = self.config.trainer
        n_val = int(self.config.actor_rollout_ref.rollout.val_kwargs.n)
        size = self.config.data.val_batch_size or len(self.val_dataset)
        sources, uids, scores, records = [], [], [], []
        for start in range(0, len(self.val_dataset), int(size)):
            batch = self._collate(self.val_dataset, range(start, min(start + int(size), len(self.val_dataset))))
            batch.non_tensor_batch.setdefault("data_source", as_object_array(["unknown"] * len(batch)))
            batch, _ = self._rollout(batch, step * 100000 + start, validate=True)
            self._score(batch, self.val_reward_fn)
            sources += list(batch.non_tensor_batch["data_source"])
            uids += list(batch.non_tensor_batch["uid"])
            scores += batch.batch["token_level_scores"].sum(-1).tolist()
            if t.validation_data_dir or t.log_val_generations:
                records += validation_records(batch, self.tokenizer, step)
        if t.validation_data_dir:
            dump_validation(records, t.validation_data_dir, step)
        self._val_samples = pick_samples(records, int(t.log_val_generations))
        return validation_metrics(sources, uids, scores, n=n_val)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        from verl_arpo.trainer.config import mask_secrets
        from verl_arpo.trainer.ppo.preemption import Preempted, PreemptionGuard
        from verl_arpo.utils.tracking import Tracking, parse_logger

        cfg = self.config.trainer
        with self.run_dir.holding_lock(), PreemptionGuard(cfg.preemption_grace_s) as preempt:
            start = self.load_checkpoint()  # first: a resumed run continues its wandb run
            tracker = Tracking(project_name=cfg.project_name, experiment_name=cfg.experiment_name,
                               default_backend=parse_logger(cfg.logger), config=mask_secrets(dataclasses.asdict(self.config)),
                               log_dir=os.path.join(self.run_dir.root, "logs"), wandb_run_id=self.wandb_run_id)
            self.wandb_run_id = tracker.wandb_run_id
            tracker.set_total(self.total_training_steps)
            last_metrics: dict[str, float] = {}
            if cfg.val_only:  # verl's trainer.val_only: validate the (resumed) model and stop
                if self.val_reward_fn is None or self.val_dataset is None:
                    raise ValueError("trainer.val_only=true needs data.val_files")
                last_metrics = self._guard(self.validate, start)
                self._log(tracker, last_metrics, start)
                tracker.finish()
                return last_metrics
            if start == 0 and cfg.val_before_train and self.val_reward_fn is not None:
                last_metrics = self._guard(self.validate, 0)
                self._log(tracker, last_metrics, 0)
            save_freq, test_freq = int(cfg.save_freq), int(cfg.test_freq)
            if save_freq <= 0:
                logger.warning("trainer.save_freq=%d: no checkpoint will be written (verl's meaning; a "
                               "preemption still saves the step in flight). Set trainer.save_freq=N > 0 to "
                               "save every N steps and at the end", save_freq)
            for step in range(start + 1, self.total_training_steps + 1):
                self.global_steps = step
                metrics = self._guard(self.train_step, step)
                last = step == self.total_training_steps
                if test_freq > 0 and (step % test_freq == 0 or last):
                    metrics.update(self._guard(self.validate, step))
                # verl's meaning: save_freq N > 0 saves every N steps and at the end; 0 or -1 never
                saved = save_freq > 0 and (step % save_freq == 0 or last)
                if saved or (preempt.requested and not last):  # SIGTERM: keep this step's work
                    self._guard(self.save_checkpoint, step)
                metrics["training/global_step"] = step
                metrics["training/epoch"] = (step - 1) // self.steps_per_epoch
                self._log(tracker, metrics, step)
                last_metrics = metrics
                if preempt.requested and not last:
                    preempt.done()
                    tracker.finish()
                    raise Preempted(step, self.last_checkpoint)
            tracker.finish()
        return last_metrics

    def _guard(self, fn, *args):
        """Run a step; a dead worker becomes an error naming it and the checkpoint to resume from."""
        from verl_arpo.trainer.ppo.tool_outages import ToolOutageError

        try:
            return fn(*args)
        except ToolOutageError:
            raise   # its line already names the checkpoint and how to resume
        except (RuntimeError, OSError) as e:  # a dead worker, or a full disk under a dump/checkpoint
            where = self.last_checkpoint or "none yet (restart from scratch)"
            raise RuntimeError(f"{e}\n[verl_arpo] training stopped at step {self.global_steps}; last complete "
                               f"checkpoint: {where}; restart with trainer.resume_mode=auto to continue") from e


def slow_bf16_keys(config: JobConfig, fast_bf16: bool | None = None, device: str | None = None) -> list[str]:
    """Warnings for the keys that compute in bf16 on a CPU without native bf16, where a bf16 matmul
    is emulated and ~50x slower than fp32 (docs/performance.md, "Precision on the CPU"). The run
    still goes ahead: the numbers are right, only slow."""
    from verl_arpo.utils.device import cpu_has_fast_bf16

    device = device or resolve_device(config.trainer.device)
    if device != "cpu" or (cpu_has_fast_bf16() if fast_bf16 is None else fast_bf16):
        return []
    arr = config.actor_rollout_ref
    keys = {"actor_rollout_ref.rollout.dtype": arr.rollout.dtype,
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype":
                getattr(arr.actor.fsdp_config.mixed_precision, "param_dtype", None)}
    return [f"{key}={value}: this CPU has no native bf16 matmul (no amx_bf16 / avx512_bf16 flag), so bf16 "
            f"compute is emulated and ~50x slower than fp32; set {key}=float32" for key, value in keys.items()
            if value in ("bfloat16", "bf16")]


def _typed(config: Any) -> JobConfig:
    if not isinstance(config, JobConfig):
        raise TypeError(f"the trainer takes the typed config, got {type(config).__name__}: build it once with "
                        "verl_arpo.trainer.config.validate_config(cfg) (which also checks every value)")
    return config


def run_ppo(config: JobConfig, keep_workers: bool = False, run_dir: RunDirectory | None = None):
    """Build datasets, reward managers and the trainer from a validated config, then train.

    Returns the last step's metrics; with keep_workers=True returns (metrics, trainer) and leaves
    the worker groups alive (the caller then calls `trainer.shutdown()`). `run_dir`: the run
    directory the caller already claimed (main_ppo.run, before Ray starts); the trainer releases it."""
    from transformers import AutoTokenizer

    from verl_arpo.utils.dataset.rl_dataset import RLHFDataset
    from verl_arpo.workers.reward_manager import load_reward_manager

    config = _typed(config)
    model_path = config.actor_rollout_ref.model.path
    tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer or model_path)
    tools = None
    if config.actor_rollout_ref.rollout.multi_turn.format == "hermes":   # the prompts show the function schemas
        from verl_arpo.workers.rollout.tools.registry import tool_schemas

        tools = tool_schemas(config.actor_rollout_ref.rollout.tools)
    train_ds = RLHFDataset(config.data.train_files, tokenizer, config.data, tools=tools)
    val_ds = RLHFDataset(config.data.val_files, tokenizer, config.data, tools=tools) if config.data.val_files else None
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
    val_reward_fn = load_reward_manager(config, tokenizer, num_examine=1)
    trainer = RayPPOTrainer(config, tokenizer, train_ds, val_ds, reward_fn, val_reward_fn, run_dir=run_dir)
    for line in slow_bf16_keys(config, device=trainer.device):   # the device the trainer resolved, once
        logger.warning(line)
    try:
        trainer.init_workers()
        metrics = trainer.fit()
    except BaseException:
        trainer.shutdown()
        raise
    if keep_workers:
        return metrics, trainer
    trainer.shutdown()
    return metrics
