"""The training forward every trainer here shares (the PPO actor, the critic and SFT) and its loss
normalisation (docs/algorithms.md, "The policy loss shared by all of them"). Building and sharding the
model: sharded_model.py; the optimizer step: optim_step.py; memory: host_memory.py.

    response_forward, ResponseLogits, unpack     logits at the response slots: padded, packed or sequence-parallel
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
their concatenation (verl_arpo.utils.prefix_packing), passed with an explicit tree mask; a prompt
shared by a group's n rows, and ARPO branches' shared response prefix, are computed once. sdpa
and eager take the [1, 1, N, N] mask; flex_attention takes a BlockMask of the same relation
(k ≤ q < end(k), prefix_packing.visibility_ends), whose empty 128 × 128 blocks it skips: neither
the N² mask nor N² attention work (prefix_sharing_supported).

On CUDA without flash-attn, attn_implementation=flex_attention is the block-sparse packed path
for both packing (transformers builds its BlockMask from the restarting position_ids) and
prefix sharing (docs/gpu.md, "Packed sequences without flash-attn").
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_arpo.utils.device import without_cudnn_attention
from verl_arpo.utils.prefix_packing import ancestor_mask, build_prefix_tree, visibility_ends
from verl_arpo.utils.ulysses import SequenceParallel, gather_slots
from verl_arpo.workers.sequence_parallel import SequenceShard, attention_kernel, shard_packed

logger = logging.getLogger(__name__)

__all__ = ["response_forward", "ResponseLogits", "unpack", "packing_supported", "prefix_sharing_supported", "warn_if_dense_packing",
           "global_loss_counts", "TokenWeightedMeans", "PACKING_ATTN_IMPLEMENTATIONS",
           "PREFIX_SHARING_ATTN_IMPLEMENTATIONS", "tree_block_mask", "check_trainable_attention", "warn_once"]


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
    attn = attention_kernel(module)
    if attn not in PACKING_ATTN_IMPLEMENTATIONS:
        return False, f"attn_implementation {attn!r} does not separate packed sequences"
    return True, ""


def warn_if_dense_packing(module: torch.nn.Module, device: torch.device) -> None:
    """Packing on CUDA without flash attention: transformers builds a dense N×N block mask for sdpa,
    so attention costs N² over the packed tokens instead of B·S² — warn once, loudly (flex_attention,
    flash-attn (README "Install on a GPU machine"), or use_remove_padding=False)."""
    attn = attention_kernel(module)
    if device.type == "cuda" and attn not in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        warn_once("dense_packing", "!" * 78 + f"\nuse_remove_padding=True with attn_implementation={attn!r} on CUDA: packed "
                  "rows get a dense N x N attention mask (N = tokens of a micro-batch), which costs more than the "
                  "padding it saves. Set actor_rollout_ref.model.attn_implementation=flex_attention (block-sparse, "
                  "in torch), install flash-attn (pip install flash-attn --no-build-isolation), or set "
                  "actor_rollout_ref.model.use_remove_padding=False.\n" + "!" * 78)


PREFIX_SHARING_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
"""Attention backends that take the prefix tree's mask: sdpa and eager as an [1, 1, N, N] mask (also inside
the Ulysses wrapper), flex_attention as a BlockMask; flash attention's varlen kernels know only
block-diagonal masks."""


def prefix_sharing_supported(module: torch.nn.Module) -> tuple[bool, str]:
    """Whether the attention backend takes our tree mask (use_prefix_sharing)."""
    attn = attention_kernel(module)
    if attn not in PREFIX_SHARING_ATTN_IMPLEMENTATIONS:
        return False, f"attn_implementation {attn!r} takes no custom tree mask (sdpa, eager and flex_attention do)"
    return True, ""


def check_trainable_attention(module: torch.nn.Module, device: torch.device, where: str) -> None:
    """FlexAttention has a forward on the CPU but no backward (torch 2.13 raises at the first forward
    with grad): refuse a CPU trainer with it when it is built, naming the key (`where`)."""
    if device.type == "cpu" and attention_kernel(module) == "flex_attention":
        raise ValueError(f"{where}.attn_implementation=flex_attention trains only on CUDA (FlexAttention has no CPU "
                         f"backward): set {where}.attn_implementation=sdpa on the CPU")


def tree_block_mask(depth: torch.Tensor, block_size: int = 128):
    """FlexAttention's BlockMask of a depth-first packed row (a prefix tree, or packed rows): node q
    attends to node k iff k ≤ q < end(k) (prefix_packing.visibility_ends). Blocks no pair reaches are
    skipped by the kernel. The block table comes straight from `end`, O(N) work and memory:
    `create_block_mask` without compilation evaluates the mask on all N × N pairs (~0.6 GiB at N = 8192).

    For query block i (q in [iB, q_hi_i]) and key block j (k in [jB, k_hi_j]), B = `block_size`:
    - i < j: every k > every q, nothing visible; i = j: k = q is visible;
    - i > j: every k < every q, so some pair is visible iff max_j end(k) > iB;
    - a block is *full* (no mask needed) iff both blocks are whole, i > j and min_j end(k) > q_hi_i;
      like `create_block_mask`, a block cut by the end of the row is never full.
    """
    from torch.nn.attention.flex_attention import BlockMask

    ends = visibility_ends(depth)
    n = int(depth.numel())
    nb = -(-n // block_size)
    dev = depth.device
    # positions past the row's end get end(k) = k (they see nothing), so max/min run over whole blocks
    padded = torch.cat([ends, torch.arange(n, nb * block_size, device=dev)]).view(nb, block_size)
    max_end, min_end = padded.max(-1).values, padded.min(-1).values
    blk = torch.arange(nb, device=dev)
    q_lo, q_hi = blk * block_size, torch.clamp((blk + 1) * block_size, max=n) - 1
    whole = (blk + 1) * block_size <= n
    below = blk[:, None] > blk[None, :]   # [i, j]: query block after key block
    any_visible = (blk[:, None] == blk[None, :]) | (below & (max_end[None, :] > q_lo[:, None]))
    full = below & whole[:, None] & whole[None, :] & (min_end[None, :] > q_hi[:, None])
    partial = any_visible & ~full

    def ordered(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks per query block, their key-block indices first, ascending): BlockMask's layout."""
        t = table.to(torch.int32)
        return t.sum(-1)[None, None].contiguous(), torch.argsort(t, dim=-1, descending=True, stable=True).to(
            torch.int32)[None, None].contiguous()

    def visible(b, h, q, kv):
        return (kv <= q) & (q < ends[kv])

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=visible,
                                    seq_lengths=(n, n))


def _pack(micro, response_length: int, share_prefix: bool = False, kernel: str | None = None) -> dict | None:
    """Flatten the valid tokens of a padded micro-batch into one packed row.

    Returns input_ids/position_ids [1, N], `attention_mask` (None: transformers infers the
    block-diagonal mask from the restarting position_ids; with `share_prefix`, the tree mask of
    verl_arpo.utils.prefix_packing, whose nodes hold each shared prefix once: a BlockMask when
    `kernel` is flex_attention, else [1, 1, N, N] bool),
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
        attention_mask = (tree_block_mask(position_ids[0]) if kernel == "flex_attention"
                          else ancestor_mask(tree)[None, None])
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
    if mask is None or attn != "eager" or not isinstance(mask, torch.Tensor):
        return mask
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~mask, torch.finfo(torch.float32).min)


@dataclass(frozen=True)
class ResponseLogits:
    """What `response_forward` returns: the logits that score the response slots this rank computed.

    logits: padded [B, R, C] (positions −R−1:−1), packed [K_s, C] (this rank's kept slots; all K
    without sequence parallelism). keep [B, R]: slots holding real tokens. Per-slot values computed
    from the logits go back to [B, R] with `to_slots`; the tokens they score are `labels(responses)`."""

    logits: torch.Tensor
    keep: torch.Tensor
    packed: bool
    shard: SequenceShard | None = None
    sp: SequenceParallel | None = None

    def labels(self, responses: torch.Tensor) -> torch.Tensor:
        """The response tokens the logits score, in the logits' layout."""
        if not self.packed:
            return responses
        kept = responses[self.keep]
        return kept if self.shard is None else kept[self.shard.owner == self.sp.rank]

    def to_slots(self, values: torch.Tensor) -> torch.Tensor:
        """Per-slot values in the logits' layout → [B, R], zero where `keep` is False; under sequence
        parallelism every rank gets every slot's value (ulysses.gather_slots, differentiable)."""
        if self.shard is not None:
            values = gather_slots(values, self.shard.owner, self.sp)
        return unpack(values, self.keep, self.packed)


def response_forward(module: torch.nn.Module, micro, response_length: int, use_remove_padding: bool,
                     causal_lm: bool = True, share_prefix: bool = False,
                     sp: SequenceParallel | None = None) -> ResponseLogits:
    """Run `module` and return the logits that score the response slots (`ResponseLogits`).

    `causal_lm` asks the model for only the needed logits (`logits_to_keep`), which a token
    classification head does not accept. `share_prefix` (with use_remove_padding) computes each
    prefix several rows share once (use_prefix_sharing; the module must pass
    `prefix_sharing_supported`). `sp` with S > 1 (packed only): this rank runs 1/S of the packed row
    through the model's Ulysses attention (verl_arpo.workers.sequence_parallel) and scores the slots
    whose scoring token it holds.
    """
    # cuDNN attention plans every new shape, and every micro-batch has its own (docs/gpu.md)
    with without_cudnn_attention(micro["input_ids"].device):
        return _response_forward(module, micro, response_length, use_remove_padding, causal_lm, share_prefix, sp)


def _response_forward(module, micro, response_length, use_remove_padding, causal_lm, share_prefix, sp):
    r = response_length
    packed = _pack(micro, r, share_prefix, attention_kernel(module)) if use_remove_padding else None
    if use_remove_padding and packed is None:
        warn_once("pos", "use_remove_padding: position_ids are not 0..L-1 per row; using padded batches")
    if sp is not None and sp.enabled:
        if packed is None:
            raise ValueError("ulysses_sequence_parallel_size > 1 splits packed sequences: it needs "
                             "use_remove_padding=true and position_ids 0..L-1 in every row")
        shard = shard_packed(packed, sp)
        extra = {"logits_to_keep": shard.local_idx} if causal_lm else {}
        out = module(input_ids=shard.input_ids, position_ids=shard.position_ids, attention_mask=None,
                     use_cache=False, **extra)
        logits = out.logits[0] if causal_lm else out.logits[0, shard.local_idx]
        return ResponseLogits(logits, packed["keep"], True, shard, sp)
    if packed is not None:
        extra = {"logits_to_keep": packed["keep_idx"]} if causal_lm else {}
        out = module(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                     attention_mask=_as_attention_bias(packed["attention_mask"], module), use_cache=False, **extra)
        logits = out.logits[0] if causal_lm else out.logits[0, packed["keep_idx"]]
        return ResponseLogits(logits, packed["keep"], True)
    s = micro["input_ids"].shape[1]
    extra = {"logits_to_keep": r + 1} if causal_lm else {}
    out = module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro["position_ids"], use_cache=False, **extra)
    logits = out.logits[:, -r - 1:-1] if causal_lm else out.logits[:, s - r - 1:s - 1]
    return ResponseLogits(logits, micro["attention_mask"][:, s - r:].bool(), False)


def unpack(values: torch.Tensor, keep: torch.Tensor, packed: bool) -> torch.Tensor:
    """[K] packed or [B, R] padded per-slot values → [B, R], zero where `keep` is False."""
    if packed:
        out = values.new_zeros(keep.shape)
        return out.masked_scatter(keep, values)
    return values * keep.to(values.dtype)


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
