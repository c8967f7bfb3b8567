"""Building a model for training or reference and sharding it with FSDP2 (docs/gpu.md, "Placement"),
shared by the actor, the critic and SFT.

    attn_implementation     the attention backend for a model (flash_attention_2 on CUDA when installed)
    load_causal_lm          a transformers causal LM in the dtype and attention asked for
    init_sharded_model      meta-device build + rank-0 load and broadcast: no rank holds more than its shard
    offload_params_to_host  param_offload: the shards to the host after the broadcast
    to_device               the worker's device boundary: one micro-batch in, results back to the host
    shard_fsdp2             FSDP2 `fully_shard` of every decoder layer (the model's _no_split_modules), then the root
    fsdp_mixed_precision    the FSDP2 precision policy: bf16 params / fp32 reduce on CUDA by default, none on CPU
    model_dtype, module_device, maybe_reshard
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from verl_arpo.config import MixedPrecisionConfig, resolve_model_dtype

logger = logging.getLogger(__name__)


def attn_implementation(requested: str | None) -> str:
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


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32, attn: str | None = None,
                   trust_remote_code: bool = False, override_config: dict | None = None,
                   gradient_checkpointing: bool = False, lora_rank: int = 0, lora_alpha: int = 16,
                   target_modules: str | list = "all-linear", empty: bool = False) -> torch.nn.Module:
    """A Hugging Face causal LM for training: `attn` through attn_implementation, `override_config`
    applied to its config, non-reentrant gradient checkpointing, LoRA adapters (peft) when
    lora_rank > 0. On the CPU with the checkpoint's weights; with `empty`, the same module on the
    meta device (no memory, no file read beyond the config) for init_sharded_model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(dtype=dtype, attn_implementation=attn_implementation(attn), trust_remote_code=trust_remote_code)
    if empty:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **dict(override_config or {}))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs, **dict(override_config or {}))
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        tm = target_modules if isinstance(target_modules, str) else list(target_modules)
        model = get_peft_model(model, LoraConfig(r=int(lora_rank), lora_alpha=int(lora_alpha), target_modules=tm,
                                                 bias="none", task_type="CAUSAL_LM"))
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation (gradient) checkpointing on every decoder layer of an HF model.

    Non-reentrant: it needs no input that requires grad (LoRA freezes the embeddings), and the
    reentrant form is the one PyTorch deprecates. transformers 5.24 renamed the method to
    `activation_checkpointing_enable` and warns on the old name, which v6 removes; releases before
    the rename have only `gradient_checkpointing_enable`."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def init_sharded_model(load_full, build_empty, shard, device: torch.device, *, offload: bool = False) -> torch.nn.Module:
    """Build an FSDP2 model so that no rank holds more than its shard on `device` (docs/gpu.md, "Model init").

    Rank 0 alone reads the checkpoint into host memory (`load_full()`); every rank builds the same
    module on the meta device (`build_empty()`), shards it (`shard(module)`), allocates only its
    shard on `device`, and receives its slice of every parameter from rank 0
    (`set_model_state_dict(..., broadcast_from_rank0=True)`, one parameter at a time).
    Buffers are not sharded and not all in the state dict (rotary `inv_freq` is non-persistent, and
    `to_empty` leaves it garbage), so each is copied from rank 0's module and broadcast as it is.
    With `offload` (FSDP2's CPUOffloadPolicy) the broadcast still runs on `device` — NCCL on a GPU,
    not the whole model through gloo — and only then do the parameter shards move to the host
    (`offload_params_to_host`); the buffers stay on `device`, where the forward runs.
    Without a process group (one process) the module is rank 0's own, moved to `device`.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not (dist.is_available() and dist.is_initialized()):
        return load_full().to(device)
    rank = dist.get_rank()
    full = load_full() if rank == 0 else None
    model = shard(build_empty())
    model.to_empty(device=device)
    state = full.state_dict() if full is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    full_buffers = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if rank == 0:
            buf.copy_(full_buffers[name])
        if dist.get_world_size() > 1:
            dist.broadcast(buf, src=0)
    del full, state, full_buffers
    if offload:
        offload_params_to_host(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # nothing of the load stays reserved for the engine to trip over
    return model


def offload_params_to_host(model: torch.nn.Module) -> None:
    """Move the parameter shards of an FSDP2 model built on its device to the host, as CPUOffloadPolicy
    requires, and leave the buffers where they are (the forward runs on the device). `Module.to`
    swaps each DTensor in place, and FSDP2 re-reads every shard at its lazy init
    (`reset_sharded_param`), so this must come before the first forward. No-op on the host."""
    host = torch.device("cpu")
    if all(p.device == host for p in model.parameters()):
        return
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    model.to(host)
    for m, name, b in buffers:   # not FSDP-managed: put the originals back
        m._buffers[name] = b


def to_device(micro, device: torch.device):
    """The worker's device boundary (docs/gpu.md, "Placement"): a micro-batch (TensorDict) goes to
    the worker's device right before its forward, so a whole batch never sits on the accelerator;
    results come back with `.cpu()` where they are collected. No-op on the host."""
    return micro if device.type == "cpu" else micro.to(device, non_blocking=True)


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's (local) parameters; the host for a module without parameters."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def model_dtype(value: str | None, trained: bool, device_type: str) -> torch.dtype:
    """The torch dtype of config.resolve_model_dtype: the weights as loaded and sharded."""
    return getattr(torch, resolve_model_dtype(value, trained, device_type))


_PRECISION = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
              "float32": torch.float32, "fp32": torch.float32}


def fsdp_mixed_precision(mixed_precision: "MixedPrecisionConfig | None", device_type: str):
    """The FSDP2 MixedPrecisionPolicy of `fsdp_config.mixed_precision`, or with none set bf16 params
    with fp32 gradient reduction on CUDA; None (plain fp32) on the CPU without a setting."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        if device_type != "cuda":
            return None
        mixed_precision = MixedPrecisionConfig()
    return MixedPrecisionPolicy(param_dtype=_PRECISION[mixed_precision.param_dtype],
                                reduce_dtype=_PRECISION[mixed_precision.reduce_dtype])


def shard_fsdp2(model: torch.nn.Module, mesh, *, mp_policy=None, reshard_after_forward: bool = True,
                cpu_offload: bool = False, train: bool = True) -> torch.nn.Module:
    """`fully_shard` each decoder layer (the classes in the model's `_no_split_modules`), then the root
    (tied embeddings stay in the root's group). A frozen model (`train=False`) gets requires_grad off."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=bool(reshard_after_forward))
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())  # pinning needs CUDA
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    if not train:
        model.requires_grad_(False)
    return model


def keep_gathered_after_backward(module: torch.nn.Module, keep: bool) -> None:
    """FSDP2's `set_reshard_after_backward(not keep)` on every FSDP unit of `module` (no-op for a plain
    module). With `reshard_after_forward=False` and `keep` on every micro-batch but a mini-batch's last,
    each unit's parameters are all-gathered once a mini-batch instead of once or twice a micro-batch:
    the same cast of the same shards, so the same numbers (docs/performance.md, "Parameters gathered
    once a mini-batch")."""
    if hasattr(module, "set_reshard_after_backward"):
        module.set_reshard_after_backward(not keep)


def sync_gradients(module: torch.nn.Module, sync: bool) -> None:
    """FSDP2's `set_requires_gradient_sync(sync)` on `module` and its FSDP units (no-op for a plain
    module). With `sync` false on every micro-batch but a mini-batch's last (`fsdp_config.grad_sync_once`),
    each unit accumulates its unsharded gradients in the reduce dtype and reduce-scatters them once a
    mini-batch: Σ_ranks Σ_micro g instead of Σ_micro Σ_ranks g, the same sum in another order
    (docs/performance.md, "Gradients reduced once a mini-batch")."""
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(sync)


def maybe_reshard(module: torch.nn.Module) -> None:
    """FSDP2 leaves the root unsharded after a no_grad forward (and every unit with
    `reshard_after_forward=False`); reshard them all so the next state-dict/weight-sync sees sharded
    parameters and the memory is freed. A unit already sharded is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
