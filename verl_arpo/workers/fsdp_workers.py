"""FSDP2 workers: `ActorRolloutRefWorker` (actor + rollout + reference in one process per slot) and
`CriticWorker`. Device-agnostic: cuda + nccl when a GPU exists, else cpu + gloo; same code.

One actor per slot hosts up to three roles ("actor", "rollout", "ref" or combinations):
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
import math
import os
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.base import Worker
from verl_arpo.single_controller.decorator import Dispatch, register
from verl_arpo.utils.device import get_device_name

logger = logging.getLogger(__name__)


def _attn_impl(requested: str | None) -> str:
    """flash_attention_2 when requested/installed on CUDA, else sdpa."""
    if requested:
        return requested
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def move_optimizer_state(optimizer, device: str) -> None:
    """Move AdamW moments between the accelerator and host memory (optimizer_offload on GPU)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                state[key] = value.to(device, non_blocking=True)


def build_lr_scheduler(optimizer, optim_cfg, total_steps: int):
    """Linear warmup, then constant or cosine (to min_lr_ratio·lr)."""
    total = max(1, int(total_steps or 1))
    warmup = int(optim_cfg.get("lr_warmup_steps", -1) or -1)
    if warmup < 0:
        warmup = int(float(optim_cfg.get("lr_warmup_steps_ratio", 0.0) or 0.0) * total)
    style = optim_cfg.get("warmup_style", "constant")
    floor = float(optim_cfg.get("min_lr_ratio", 0.0) or 0.0)
    if style not in ("constant", "cosine"):
        raise ValueError(f"unknown optim.warmup_style {style!r}; accepted: ['constant', 'cosine']")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        if style == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class _FSDPModelMixin:
    """Loading and sharding shared by the actor/ref and the critic."""

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if not hasattr(self, "_device_mesh"):
            self._device_mesh = init_device_mesh(self.device_name, (torch.distributed.get_world_size(),))
        return self._device_mesh

    def _shard(self, model, fsdp_cfg, train: bool):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mp = None
        mp_cfg = fsdp_cfg.get("mixed_precision", None)
        if self.device_name == "cuda" or mp_cfg:
            mp_cfg = mp_cfg or {}
            mp = MixedPrecisionPolicy(param_dtype=getattr(torch, mp_cfg.get("param_dtype", "bfloat16")),
                                      reduce_dtype=getattr(torch, mp_cfg.get("reduce_dtype", "float32")))
        kwargs = dict(mesh=self._mesh(), reshard_after_forward=bool(fsdp_cfg.get("reshard_after_forward", True)))
        if mp is not None:
            kwargs["mp_policy"] = mp
        if fsdp_cfg.get("param_offload", False) and self.device_name == "cuda":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        layer_names = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in layer_names:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        if not train:
            model.requires_grad_(False)
        return model


class ActorRolloutRefWorker(Worker, _FSDPModelMixin):
    """Roles: "actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref"."""

    def __init__(self, config: DictConfig | dict, role: str = "actor_rollout_ref", full_config: Any = None):
        super().__init__()
        if role not in ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref"):
            raise ValueError(f"unknown worker role {role!r}")
        self.config = OmegaConf.create(config) if isinstance(config, dict) else config
        self.full_config = full_config
        self.role = role
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = "rollout" in role
        self._is_ref = role in ("ref", "actor_rollout_ref")
        self.device_name = get_device_name()

    # ------------------------------------------------------------------ init
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int = 1, need_ref: bool = False, seed: int = 0):
        """Load, shard and wire the roles. `need_ref` (the trainer's `use_reference_policy`: an
        active KL loss or in-reward KL, as normalize_config decided) builds the reference model."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from verl_arpo.utils.checkpoint import FSDPCheckpointManager
        from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

        self.init_process_group()
        torch.manual_seed(int(seed) + self.rank)
        mcfg = self.config.model
        if mcfg.get("external_lib", None):  # registers custom model classes with the Auto* factories
            import importlib

            importlib.import_module(mcfg.external_lib)
        path = mcfg.path
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=mcfg.get("trust_remote_code", False))
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.hf_config = AutoConfig.from_pretrained(path, trust_remote_code=mcfg.get("trust_remote_code", False))
        attn = _attn_impl(mcfg.get("attn_implementation", None))
        self.lora = int(mcfg.get("lora_rank", 0) or 0) > 0
        self.actor_module = self.actor = self.ref_module = None

        def load(train: bool):
            model = AutoModelForCausalLM.from_pretrained(
                path, torch_dtype=torch.float32, attn_implementation=attn,
                trust_remote_code=mcfg.get("trust_remote_code", False),
                **dict(mcfg.get("override_config", {}) or {}))
            if train and mcfg.get("enable_gradient_checkpointing", False):
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if train and self.lora:
                from peft import LoraConfig, get_peft_model

                tm = mcfg.get("target_modules", "all-linear")
                model = get_peft_model(model, LoraConfig(
                    r=int(mcfg.lora_rank), lora_alpha=int(mcfg.get("lora_alpha", 16)),
                    target_modules=tm if isinstance(tm, str) else list(tm), bias="none", task_type="CAUSAL_LM"))
            return model.to(self.device_name)

        # the actor/ref read use_remove_padding from their own section (verl keeps it under model)
        for section in ("actor", "ref", "rollout"):
            if section in self.config:
                with open_dict(self.config[section]):
                    self.config[section].use_remove_padding = bool(mcfg.get("use_remove_padding", False))
        if self._is_actor:
            acfg = self.config.actor
            self.actor_module = self._shard(load(train=True), acfg.fsdp_config, train=True)
            opt = acfg.optim
            self.actor_optimizer = torch.optim.AdamW(
                [p for p in self.actor_module.parameters() if p.requires_grad], lr=float(opt.lr),
                betas=tuple(opt.get("betas", (0.9, 0.999))), weight_decay=float(opt.get("weight_decay", 0.01)))
            self.lr_scheduler = build_lr_scheduler(self.actor_optimizer, opt, total_training_steps)
            self.actor = DataParallelPPOActor(acfg, self.actor_module, self.actor_optimizer)
            self.checkpoint_manager = FSDPCheckpointManager(
                self.actor_module, self.actor_optimizer, self.lr_scheduler, processing_class=self.tokenizer,
                checkpoint_contents=tuple(acfg.get("checkpoint", {}).get("contents", ["model", "optimizer", "extra"])),
                hf_config=self.hf_config)
        self.need_ref = bool(need_ref)
        if self._is_ref and self.need_ref and not self.lora:
            self.ref_module = self._shard(load(train=False), self.config.ref.fsdp_config, train=False)
            self.ref_policy = DataParallelPPOActor(self.config.ref, self.ref_module)
        if self._is_rollout:
            self._build_rollout(path)
            if self._is_actor:
                self._sync_rollout_weights()

    def _build_rollout(self, path: str):
        from verl_arpo.workers.rollout.agent_loop import AgentLoop, RolloutConfig
        from verl_arpo.workers.rollout.engines.base import build_engine
        from verl_arpo.workers.rollout.tools.registry import ToolExecutor

        rcfg = self.config.rollout
        name = rcfg.get("name", "hf")
        if name == "hf":
            engine_kwargs = dict(dtype=rcfg.get("dtype", "float32"), device=self.device_name,
                                 seed=int(rcfg.get("seed", 0)) + self.rank)
        else:
            engine_kwargs = dict(gpu_memory_utilization=float(rcfg.get("gpu_memory_utilization", 0.5)),
                                 tensor_model_parallel_size=int(rcfg.get("tensor_model_parallel_size", 1)),
                                 enable_prefix_caching=bool(rcfg.get("enable_prefix_caching", True)),
                                 dtype=rcfg.get("dtype", "auto"), seed=int(rcfg.get("seed", 0)) + self.rank,
                                 max_model_len=rcfg.get("max_model_len", None)
                                 or int(rcfg.prompt_length) + int(rcfg.response_length))
        self.engine = build_engine(name, path, self.tokenizer, **engine_kwargs)
        tools_cfg = OmegaConf.to_container(rcfg.tools, resolve=True) if "tools" in rcfg else None
        self.tool_executor = ToolExecutor.from_config({"tools": tools_cfg}) if tools_cfg else None
        call_limit = self.tool_executor.call_limit if self.tool_executor else 0
        # each rank draws from its own stream: seed + rank (the step enters inside the loop)
        loop_cfg = RolloutConfig.from_config(rcfg, call_limit=call_limit, seed=int(rcfg.get("seed", 0)) * 1000 + self.rank)
        self.agent_loop = AgentLoop(self.engine, self.tokenizer, self.tool_executor, loop_cfg)

    # ------------------------------------------------------------------ weight sync
    def _full_named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) one parameter at a time; LoRA merged on the fly: W + s·B@A."""
        params = dict(self.actor_module.named_parameters())

        def full(p):
            return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

        if not self.lora:
            for name, p in params.items():
                yield name, full(p)
            return
        scale = float(self.config.model.get("lora_alpha", 16)) / float(self.config.model.lora_rank)
        for name, p in params.items():
            if "lora_" in name:
                continue
            hf_name = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
            w = full(p)
            if name.endswith("base_layer.weight"):
                stem = name[: -len("base_layer.weight")]
                a, b = params.get(stem + "lora_A.default.weight"), params.get(stem + "lora_B.default.weight")
                if a is not None and b is not None:
                    w = w + scale * (full(b) @ full(a))
            yield hf_name, w

    def _sync_rollout_weights(self):
        with torch.no_grad():
            self.engine.update_weights(self._full_named_params())
        if hasattr(self.actor_module, "reshard"):
            self.actor_module.reshard()

    # ------------------------------------------------------------------ compute
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.engine.wake()
        out = self.agent_loop.generate_sequences(prompts)
        self.engine.sleep()
        return out

    def _log_prob_meta(self, data: DataProto, cfg) -> DataProto:
        data.meta_info.setdefault("temperature", float(self.config.rollout.get("temperature", 1.0)))
        data.meta_info["micro_batch_size"] = int(cfg.get("log_prob_micro_batch_size_per_gpu", 8) or 8)
        data.meta_info["use_dynamic_bsz"] = bool(cfg.get("log_prob_use_dynamic_bsz", False))
        data.meta_info["max_token_len"] = int(cfg.get("log_prob_max_token_len_per_gpu", 16384))
        return data

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        data = self._log_prob_meta(data, self.config.rollout)
        log_probs, entropy = self.actor.compute_log_prob(data, calculate_entropy=True)
        self.actor_module.reshard() if hasattr(self.actor_module, "reshard") else None
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropys": entropy},
                                   meta_info={"temperature": data.meta_info["temperature"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        data = self._log_prob_meta(data, self.config.ref)
        if self.lora:  # the reference is the base model: adapters off
            with self.actor_module.disable_adapter():
                log_probs, _ = self.actor.compute_log_prob(data, calculate_entropy=False)
            module = self.actor_module
        else:
            log_probs, _ = self.ref_policy.compute_log_prob(data, calculate_entropy=False)
            module = self.ref_module
        module.reshard() if hasattr(module, "reshard") else None
        return DataProto.from_dict(tensors={"ref_log_prob": log_probs})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        data.meta_info.setdefault("temperature", float(self.config.rollout.get("temperature", 1.0)))
        offload = bool(self.config.actor.fsdp_config.get("optimizer_offload", False)) and self.device_name != "cpu"
        if offload:
            move_optimizer_state(self.actor_optimizer, self.device_name)
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate this update uses
        metrics = self.actor.update_policy(data)
        if offload:  # keep the moments on the host while rollout and log-probs need the memory
            move_optimizer_state(self.actor_optimizer, "cpu")
        self.lr_scheduler.step()
        metrics["actor/lr"] = lr
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self):
        """Stream the updated actor weights into this rank's engine (the trainer times it apart)."""
        if self._is_rollout:
            self._sync_rollout_weights()

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0):
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str):
        self.checkpoint_manager.load_checkpoint(local_path)
        if self._is_rollout:
            self._sync_rollout_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def node_info(self) -> dict:
        return self.get_node_info()


class CriticWorker(Worker, _FSDPModelMixin):
    """The value model for GAE: an HF token-classification head with one label, FSDP2-sharded."""

    def __init__(self, config: DictConfig | dict):
        super().__init__()
        self.config = OmegaConf.create(config) if isinstance(config, dict) else config
        self.device_name = get_device_name()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int = 1):
        from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

        from verl_arpo.utils.checkpoint import FSDPCheckpointManager
        from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic

        self.init_process_group()
        mcfg = self.config.model
        tok = AutoTokenizer.from_pretrained(mcfg.get("tokenizer_path", None) or mcfg.path)
        hf_config = AutoConfig.from_pretrained(mcfg.path, num_labels=1)
        hf_config.classifier_dropout = 0.0  # the value head must be deterministic (Qwen2 defaults to 0.1)
        model = AutoModelForTokenClassification.from_pretrained(
            mcfg.path, config=hf_config, torch_dtype=torch.float32,
            attn_implementation=_attn_impl(mcfg.get("attn_implementation", None))).to(self.device_name)
        if mcfg.get("enable_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.critic_module = self._shard(model, mcfg.fsdp_config, train=True)
        opt = self.config.optim
        self.critic_optimizer = torch.optim.AdamW(self.critic_module.parameters(), lr=float(opt.lr),
                                                  betas=tuple(opt.get("betas", (0.9, 0.999))),
                                                  weight_decay=float(opt.get("weight_decay", 0.01)))
        self.lr_scheduler = build_lr_scheduler(self.critic_optimizer, opt, total_training_steps)
        self.critic = DataParallelPPOCritic(self.config, self.critic_module, self.critic_optimizer)
        self.checkpoint_manager = FSDPCheckpointManager(self.critic_module, self.critic_optimizer, self.lr_scheduler,
                                                        processing_class=tok, hf_config=hf_config)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        data.meta_info["micro_batch_size"] = int(self.config.get("ppo_micro_batch_size_per_gpu", 4))
        data.meta_info["use_dynamic_bsz"] = bool(self.config.get("use_dynamic_bsz", False))
        data.meta_info["max_token_len"] = int(self.config.get("forward_max_token_len_per_gpu", 32768))
        values = self.critic.compute_values(data)
        self.critic_module.reshard() if hasattr(self.critic_module, "reshard") else None
        return DataProto.from_dict(tensors={"values": values})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_critic(self, data: DataProto) -> DataProto:
        metrics = self.critic.update_critic(data)
        self.lr_scheduler.step()
        metrics["critic/lr"] = self.lr_scheduler.get_last_lr()[0]
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0):
        self.checkpoint_manager.save_checkpoint(local_path, global_step=global_step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str):
        self.checkpoint_manager.load_checkpoint(local_path)
