"""The training mechanics every trainer here shares: the PPO actor, the critic and SFT (docs/algorithms.md,
"The policy loss shared by all of them").

    attn_implementation     the attention backend for a model (flash_attention_2 on CUDA when installed)
    init_sharded_model      meta-device build + rank-0 load and broadcast: no rank holds more than its shard
    to_device               the worker's device boundary: one micro-batch in, results back to the host
    shard_fsdp2             FSDP2 `fully_shard` of every decoder layer (the model's _no_split_modules), then the root
    fsdp_mixed_precision    the FSDP2 precision policy: bf16 params / fp32 reduce on CUDA by default, none on CPU
    build_adamw, build_lr_scheduler, move_optimizer_state
    clip_grad_and_step      clip the global gradient norm, step, skip the step on a non-finite norm
    maybe_reshard           free the unsharded parameters FSDP2 keeps after a no_grad forward
    response_forward, unpack, packing_supported   logits at the response slots, padded or packed
    global_loss_counts, TokenWeightedMeans        the mini-batch normalisation and metric means

use_remove_padding (packed sequences). The valid tokens of all rows are concatenated into one row
with position_ids restarting at 0 and attention_mask=None. transformers (checked in 5.19:
masking_utils.find_packed_sequence_indices, called by create_causal_mask) infers the sequence
boundaries from the position_ids and builds a block-diagonal causal mask for sdpa, eager and flex
attention; flash_attention_2/3 take the varlen path from the same position_ids. So packing works
on CPU with sdpa and equals the padded forward (tests check this). The transformers docs recommend
flash attention for packing, and for a reason: with sdpa the packed row gets a dense N×N mask (N =
valid tokens of the micro-batch), so packing saves the MLP/lm-head work on padding, but attention
then costs N² instead of B·S² (more whenever N > S·√B) plus N² mask memory. On CPU it pays only
for very unequal row lengths; on GPU use flash_attention_2. Other attention backends (custom
kernels without that mask logic) fall back to padded batches with a one-time warning, as do rows
whose position_ids do not run 0..L−1.

use_prefix_sharing (with use_remove_padding): the packed row is the rows' prefix tree instead of
their concatenation (verl_arpo.utils.prefix_packing), passed with an explicit [1, 1, N, N] tree
mask; a prompt shared by a group's n rows, and ARPO branches' shared response prefix, are
computed once. sdpa and eager only (prefix_sharing_supported).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist

from verl_arpo.utils.job_config import OptimConfig, resolve_model_dtype
from verl_arpo.utils.prefix_packing import ancestor_mask, build_prefix_tree

logger = logging.getLogger(__name__)

__all__ = ["attn_implementation", "load_causal_lm", "init_sharded_model", "to_device", "module_device", "memory_metrics", "HOST_MEMORY", "warn_if_dense_packing",
           "release_host_memory", "shard_fsdp2", "fsdp_mixed_precision", "build_adamw", "build_lr_scheduler",
           "move_optimizer_state", "clip_grad_and_step", "maybe_reshard", "response_forward", "unpack",
           "packing_supported", "global_loss_counts", "TokenWeightedMeans", "PACKING_ATTN_IMPLEMENTATIONS", "warn_once"]


# --------------------------------------------------------------------------------------------
# Model building and sharding
# --------------------------------------------------------------------------------------------
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
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        tm = target_modules if isinstance(target_modules, str) else list(target_modules)
        model = get_peft_model(model, LoraConfig(r=int(lora_rank), lora_alpha=int(lora_alpha), target_modules=tm,
                                                 bias="none", task_type="CAUSAL_LM"))
    return model


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


def _read_hwm() -> int | None:
    """This process's resident high-water mark in bytes (VmHWM); None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the resident high-water mark to the current RSS
    except OSError:  # a kernel or sandbox without the reset: peaks then run from the process start
        pass


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


class HostMemoryPhases:
    """Resident host memory per named phase of a worker (docs/gpu.md, "Host memory").

    The kernel keeps one high-water mark per process (VmHWM), which /proc/self/clear_refs resets to the
    current RSS. At every phase boundary the mark is read, folded into the running peak of each open
    phase (phases nest: "update" holds "update/backward") and of the window that `memory_metrics`
    reports, then reset. A phase reports its resident memory at entry and its peak; peak − entry is
    what the phase itself allocates. One instance per process: `HOST_MEMORY`. Because the phases
    reset VmHWM, code that wants a peak across them reads `HOST_MEMORY.take_window_peak()`, not VmHWM.
    """

    def __init__(self) -> None:
        self._open: list[str] = []
        self.entry: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.window_peak = 0
        self.device: dict[str, tuple[int, int]] = {}  # top-level phase -> device bytes used at entry, at exit

    def _fold(self) -> None:
        hwm = _read_hwm()
        if hwm is None:
            return
        self.window_peak = max(self.window_peak, hwm)
        for name in self._open:
            self.peak[name] = max(self.peak.get(name, 0), hwm)
        _reset_hwm()

    @contextlib.contextmanager
    def phase(self, name: str):
        """The span of `name`; repeated spans of one name (micro-batches) keep the first entry and the
        largest peak until `metrics()` hands them out."""
        self._fold()  # what came before belongs to the phases already open
        rss = _rss()
        if rss is not None:
            self.entry.setdefault(name, rss)
        # the device as the driver sees it (vLLM's own pools included), for top-level phases only: a
        # reading synchronises the device, which is cheap per phase and not per micro-batch
        dev_entry = _device_used() if "/" not in name else None
        self._open.append(name)
        try:
            yield
        finally:
            self._fold()
            self._open.remove(name)
            if dev_entry is not None:
                self.device[name] = (self.device.get(name, (dev_entry,))[0], _device_used())

    def metrics(self) -> dict[str, float]:
        """perf/cpu_memory_peak_gb/<phase> and perf/cpu_memory_entry_gb/<phase> of every phase closed
        since the last call (then forgotten)."""
        done = [n for n in self.peak if n not in self._open]
        out = {f"perf/cpu_memory_peak_gb/{n}": self.peak.pop(n) / 2**30 for n in done}
        out.update({f"perf/cpu_memory_entry_gb/{n}": self.entry.pop(n) / 2**30 for n in done if n in self.entry})
        for n in [n for n in self.device if n not in self._open]:  # CUDA only: perf/gpu_memory_{entry,exit}_gb/<phase>
            entry, exit_ = self.device.pop(n)
            out[f"perf/gpu_memory_entry_gb/{n}"], out[f"perf/gpu_memory_exit_gb/{n}"] = entry / 2**30, exit_ / 2**30
        return out

    def take_window_peak(self) -> int | None:
        """The resident peak since the last call (then a new window starts); None without /proc."""
        self._fold()
        peak, self.window_peak = self.window_peak, 0
        return peak or None


HOST_MEMORY = HostMemoryPhases()


def _device_used() -> int | None:
    """Bytes in use on this process's CUDA device as the driver reports them (other processes' and
    vLLM's allocations included); None where CUDA is not in use."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def memory_metrics(device: torch.device) -> dict[str, float]:
    """verl's memory metrics of this worker: perf/max_memory_allocated_gb and perf/max_memory_reserved_gb
    (device peaks since the last call, which resets them; CUDA only), perf/cpu_memory_used_gb (this
    process's resident host memory now) and perf/cpu_memory_peak_gb (its resident peak since the last
    call; Linux only), plus the per-phase host peaks of `HOST_MEMORY` closed since the last call."""
    out = {}
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    rss, peak = _rss(), HOST_MEMORY.take_window_peak()
    if rss is not None:
        out["perf/cpu_memory_used_gb"] = rss / 2**30
    if peak is not None:
        out["perf/cpu_memory_peak_gb"] = peak / 2**30
    out.update(HOST_MEMORY.metrics())
    return out


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc `malloc_trim(0)`; a no-op elsewhere).

    Tensors of a few MB come from malloc's heap, and freed chunks in its middle stay resident: over
    the quickstart's steps a worker grew 2.9 → 4.5 GB with nothing alive to show for it; with a trim
    after each update it stayed at 2.0–2.1 GB (docs/gpu.md, "Host memory"). Workers call it at the
    end of every phase."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim this way
        pass


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's (local) parameters; the host for a module without parameters."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def model_dtype(value: str | None, trained: bool, device_type: str) -> torch.dtype:
    """The torch dtype of job_config.resolve_model_dtype: the weights as loaded and sharded."""
    return getattr(torch, resolve_model_dtype(value, trained, device_type))


def fsdp_mixed_precision(mixed_precision: dict | None, device_type: str):
    """The FSDP2 MixedPrecisionPolicy: `mixed_precision` ({param_dtype, reduce_dtype}, each optional), or
    on CUDA bf16 params with fp32 gradient reduction; None (plain fp32) on CPU without a setting."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type != "cuda" and not mixed_precision:
        return None
    mp = mixed_precision or {}
    return MixedPrecisionPolicy(param_dtype=getattr(torch, mp.get("param_dtype", "bfloat16")),
                                reduce_dtype=getattr(torch, mp.get("reduce_dtype", "float32")))


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


# --------------------------------------------------------------------------------------------
# Optimizer, schedule, step
# --------------------------------------------------------------------------------------------
def build_adamw(params: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that train (requires_grad)."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=float(optim.lr), betas=tuple(optim.betas),
                             eps=float(optim.eps), weight_decay=float(optim.weight_decay))


def move_optimizer_state(optimizer, device: torch.device | None) -> None:
    """Move AdamW moments to `device` (optimizer_offload: the host between updates), or with None back
    to the device of each one's parameter — the host too when param_offload keeps the parameters
    there: a moment on another device than its parameter breaks the step."""
    for param, state in optimizer.state.items():
        target = param.device if device is None else device
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step" and value.device != target:
                state[key] = value.to(target, non_blocking=True)


def build_lr_scheduler(optimizer, optim_cfg: OptimConfig, total_steps: int):
    """Linear warmup, then constant or cosine (to min_lr_ratio·lr)."""
    total = max(1, int(total_steps or 1))
    warmup = int(optim_cfg.lr_warmup_steps or -1)
    if warmup < 0:
        warmup = int(float(optim_cfg.lr_warmup_steps_ratio or 0.0) * total)
    style = optim_cfg.warmup_style
    floor = float(optim_cfg.min_lr_ratio or 0.0)
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



# --------------------------------------------------------------------------------------------
# Response forward, loss normalisation, metrics
# --------------------------------------------------------------------------------------------
# Attention backends whose transformers mask/varlen logic detects packed rows from position_ids.
PACKING_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
_warned: set[str] = set()


def warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg)


def packing_supported(module: torch.nn.Module) -> tuple[bool, str]:
    """Whether packed rows (attention_mask=None, restarting position_ids) are masked correctly."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return False, "transformers is not importable"
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return False, "this transformers version does not infer packed sequences from position_ids"
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if attn not in PACKING_ATTN_IMPLEMENTATIONS:
        return False, f"attn_implementation {attn!r} does not separate packed sequences"
    return True, ""


def warn_if_dense_packing(module: torch.nn.Module, device: torch.device) -> None:
    """Packing on CUDA without flash attention: transformers builds a dense N×N block mask for sdpa,
    so attention costs N² over the packed tokens instead of B·S² — warn once, loudly (install
    flash-attn, README "Install on a GPU machine", or set use_remove_padding=False)."""
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if device.type == "cuda" and attn not in ("flash_attention_2", "flash_attention_3"):
        warn_once("dense_packing", "!" * 78 + f"\nuse_remove_padding=True with attn_implementation={attn!r} on CUDA: packed "
                  "rows get a dense N x N attention mask (N = tokens of a micro-batch), which costs more than the "
                  "padding it saves. Install flash-attn (pip install flash-attn --no-build-isolation) or set "
                  "actor_rollout_ref.model.use_remove_padding=False.\n" + "!" * 78)


def prefix_sharing_supported(module: torch.nn.Module) -> tuple[bool, str]:
    """Whether the attention backend takes our [1, 1, N, N] tree mask (use_prefix_sharing): sdpa
    and eager do; flash attention's varlen kernels only know block-diagonal masks."""
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        return False, f"attn_implementation {attn!r} takes no custom tree mask (sdpa and eager do)"
    return True, ""


def _pack(micro, response_length: int, share_prefix: bool = False) -> dict | None:
    """Flatten the valid tokens of a padded micro-batch into one packed row.

    Returns input_ids/position_ids [1, N], `attention_mask` (None: transformers infers the
    block-diagonal mask from the restarting position_ids; with `share_prefix`, the [1, 1, N, N]
    tree mask of verl_arpo.utils.prefix_packing, whose nodes hold each shared prefix once),
    `keep` [B, R] (response slot holds a real token) and `keep_idx` [K] (packed index of the token
    *before* each kept response token, whose logits score it); None when a row's position_ids are
    not 0..L−1 (boundaries would be ambiguous).
    """
    mask = micro["attention_mask"].bool()
    pos = micro["position_ids"]
    expected = mask.long().cumsum(-1) - 1
    if not torch.equal(pos[mask], expected[mask]):
        return None
    if share_prefix:
        tree = build_prefix_tree(micro["input_ids"], mask)
        node_index = tree.node_index
        input_ids, position_ids = tree.tokens.unsqueeze(0), tree.depth.unsqueeze(0)
        attention_mask = ancestor_mask(tree)[None, None]
    else:
        node_index = (mask.flatten().long().cumsum(0) - 1).view(mask.shape)
        input_ids, position_ids, attention_mask = micro["input_ids"][mask].unsqueeze(0), pos[mask].unsqueeze(0), None
    s, r = mask.shape[1], response_length
    keep = mask[:, s - r:]
    keep_idx = node_index[:, s - r - 1:s - 1][keep]
    return dict(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, keep=keep,
                keep_idx=keep_idx)


def _as_attention_bias(mask: torch.Tensor | None, module: torch.nn.Module) -> torch.Tensor | None:
    """eager attention adds its mask to the scores: a bool tree mask becomes 0 / −inf (sdpa takes bool)."""
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if mask is None or attn != "eager":
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~mask, torch.finfo(torch.float32).min)


def response_forward(module: torch.nn.Module, micro, response_length: int, use_remove_padding: bool,
                     causal_lm: bool = True, share_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Run `module` and return the logits that score the response slots.

    Returns (logits, keep, packed): padded → logits [B, R, C] for positions −R−1:−1; packed →
    logits [K, C] for the kept slots only (scatter back with `unpack`). keep [B, R] marks response
    slots holding real tokens (attention_mask); outputs at other slots are set to 0 by callers.
    `causal_lm` asks the model for only the needed logits (`logits_to_keep`), which a token
    classification head does not accept. `share_prefix` (with use_remove_padding) computes each
    prefix several rows share once (use_prefix_sharing; the module must pass
    `prefix_sharing_supported`).
    """
    r = response_length
    packed = _pack(micro, r, share_prefix) if use_remove_padding else None
    if use_remove_padding and packed is None:
        warn_once("pos", "use_remove_padding: position_ids are not 0..L-1 per row; using padded batches")
    if packed is not None:
        extra = {"logits_to_keep": packed["keep_idx"]} if causal_lm else {}
        out = module(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                     attention_mask=_as_attention_bias(packed["attention_mask"], module), use_cache=False, **extra)
        logits = out.logits[0] if causal_lm else out.logits[0, packed["keep_idx"]]
        return logits, packed["keep"], True
    s = micro["input_ids"].shape[1]
    extra = {"logits_to_keep": r + 1} if causal_lm else {}
    out = module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro["position_ids"], use_cache=False, **extra)
    logits = out.logits[:, -r - 1:-1] if causal_lm else out.logits[:, s - r - 1:s - 1]
    return logits, micro["attention_mask"][:, s - r:].bool(), False


def unpack(values: torch.Tensor, keep: torch.Tensor, packed: bool) -> torch.Tensor:
    """[K] packed or [B, R] padded per-slot values → [B, R], zero where `keep` is False."""
    if packed:
        out = values.new_zeros(keep.shape)
        return out.masked_scatter(keep, values)
    return values * keep.to(values.dtype)


def maybe_reshard(module: torch.nn.Module) -> None:
    """FSDP2 leaves the root unsharded after a no_grad forward; reshard so the next
    state-dict/weight-sync sees sharded parameters and the memory is freed."""
    if hasattr(module, "reshard"):
        module.reshard()


def _dp_size(dp_group) -> int:
    return dist.get_world_size(dp_group) if dist.is_available() and dist.is_initialized() else 1


def global_loss_counts(response_mask: torch.Tensor, dp_group=None) -> dict:
    """agg_loss kwargs for one mini-batch: valid tokens and valid sequences summed over the
    data-parallel group (when torch.distributed is initialized), and dp_size."""
    counts = torch.stack([response_mask.sum(), (response_mask.sum(-1) > 0).sum()]).to(torch.float64)
    dp_size = _dp_size(dp_group)
    if dp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    return dict(dp_size=dp_size, batch_num_tokens=counts[0].item(), global_batch_size=counts[1].item())


def clip_grad_and_step(module: torch.nn.Module, optimizer, grad_clip: float | None, name: str) -> float:
    """Clip the global gradient norm and step; skip the step (with a warning) on a non-finite norm.

    torch.nn.utils.clip_grad_norm_ works on FSDP2 DTensor gradients: the norm comes back as a
    DTensor with a partial placement, whose `full_tensor()` is the global norm (identical on every
    rank, so every rank makes the same skip decision). Returns the norm before clipping.
    """
    max_norm = float(grad_clip) if grad_clip is not None and grad_clip > 0 else math.inf
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if math.isfinite(norm):
        optimizer.step()
    else:
        logger.warning("%s: grad_norm is %s; skipping this optimizer step", name, norm)
    optimizer.zero_grad(set_to_none=True)
    return norm


class TokenWeightedMeans:
    """Token-weighted running means of micro-batch metrics → exact mini-batch masked means."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weight = 0.0

    def add(self, weight: float, **values: float) -> None:
        self.weight += weight
        for k, v in values.items():
            self.sums[k] += float(v) * weight

    def means(self) -> dict[str, float]:
        return {k: v / max(self.weight, 1.0) for k, v in self.sums.items()}
