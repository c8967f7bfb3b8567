"""Ulysses sequence parallelism for the training forward (docs/sequence_parallel.md): the model's own
attention modules, run with a wrapper around their attention kernel, on 1/S of a packed sequence.

    use_sequence_parallel      the actor's / critic's set-up: packed sequences required, attention switched
    enable_ulysses_attention   switch a transformers model to the sequence-parallel attention function
    shard_packed               this rank's 1/S of a packed micro-batch, and which rank scores each slot
    gather_group_data          the S data shares of an sp group → the group's one batch, on every rank
    local_rows                 this rank's share of an output computed on the group's batch

How one forward runs on the S ranks of an sp group (every rank holds the same packed micro-batch):
1. `shard_packed` pads the packed row to a multiple of S tokens and gives rank s tokens
   [s·n, (s+1)·n). Embeddings, norms, MLPs and the rotary embedding (from the global position_ids
   of those tokens) are per token, so they run on the shard unchanged.
2. In every attention layer, the model's own module computes q, k, v for its n tokens and calls
   `ulysses_attention` (registered with transformers' AttentionInterface, so no model code is
   forked): an all-to-all turns [all heads, n tokens] into [H/S heads, all S·n tokens], the kernel
   runs on the whole sequence — flash attention's varlen path from the global position_ids on a GPU
   with flash-attn; on the CPU causal sdpa row by row (the same, with no N × N mask), or sdpa with the
   prefix tree's mask under use_prefix_sharing —, and the inverse all-to-all returns [all heads, n tokens].
   Heads: q and kv heads are split in S groups; when the kv heads do not split (grouped-query
   attention with fewer kv heads than S, or a count not divisible by S) they are repeated to one
   per query head, and when the query heads do not split, zero heads pad them (their output is
   dropped) — SmolLM2-135M's 9 heads run at S = 2.
3. Each rank scores the response slots whose scoring token it holds (the logits of the token before
   a response token), and `verl_arpo.utils.ulysses.gather_slots` gives every rank the log-probs,
   entropies or values of all slots; the loss is computed from those, the same on every rank.

The attention function reads the current micro-batch's global position_ids and mask from this
module's state, set by `shard_packed` and kept until the next forward: a non-reentrant gradient
checkpoint recomputes attention during the backward, after the forward has returned.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verl_arpo.protocol import DataProto
from verl_arpo.utils.ulysses import SequenceParallel, seq_all_to_all

__all__ = ["ATTENTION_NAME", "SP_INNER_ATTENTION", "attention_kernel", "enable_ulysses_attention", "use_sequence_parallel", "shard_packed", "SequenceShard",
           "gather_group_data", "local_rows"]

ATTENTION_NAME = "verl_arpo_ulysses"
"""The name the wrapper is registered under in transformers' AttentionInterface."""
SP_INNER_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
"""The kernels the wrapper runs on the whole sequence: sdpa (eager computes the same), or flash attention's
varlen path."""


@dataclass
class _Current:
    """The micro-batch being run: what every attention layer needs beyond its own q, k, v."""

    sp: SequenceParallel | None = None
    inner: str = "sdpa"
    position_ids: torch.Tensor | None = None  # [1, N] global, for flash's varlen boundaries
    mask: torch.Tensor | None = None          # [1, 1, N, N] bool: the prefix tree's, or None
    rows: list[tuple[int, int]] | None = None  # [start, end) of each packed row (where positions restart)


_CURRENT = _Current()


def _packed_rows(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each packed row: a row starts where position_ids restart at 0."""
    starts = (position_ids[0] == 0).nonzero().flatten().tolist()
    return list(zip(starts, starts[1:] + [position_ids.shape[1]]))


def _split_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int):
    """Head layouts that split over s ranks with each rank's q heads using only its own kv heads.
    Returns q, k, v [B, H', n, D] and the number of real q heads."""
    hq, hkv = q.shape[1], k.shape[1]
    if hkv % s or hq % s:
        groups = hq // hkv   # q head h uses kv head h // groups: repeat each kv head `groups` times
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    pad = -hq % s
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    return q, k, v, hq


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The AttentionInterface function: q [B, Hq, n, D], k/v [B, Hkv, n, D] of this rank's tokens →
    (attn_output [B, n, Hq, D], None), attention taken over the whole sequence of the sp group.
    Outside a sequence-parallel forward (no state) it is the inner kernel on what it is given."""
    cur = _CURRENT
    sp = cur.sp
    if sp is None or not sp.enabled:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = "sdpa" if cur.inner == "eager" else cur.inner  # the same attention
        return ALL_ATTENTION_FUNCTIONS[inner](module, query, key, value, attention_mask, scaling=scaling,
                                                  dropout=dropout, **kwargs)
    q, k, v, hq = _split_heads(query, key, value, sp.size)
    q, k, v = (seq_all_to_all(t, sp, scatter_dim=1, gather_dim=2) for t in (q, k, v))
    if cur.inner.startswith("flash_attention"):
        from transformers.integrations.flash_attention import flash_attention_forward

        kwargs["position_ids"] = cur.position_ids  # varlen boundaries of the whole packed row
        out, _ = flash_attention_forward(_kernel_view(module, cur.inner), q, k, v, None, scaling=scaling,
                                         dropout=dropout, **kwargs)
        out = out.transpose(1, 2)  # [B, N, H/S, D] → [B, H/S, N, D]
    elif cur.mask is not None:  # the prefix tree: its own N x N mask
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=cur.mask, dropout_p=dropout, scale=scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:  # flash attention's varlen, row by row: causal sdpa per packed row keeps memory O(N), no N x N mask
        gqa = q.shape[1] != k.shape[1]
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout,
                                                        scale=scaling, is_causal=True, enable_gqa=gqa)
                         for a, b in cur.rows], dim=2)
    out = seq_all_to_all(out, sp, scatter_dim=2, gather_dim=1)  # [B, H', n, D]
    return out[:, :hq].transpose(1, 2).contiguous(), None


class _KernelView:
    """An attention module as transformers' flash path sees it: the module itself, but its config names
    the inner kernel. transformers' `flash_attention_forward` loads the kernel named by
    `module.config._attn_implementation`, which under the wrapper is ATTENTION_NAME, no flash kernel:
    "Could not find the currently requested flash attention implementation" at the first forward
    (issue 48; verl patches the flash function instead of renaming the implementation)."""

    __slots__ = ("_module", "config")

    def __init__(self, module: torch.nn.Module, inner: str):
        config = copy.copy(module.config)
        config._attn_implementation = inner
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "config", config)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


_VIEWS: "weakref.WeakKeyDictionary[torch.nn.Module, _KernelView]" = weakref.WeakKeyDictionary()


def _kernel_view(module: torch.nn.Module, inner: str) -> _KernelView:
    view = _VIEWS.get(module)
    if view is None or view.config._attn_implementation != inner:
        view = _VIEWS[module] = _KernelView(module, inner)
    return view


def attention_kernel(module: torch.nn.Module) -> str | None:
    """The attention kernel a model runs: its attn_implementation, or the one inside the Ulysses wrapper."""
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return _CURRENT.inner if attn == ATTENTION_NAME else attn


def _pretrained(module: torch.nn.Module):
    from transformers import PreTrainedModel

    for m in module.modules():  # the model itself, or the one inside a peft wrapper
        if isinstance(m, PreTrainedModel):
            return m
    raise TypeError(f"ulysses_sequence_parallel_size > 1 needs a transformers model, got {type(module).__name__}")


def enable_ulysses_attention(module: torch.nn.Module, sp: SequenceParallel, where: str) -> None:
    """Route every attention layer of `module` through `ulysses_attention` (a no-op at S = 1).
    The model's attention implementation becomes the kernel the wrapper calls on the whole
    sequence; `where` names the config key in errors."""
    if not sp.enabled:
        return
    from transformers import AttentionInterface

    model = _pretrained(module)
    inner = model.config._attn_implementation
    if inner == ATTENTION_NAME:
        return
    if inner not in SP_INNER_ATTENTION:
        raise ValueError(f"{where}.ulysses_sequence_parallel_size={sp.size} runs attention through sdpa or flash "
                         f"attention, not {inner!r}: set actor_rollout_ref.model.attn_implementation (or "
                         "critic.model.attn_implementation) to sdpa or flash_attention_2")
    if _CURRENT.sp is not None and _CURRENT.inner != inner:
        raise ValueError(f"{where}: one process runs one attention kernel under sequence parallelism "
                         f"({_CURRENT.inner!r} already, {inner!r} asked)")
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    _CURRENT.inner = inner


def use_sequence_parallel(module: torch.nn.Module, sp: SequenceParallel | None, packed: bool, where: str,
                          model_where: str) -> SequenceParallel | None:
    """The actor's and the critic's set-up: None without sequence parallelism (S = 1); else `sp`, once
    the model's attention runs through the wrapper. Packed sequences are what the S ranks split, so
    `packed` (use_remove_padding) is required; `where`/`model_where` name the config sections."""
    if sp is None or not sp.enabled:
        return None
    if not packed:
        raise ValueError(f"{where}.ulysses_sequence_parallel_size={sp.size} splits packed sequences: set "
                         f"{model_where}.use_remove_padding=true")
    enable_ulysses_attention(module, sp, where)
    return sp


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of a packed micro-batch: `input_ids`/`position_ids` [1, n], and for the K
    scored slots (the packed `keep_idx`): `owner` [K] (the sp rank holding each slot's scoring token)
    and `local_idx` [K_s] (this rank's slots, as indices into its n tokens)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    owner: torch.Tensor
    local_idx: torch.Tensor


def shard_packed(packed: dict, sp: SequenceParallel) -> SequenceShard:
    """Pad a packed micro-batch (training_core's packed dict: [1, N] ids and positions, the optional
    [1, 1, N, N] tree mask, keep_idx [K]) to a multiple of S tokens, make it the current micro-batch
    of the attention wrapper, and return this rank's share. The padding tokens form their own row
    (positions 0, 1, ...; with a tree mask, each sees itself only) and score nothing."""
    ids, pos, mask = packed["input_ids"], packed["position_ids"], packed["attention_mask"]
    n_tok = ids.shape[1]
    pad = -n_tok % sp.size
    if pad:
        ids = F.pad(ids, (0, pad))
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)[None]], dim=1)
        if mask is not None:
            grown = torch.eye(n_tok + pad, dtype=torch.bool, device=mask.device)[None, None]
            grown[..., :n_tok, :n_tok] = mask
            mask = grown
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError("shard_packed: the tree mask must be bool (sdpa's form)")
    n = ids.shape[1] // sp.size
    _CURRENT.sp, _CURRENT.position_ids, _CURRENT.mask = sp, pos, mask
    _CURRENT.rows = _packed_rows(pos) if mask is None else None
    owner = torch.div(packed["keep_idx"], n, rounding_mode="floor")
    lo = sp.rank * n
    return SequenceShard(input_ids=ids[:, lo:lo + n], position_ids=pos[:, lo:lo + n], owner=owner,
                         local_idx=packed["keep_idx"][owner == sp.rank] - lo)


# --------------------------------------------------------------------------------------------
# the data of an sp group
# --------------------------------------------------------------------------------------------
def gather_group_data(data: DataProto, sp: SequenceParallel) -> tuple[DataProto, list[int]]:
    """The S shares the dispatcher gave the ranks of this sp group, concatenated in sp-rank order, on
    every rank of the group (verl's Ulysses sharding manager does the same): the group computes one
    batch. Returns it and the shares' sizes (for `local_rows`). A no-op at S = 1."""
    if not sp.enabled:
        return data, [len(data)]
    import torch.distributed as dist

    shares: list = [None] * sp.size
    dist.all_gather_object(shares, data, group=sp.group)
    return DataProto.concat(shares), [len(s) for s in shares]


def local_rows(out: DataProto, sizes: list[int], sp: SequenceParallel) -> DataProto:
    """This rank's rows of an output computed on `gather_group_data`'s batch: what it returns to
    the dispatcher, which collects every rank's (a no-op at S = 1)."""
    if not sp.enabled:
        return out
    start = sum(sizes[: sp.rank])
    return out.slice(start, start + sizes[sp.rank])
