"""FSDP2 workers: `ActorRolloutRefWorker` (actor + rollout + reference in one process per slot) and
`CriticWorker`. Device-agnostic: cuda + nccl when a GPU exists, else cpu + gloo; same code.

One actor per slot hosts all three roles (verl's colocated "actor_rollout_ref"; split roles on
separate GPUs are not implemented):
- actor: the HF model sharded with FSDP2 (`fully_shard` per decoder layer + root) on a 1-D device
  mesh, AdamW, lr schedule, optional LoRA (peft) and gradient checkpointing;
- rollout: an inference engine (HF or vLLM) with its *own* unsharded copy of the weights — FSDP
  forwards are collectives, and ranks generate different amounts per round — driven by the
  multi-turn `AgentLoop`; weights are streamed into it parameter by parameter after every update
  (no disk round-trip);
- ref: a frozen copy for KL terms, built only when a KL term has weight (with LoRA, the reference is
  the base model with adapters disabled, so no copy at all).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.base import Worker
from verl_arpo.single_controller.decorator import Dispatch, register
from verl_arpo.utils.device import get_device_name, release_device_cache, set_local_device
from verl_arpo.config import ActorRolloutRefConfig, CriticConfig, Derived
from verl_arpo.workers.host_memory import HOST_MEMORY, memory_metrics, release_host_memory
from verl_arpo.utils.ulysses import build_sequence_parallel
from verl_arpo.workers.optim_step import build_adamw, build_lr_scheduler, move_optimizer_state
from verl_arpo.workers.sequence_parallel import gather_group_data, local_rows
from verl_arpo.workers.sharded_model import (attn_implementation,
    enable_activation_checkpointing,
    fsdp_mixed_precision,
    init_sharded_model,
    load_causal_lm,
    maybe_reshard,
    model_dtype,
    shard_fsdp2)

logger = logging.getLogger(__name__)


class _FSDPModelMixin:
    """Sharding and checkpoint saving shared by the actor/ref and the critic workers."""

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if not hasattr(self, "_device_mesh"):
            self._device_mesh = init_device_mesh(self.device_name, (torch.distributed.get_world_size(),))
        return self._device_mesh

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0):
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)

    def _param_offload(self, fsdp_cfg) -> bool:
        """param_offload keeps the sharded parameters (and their gradients and Adam moments) in host
        memory, FSDP2 moving each unit to the device for its compute. On the CPU the same code path
        runs (its copies are no-ops), so CPU runs test it."""
        return bool(fsdp_cfg.param_offload)

    def _shard(self, model, fsdp_cfg, train: bool):
        return shard_fsdp2(model, self._mesh(), mp_policy=fsdp_mixed_precision(fsdp_cfg.mixed_precision, self.device_name),
                           reshard_after_forward=fsdp_cfg.reshard_after_forward,
                           cpu_offload=self._param_offload(fsdp_cfg), train=train)


class ActorRolloutRefWorker(Worker, _FSDPModelMixin):
    """Roles: "actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref"."""

    def __init__(self, config: ActorRolloutRefConfig, derived: Derived, role: str = "actor_rollout_ref"):
        super().__init__()
        self.derived = derived   # this run's batch sizes per worker and KL switches (JobConfig.derived)
        if role != "actor_rollout_ref":
            raise ValueError(f"worker role {role!r} is not implemented: actor, rollout and reference always share "
                             "one worker per slot (role='actor_rollout_ref', actor_rollout_ref.hybrid_engine=true)")
        self.config: ActorRolloutRefConfig = config
        self.role = role
        self.device_name = get_device_name()

    # ------------------------------------------------------------------ init
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int = 1, need_ref: bool = False, seed: int = 0):
        """Load, shard and wire the roles. `need_ref` (the trainer's `use_reference_policy`: an
        active KL loss or in-reward KL, JobConfig.derived.need_ref) builds the reference model."""
        from transformers import AutoConfig, AutoTokenizer

        from verl_arpo.utils.checkpoint import FSDPCheckpointManager
        from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

        self.init_process_group()
        self.device = set_local_device(self.local_rank)
        self.sp = build_sequence_parallel(self.derived.actor_sp, self.device.type)
        if self.sp.enabled:
            print(f"[sequence parallel] actor rank {self.rank}: sp rank {self.sp.rank} of {self.sp.size}, "
                  f"{self.sp.dp_size} data-parallel replicas", flush=True)
        torch.manual_seed(int(seed))  # rank 0's init (LoRA adapters) is broadcast to every rank
        mcfg = self.config.model
        if mcfg.external_lib:  # registers custom model classes with the Auto* factories
            import importlib

            importlib.import_module(mcfg.external_lib)
        path = mcfg.path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.hf_config = AutoConfig.from_pretrained(path, trust_remote_code=mcfg.trust_remote_code)
        self.lora = int(mcfg.lora_rank or 0) > 0
        self.actor_module = self.actor = self.ref_module = None

        def load(train: bool):
            # a tree mask needs sdpa/eager: null would pick flash attention where it is installed
            attn = mcfg.attn_implementation or ("sdpa" if mcfg.use_prefix_sharing else None)
            kw = dict(attn=attn, trust_remote_code=mcfg.trust_remote_code,
                      override_config=mcfg.override_config,
                      gradient_checkpointing=train and mcfg.enable_gradient_checkpointing,
                      lora_rank=mcfg.lora_rank if train else 0, lora_alpha=mcfg.lora_alpha,
                      target_modules=mcfg.target_modules)
            fsdp_cfg = (acfg if train else self.config.ref).fsdp_config
            kw["dtype"] = model_dtype(fsdp_cfg.model_dtype, trained=train, device_type=self.device.type)
            return init_sharded_model(lambda: load_causal_lm(path, **kw), lambda: load_causal_lm(path, empty=True, **kw),
                                      lambda m: self._shard(m, fsdp_cfg, train=train), self.device,
                                      offload=self._param_offload(fsdp_cfg))

        acfg = self.config.actor
        self.actor_module = load(train=True)
        opt = acfg.optim
        self.actor_optimizer = build_adamw(self.actor_module.parameters(), opt)
        self.lr_scheduler = build_lr_scheduler(self.actor_optimizer, opt, total_training_steps)
        self.actor = DataParallelPPOActor(acfg, self.actor_module, self.actor_optimizer,
                                          update=self.derived.actor_update, use_kl_loss=self.derived.kl_loss_active,
                                          use_remove_padding=mcfg.use_remove_padding,
                                          use_prefix_sharing=mcfg.use_prefix_sharing, shuffle_seed=seed,
                                          sp=self.sp, device=self.device, temperature=self.derived.temperature,
                                          on_policy=self.derived.on_policy,
                                          rollout_correction=self.derived.rollout_correction,
                                          gather_once=not acfg.fsdp_config.reshard_after_forward)
        self.checkpoint_manager = FSDPCheckpointManager(
            self.actor_module, self.actor_optimizer, self.lr_scheduler, processing_class=self.tokenizer,
            checkpoint_contents=tuple(acfg.checkpoint.contents), hf_config=self.hf_config)
        self.need_ref = bool(need_ref)
        if self.need_ref and not self.lora:
            self.ref_module = load(train=False)
            # no actor keys apply: it only computes log-probs (micro-batches: derived.ref_log_prob)
            self.ref_policy = DataParallelPPOActor(None, self.ref_module, use_remove_padding=mcfg.use_remove_padding,
                                                   use_prefix_sharing=mcfg.use_prefix_sharing, sp=self.sp,
                                                   device=self.device, temperature=self.derived.temperature)
        self._build_rollout(path)
        # No weight sync here when the engine loaded the same checkpoint (a fresh LoRA merges to the
        # base weights, B = 0); a resumed run syncs in load_checkpoint. With vLLM's load_format=dummy
        # the engine starts from random weights and gets the actor's now.
        if self.config.rollout.load_format != "auto":
            self._sync_rollout_weights()

    def _build_rollout(self, path: str):
        from verl_arpo.workers.rollout import build_agent_loop
        from verl_arpo.workers.rollout.engines import build_engine
        from verl_arpo.workers.rollout.tools.registry import ToolExecutor

        rcfg = self.config.rollout
        name = rcfg.name
        if name == "hf":
            engine_kwargs = dict(dtype=rcfg.dtype, device=self.device, seed=int(rcfg.seed) + self.rank)
        else:
            engine_kwargs = dict(gpu_memory_utilization=float(rcfg.gpu_memory_utilization),
                                 tensor_model_parallel_size=int(rcfg.tensor_model_parallel_size),
                                 enable_prefix_caching=bool(rcfg.enable_prefix_caching),
                                 dtype=rcfg.dtype, seed=int(rcfg.seed) + self.rank,
                                 max_model_len=rcfg.max_model_len or int(rcfg.prompt_length) + int(rcfg.response_length),
                                 enforce_eager=bool(rcfg.enforce_eager), load_format=str(rcfg.load_format),
                                 max_num_seqs=int(rcfg.max_num_seqs),
                                 max_num_batched_tokens=int(rcfg.max_num_batched_tokens),
                                 # the sync re-streams every weight (LoRA merged in): nothing to keep asleep
                                 sleep_level=2)
        self.engine = build_engine(name, path, self.tokenizer, **engine_kwargs)
        # tools after the engine: bm25s (local search) loads numba, and vLLM 0.32 fails to start after it
        self.tool_executor = ToolExecutor.from_config(rcfg.tools)
        call_limit = self.tool_executor.call_limit if self.tool_executor else 0
        # each rank draws from its own stream: seed + rank (the step enters inside the loop)
        if self.derived.chat_template is not None:   # the prompts' template renders the hermes tool messages too
            self.tokenizer.chat_template = self.derived.chat_template
        self.agent_loop = build_agent_loop(rcfg.mode, self.engine, self.tokenizer, self.tool_executor, rcfg,
                                           call_limit=call_limit, seed=int(rcfg.seed) * 1000 + self.rank,
                                           chat_template_kwargs=self.derived.chat_template_kwargs)

    # ------------------------------------------------------------------ weight sync
    def _weight_plan(self) -> list[tuple[str, torch.Tensor, tuple | None]]:
        """(HF name, parameter, LoRA (A, B) or None) for every weight the engine gets; no data touched."""
        params = dict(self.actor_module.named_parameters())
        if not self.lora:
            return [(name, p, None) for name, p in params.items()]
        plan = []
        for name, p in params.items():
            if "lora_" in name:
                continue
            hf_name = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
            pair = None
            if name.endswith("base_layer.weight"):
                stem = name[: -len("base_layer.weight")]
                a, b = params.get(stem + "lora_A.default.weight"), params.get(stem + "lora_B.default.weight")
                pair = (a, b) if a is not None and b is not None else None
            plan.append((hf_name, p, pair))
        return plan

    def _full_named_params(self, plan, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one parameter at a time (docs/gpu.md, "Weight sync"): each is
        gathered, LoRA-merged (W + s·B@A), cast to the engine's `dtype` and handed over before the
        next is gathered, so the sync holds one full parameter beyond the shards."""
        scale = float(self.config.model.lora_alpha) / float(self.config.model.lora_rank) if self.lora else 0.0

        def full(p):
            return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

        for hf_name, p, pair in plan:
            if pair is None and dtype is not None:
                w = full(p.detach().to(dtype))  # cast the shard, then gather: half the bytes for bf16
            else:
                w = full(p)
            if pair is not None:
                w = w + scale * (full(pair[1]) @ full(pair[0]))
            if dtype is not None and w.dtype != dtype:
                w = w.to(dtype)
            yield hf_name, w
            del w

    def _sync_rollout_weights(self):
        with torch.no_grad(), HOST_MEMORY.phase("weight_sync"):
            plan = self._weight_plan()
            self.engine.check_weight_names([name for name, _, _ in plan])
            release_device_cache(self.device)  # the update's cached blocks go back before vLLM wakes its weights
            self.engine.update_weights(self._full_named_params(plan, getattr(self.engine, "weight_dtype", None)))
        maybe_reshard(self.actor_module)
        release_device_cache(self.device)

    # ------------------------------------------------------------------ compute
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self.engine.weights_discarded:  # an update without its sync (the trainer always syncs)
            self._sync_rollout_weights()
        with HOST_MEMORY.phase("rollout"):
            release_device_cache(self.device)  # before vLLM allocates its KV cache outside torch's allocator
            self.engine.wake()
            out = self.agent_loop.generate_sequences(prompts)
            if self.config.rollout.free_cache_engine:  # free the KV cache (vLLM) / weights (hf) for training
                self.engine.sleep()
        release_host_memory()
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """`old_log_probs` [B, R] and `entropy_sum` [B]: each row's entropy summed over its response
        mask, all the trainer needs for the token-mean `actor/entropy` (not the [B, R] tensor)."""
        data, shares = gather_group_data(data, self.sp)
        with HOST_MEMORY.phase("log_prob"):
            log_probs, entropy = self.actor.compute_log_prob(data, self.derived.actor_log_prob, calculate_entropy=True)
        maybe_reshard(self.actor_module)
        release_host_memory()
        mask = data.batch["response_mask"].to(entropy.dtype)
        out = DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropy_sum": (entropy * mask).sum(-1)})
        return local_rows(out, shares, self.sp)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        data, shares = gather_group_data(data, self.sp)
        batching = self.derived.ref_log_prob
        if self.lora:  # the reference is the base model: adapters off
            with self.actor_module.disable_adapter():
                log_probs, _ = self.actor.compute_log_prob(data, batching, calculate_entropy=False)
            module = self.actor_module
        else:
            log_probs, _ = self.ref_policy.compute_log_prob(data, batching, calculate_entropy=False)
            module = self.ref_module
        maybe_reshard(module)
        return local_rows(DataProto.from_dict(tensors={"ref_log_prob": log_probs}), shares, self.sp)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        data, _ = gather_group_data(data, self.sp)
        offload = bool(self.config.actor.fsdp_config.optimizer_offload)  # a no-op on the CPU, same path
        if offload:  # the moments go where their parameters are (the host too, under param_offload)
            move_optimizer_state(self.actor_optimizer, None)
        if self.config.rollout.free_cache_engine:
            # the sync after the update overwrites every engine weight: they need no memory meanwhile
            if self.engine.discard_weights():
                release_host_memory()  # hand the freed weights to the OS, not only to malloc
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate this update uses
        with HOST_MEMORY.phase("update"):
            metrics = self.actor.update_policy(data)
        if offload:  # keep the moments on the host while rollout and log-probs need the memory
            move_optimizer_state(self.actor_optimizer, torch.device("cpu"))
        self.lr_scheduler.step()
        metrics["actor/lr"] = lr
        release_host_memory()
        metrics.update(memory_metrics(self.device))
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self):
        """Stream the updated actor weights into this rank's engine (the trainer times it apart)."""
        self._sync_rollout_weights()

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str):
        """Resume: the engine sleeps through the load (free_cache_engine), as verl's does. Loading the
        optimizer state runs a step of AdamW on dummy gradients, ~4x the parameter shard; beside an
        awake vLLM (weights and KV cache) a 14B resume ran out of memory (issue 48). The sync after
        the load refills the engine's weights; its KV cache wakes at the next rollout."""
        if self.config.rollout.free_cache_engine:
            self.engine.sleep()
            if self.engine.discard_weights():   # vLLM's level-2 sleep has already freed them
                release_host_memory()
            release_device_cache(self.device)
        with HOST_MEMORY.phase("resume"):
            self.checkpoint_manager.load_checkpoint(local_path)
        release_device_cache(self.device)
        self._sync_rollout_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node_info(self) -> dict:
        return self.get_node_info()


class CriticWorker(Worker, _FSDPModelMixin):
    """The value model for GAE: an HF token-classification head with one label, FSDP2-sharded."""

    def __init__(self, config: CriticConfig, derived: Derived, seed: int = 0):
        super().__init__()
        self.config: CriticConfig = config
        self.derived = derived
        self.seed = seed
        self.device_name = get_device_name()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int = 1):
        from transformers import (
            AutoConfig,
            AutoModelForTokenClassification,
            AutoTokenizer,
        )

        from verl_arpo.utils.checkpoint import FSDPCheckpointManager
        from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic

        self.init_process_group()
        self.device = set_local_device(self.local_rank)
        self.sp = build_sequence_parallel(self.derived.critic_sp, self.device.type)
        if self.sp.enabled:
            print(f"[sequence parallel] critic rank {self.rank}: sp rank {self.sp.rank} of {self.sp.size}, "
                  f"{self.sp.dp_size} data-parallel replicas", flush=True)
        torch.manual_seed(int(self.seed))  # the value head's random init, made on rank 0 and broadcast
        mcfg = self.config.model
        tok = AutoTokenizer.from_pretrained(mcfg.tokenizer_path or mcfg.path, trust_remote_code=mcfg.trust_remote_code)
        hf_config = AutoConfig.from_pretrained(mcfg.path, num_labels=1, trust_remote_code=mcfg.trust_remote_code,
                                               **dict(mcfg.override_config or {}))
        hf_config.classifier_dropout = 0.0  # the value head must be deterministic (Qwen2 defaults to 0.1)
        kw = dict(dtype=model_dtype(mcfg.fsdp_config.model_dtype, trained=True, device_type=self.device.type),
                  attn_implementation=attn_implementation(mcfg.attn_implementation),
                  trust_remote_code=mcfg.trust_remote_code)

        def build(empty: bool):
            if empty:
                with torch.device("meta"):
                    model = AutoModelForTokenClassification.from_config(hf_config, **kw)
            else:
                model = AutoModelForTokenClassification.from_pretrained(mcfg.path, config=hf_config, **kw)
            if mcfg.enable_gradient_checkpointing:
                enable_activation_checkpointing(model)
            return model

        self.critic_module = init_sharded_model(lambda: build(False), lambda: build(True),
                                                lambda m: self._shard(m, mcfg.fsdp_config, train=True), self.device,
                                                offload=self._param_offload(mcfg.fsdp_config))
        opt = self.config.optim
        self.critic_optimizer = build_adamw(self.critic_module.parameters(), opt)
        self.lr_scheduler = build_lr_scheduler(self.critic_optimizer, opt, total_training_steps)
        self.critic = DataParallelPPOCritic(self.config, self.critic_module, self.critic_optimizer,
                                            update=self.derived.critic_update, values=self.derived.critic_values,
                                            shuffle_seed=self.seed, sp=self.sp, device=self.device)
        self.checkpoint_manager = FSDPCheckpointManager(self.critic_module, self.critic_optimizer, self.lr_scheduler,
                                                        processing_class=tok, hf_config=hf_config)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        data, shares = gather_group_data(data, self.sp)
        values = self.critic.compute_values(data)
        maybe_reshard(self.critic_module)
        # its cached blocks go back to the driver: vLLM's KV cache wakes outside torch's allocator at the
        # next rollout, and a critic that kept its peak reserved starved it at >= 7B (issue 48)
        release_device_cache(self.device)
        return local_rows(DataProto.from_dict(tensors={"values": values}), shares, self.sp)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        data, _ = gather_group_data(data, self.sp)
        metrics = self.critic.update_critic(data)
        release_host_memory()
        release_device_cache(self.device)   # as after compute_values
        self.lr_scheduler.step()
        metrics["critic/lr"] = self.lr_scheduler.get_last_lr()[0]
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str):
        with HOST_MEMORY.phase("resume"):
            self.checkpoint_manager.load_checkpoint(local_path)
        release_device_cache(self.device)
