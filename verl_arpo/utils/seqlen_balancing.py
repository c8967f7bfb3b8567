"""Sequence-length balancing: token-budget micro-batches and token-balanced data-parallel shards.

Three jobs, one partitioner:

- `get_seqlen_balanced_partitions(seqlen_list, k, equal_size)` splits row indices into k groups
  whose token sums are as equal as we can cheaply make them (Karmarkar–Karp largest differencing,
  k-way; see `_ldm_partition`).
- `rearrange_micro_batches(batch, max_token_len)` cuts one (mini-)batch into micro-batches for
  `use_dynamic_bsz`: every micro-batch holds ≤ max_token_len tokens (tokens of a row =
  attention_mask.sum), except a row that alone exceeds the budget, which then forms a micro-batch
  by itself. Under torch.distributed all data-parallel ranks get the same number of micro-batches
  (`same_micro_num_in_dp`), because every FSDP forward/backward runs collectives and ranks with
  different counts would deadlock.
- `balance_batch_indices(seqlens, dp_size)` gives the trainer a row order after which
  `DataProto.chunk(dp_size)` hands every rank the same number of rows and nearly the same tokens.

With prefix sharing (`share_prefix`, actor_rollout_ref.model.use_prefix_sharing) the unit of
both partitions is a group of rows with the same prompt instead of a row, weighed by the tokens
its prefix tree holds (verl_arpo.utils.prefix_packing), so a group's rows meet in one micro-batch
on one rank and its prompt is computed once. A group whose tree exceeds the budget is cut into
row runs that fit; when another rank needs more micro-batches, groups are split further (between
prompt groups first, then between a group's rows).

`get_reverse_idx` inverts a permutation so per-micro-batch outputs go back to the input order.

What this does not do: it balances token *sums*. A padded forward costs rows × longest row, so
with `use_remove_padding=False` the compute per micro-batch is only roughly balanced.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from verl_arpo.utils.prefix_packing import tree_size, valid_rows

logger = logging.getLogger(__name__)

__all__ = [
    "get_seqlen_balanced_partitions",
    "rearrange_micro_batches",
    "get_reverse_idx",
    "balance_batch_indices",
    "split_micro_batches",
]


# --------------------------------------------------------------------------------------------
# The partitioner
# --------------------------------------------------------------------------------------------
def _ldm_partition(seqlens: Sequence[int], k: int, equal_size: bool) -> list[list[int]]:
    """k-way Karmarkar–Karp (largest differencing method) over row indices.

    Each heap entry is a partial solution: k buckets (sum, indices). Start with one entry per row
    (that row in one bucket, k−1 empty buckets) — or, with equal_size, one entry per run of k
    consecutive rows of the length-sorted list (one row per bucket). Repeatedly pop the two
    entries with the largest spread (max − min bucket sum) and merge them, pairing the heaviest
    bucket of one with the lightest of the other, which cancels their imbalances. With
    equal_size every merge adds one run to every bucket, so bucket sizes stay equal.
    """
    order = sorted(range(len(seqlens)), key=lambda i: (seqlens[i], i))
    entries: list[list[tuple[int, list[int]]]] = []
    if equal_size:
        for start in range(0, len(order), k):
            entries.append([(seqlens[i], [i]) for i in order[start:start + k]])
    else:
        for i in order:
            entries.append([(seqlens[i], [i])] + [(0, []) for _ in range(k - 1)])

    def spread(buckets: list[tuple[int, list[int]]]) -> int:
        sums = [s for s, _ in buckets]
        return max(sums) - min(sums)

    # heapq is a min-heap: key on −spread; the counter keeps ties deterministic.
    heap = [(-spread(b), n, b) for n, b in enumerate(entries)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a_desc = sorted(a, key=lambda x: -x[0])
        b_asc = sorted(b, key=lambda x: x[0])
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a_desc, b_asc)]
        heapq.heappush(heap, (-spread(merged), counter, merged))
        counter += 1
    buckets = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return [sorted(idx) for _, idx in buckets]


def get_seqlen_balanced_partitions(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Split row indices 0..n−1 into `k_partitions` non-empty groups with near-equal Σ seqlen.

    equal_size=True additionally gives every group n/k rows (n must divide by k). Groups are
    returned sorted by their smallest index; indices inside a group are ascending. Karmarkar–Karp
    largest differencing (our k-way implementation): typically within one row length of the
    optimum on real length distributions, O(n log n · k).
    """
    n = len(seqlen_list)
    if k_partitions <= 0:
        raise ValueError(f"`k_partitions` must be positive, got {k_partitions}")
    if n < k_partitions:
        raise ValueError(f"cannot split {n} rows into {k_partitions} non-empty partitions")
    if equal_size and n % k_partitions != 0:
        raise ValueError(f"equal_size partitions need len(seqlen_list) ({n}) divisible by "
                         f"k_partitions ({k_partitions})")
    parts = _ldm_partition([int(s) for s in seqlen_list], k_partitions, equal_size)
    if any(len(p) == 0 for p in parts):  # cannot happen for n ≥ k (each merge fills min(k, a+b) buckets)
        raise RuntimeError("internal error: an empty partition was produced")
    return sorted(parts, key=lambda p: p[0])


def get_reverse_idx(idx_map: Sequence[int] | torch.Tensor) -> list[int]:
    """Inverse permutation: if output row i came from input row idx_map[i], then
    outputs[get_reverse_idx(idx_map)] restores the input order (reverse[idx_map[i]] = i)."""
    idx = [int(i) for i in (idx_map.tolist() if isinstance(idx_map, torch.Tensor) else idx_map)]
    if sorted(idx) != list(range(len(idx))):
        raise ValueError("`idx_map` must be a permutation of 0..n-1")
    reverse = [0] * len(idx)
    for pos, i in enumerate(idx):
        reverse[i] = pos
    return reverse


# --------------------------------------------------------------------------------------------
# Token-budget micro-batches
# --------------------------------------------------------------------------------------------
def _budget_partitions(seqlens: list[int], max_token_len: int, k: int) -> list[list[int]] | None:
    """Balanced k-way partition if every group either fits the budget or is one overlong row."""
    parts = get_seqlen_balanced_partitions(seqlens, k, equal_size=False)
    ok = all(sum(seqlens[i] for i in p) <= max_token_len or len(p) == 1 for p in parts)
    return parts if ok else None


def _min_feasible_partitions(seqlens: list[int], max_token_len: int) -> list[list[int]]:
    """Fewest balanced groups that respect the budget: start at ⌈Σ / budget⌉ (a lower bound, with
    each overlong row counted as a group of its own) and add groups until it fits. k = n always
    fits (one row per group), so this terminates."""
    n = len(seqlens)
    overlong = sum(1 for s in seqlens if s > max_token_len)
    rest = sum(s for s in seqlens if s <= max_token_len)
    k = min(n, max(1, overlong + math.ceil(rest / max_token_len)))
    while True:
        parts = _budget_partitions(seqlens, max_token_len, k)
        if parts is not None:
            return parts
        k += 1


def _split_to_count(parts: list[list[int]], seqlens: list[int], k: int, unit_of: list[int] | None = None,
                    rows: list[list[int]] | None = None) -> list[list[int]]:
    """Raise the number of row groups to k by halving the heaviest multi-row group; halves of a
    group within budget stay within budget. Weights are token sums, or with `rows` (prefix
    sharing) prefix-tree sizes; a group of several `unit_of` units (prompt groups) is halved
    between units (token-balanced), a group of one unit between its rows."""
    def weight(p: list[int]) -> int:
        return tree_size([rows[i] for i in p]) if rows is not None else sum(seqlens[i] for i in p)

    parts = [list(p) for p in parts]
    while len(parts) < k:
        splittable = [p for p in parts if len(p) > 1]
        if not splittable:
            raise ValueError(f"cannot make {k} micro-batches from {len(seqlens)} rows")
        heaviest = max(splittable, key=weight)
        parts.remove(heaviest)
        members: dict[int, list[int]] = {}
        for i in heaviest:
            members.setdefault(unit_of[i] if unit_of is not None else i, []).append(i)
        groups = list(members.values()) if len(members) > 1 else [[i] for i in heaviest]
        halves = get_seqlen_balanced_partitions([weight(g) for g in groups], 2, equal_size=False)
        parts.extend([sorted(i for j in h for i in groups[j]) for h in halves])
    return parts


def _prompt_groups(td, max_token_len: int) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Rows with the same valid prompt tokens (the slots before `responses`), cut into runs whose
    prefix tree fits `max_token_len`; returns (units, tokens of each unit's tree, valid tokens of
    each row)."""
    rows = valid_rows(td["input_ids"], td["attention_mask"])
    prompt_slots = td["input_ids"].shape[1] - td["responses"].shape[-1]
    prompts = valid_rows(td["input_ids"][:, :prompt_slots], td["attention_mask"][:, :prompt_slots])
    by_prompt: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        by_prompt.setdefault(tuple(p), []).append(i)
    units: list[list[int]] = []
    for members in by_prompt.values():
        run: list[int] = []
        for i in members:
            if run and tree_size([rows[j] for j in run + [i]]) > max_token_len:
                units.append(run)
                run = []
            run.append(i)
        units.append(run)
    return units, [tree_size([rows[j] for j in u]) for u in units], rows


def rearrange_micro_batches(batch, max_token_len: int, dp_group=None, same_micro_num_in_dp: bool = True,
                            share_prefix: bool = False):
    """Split `batch` (DataProto or TensorDict with `attention_mask`) into token-budget micro-batches.

    Returns (micro_batches, index_groups): micro_batches[j] holds the rows index_groups[j]
    (ascending) of `batch`, of the same type as `batch`. Guarantees: Σ attention_mask of each
    micro-batch ≤ max_token_len unless the micro-batch is one row that alone exceeds it; every
    row appears exactly once; the groups are token-balanced. When torch.distributed is
    initialized and same_micro_num_in_dp, the count is exactly the maximum over `dp_group` (None =
    the default group) so every rank runs the same number of forward/backward passes (the ranks
    would deadlock in FSDP's collectives otherwise).
    With `share_prefix` (needs `input_ids` and `responses`) the budget counts prefix-tree tokens
    and rows with the same prompt stay together (module docstring).
    Restore per-row outputs with `get_reverse_idx([i for g in index_groups for i in g])`.
    """
    if max_token_len <= 0:
        raise ValueError(f"`max_token_len` must be positive, got {max_token_len}")
    td = batch.batch if hasattr(batch, "non_tensor_batch") else batch
    seqlens = [int(s) for s in td["attention_mask"].sum(dim=-1).tolist()]
    if not seqlens:
        return [], []
    if share_prefix:
        units, weights, rows = _prompt_groups(td, max_token_len)
    else:
        units, weights, rows = [[i] for i in range(len(seqlens))], seqlens, None
    parts = _min_feasible_partitions(weights, max_token_len)
    k = len(parts)
    if same_micro_num_in_dp and dist.is_available() and dist.is_initialized():
        count = torch.tensor([k], dtype=torch.int64, device=td["attention_mask"].device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        k = int(count.item())
        if k > len(seqlens):
            raise ValueError(f"another data-parallel rank needs {k} micro-batches but this rank has only "
                             f"{len(seqlens)} rows; give every rank the same number of rows")
        if len(parts) < k <= len(units):  # a fresh balanced k-way split first (better balance)
            parts = _budget_partitions(weights, max_token_len, k) or parts
    parts = [[i for u in p for i in units[u]] for p in parts]
    if len(parts) < k:  # only ever split further: re-partitioning finer units could need more than k
        unit_of = {i: n for n, u in enumerate(units) for i in u}
        parts = _split_to_count(parts, seqlens, k, unit_of=[unit_of[i] for i in range(len(seqlens))], rows=rows)
    parts = sorted(sorted(p) for p in parts)
    micro_batches = [batch.select_idxs(p) if hasattr(batch, "select_idxs") else batch[torch.tensor(p)] for p in parts]
    return micro_batches, parts


def split_micro_batches(batch, use_dynamic_bsz: bool, micro_batch_size: int | None = None,
                        max_token_len: int | None = None, dp_group=None, share_prefix: bool = False):
    """Micro-batches of a (mini-)batch: token-budget (`use_dynamic_bsz`) or `micro_batch_size` rows.

    Returns (micro_batches, index_groups); with fixed sizes the groups are consecutive ranges, so
    the concatenated outputs are already in input order.
    """
    td = batch.batch if hasattr(batch, "non_tensor_batch") else batch
    if use_dynamic_bsz:
        if max_token_len is None:
            raise ValueError("use_dynamic_bsz needs a token budget (`max_token_len`)")
        return rearrange_micro_batches(batch, int(max_token_len), dp_group=dp_group, share_prefix=share_prefix)
    if not micro_batch_size or micro_batch_size <= 0:
        raise ValueError(f"a positive micro batch size is needed without use_dynamic_bsz, got {micro_batch_size}")
    n = td.batch_size[0]
    groups = [list(range(s, min(n, s + micro_batch_size))) for s in range(0, n, micro_batch_size)]
    micro = [batch.slice(g[0], g[-1] + 1) if hasattr(batch, "select_idxs") else batch[g[0]:g[-1] + 1] for g in groups]
    return micro, groups


# --------------------------------------------------------------------------------------------
# Data-parallel balancing (trainer.balance_batch)
# --------------------------------------------------------------------------------------------
def balance_batch_indices(seqlens: Sequence[int] | torch.Tensor, dp_size: int,
                          groups: Sequence | None = None, tokens: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Row order for token-balanced data-parallel shards.

    Returns a permutation `order` of 0..n−1 (n divisible by dp_size): after
    `data.reorder(order)`, `data.chunk(dp_size)[r]` is rank r's shard; each shard has n/dp_size
    rows and the shard token sums are Karmarkar–Karp balanced. Rows keep ascending order inside
    a shard. `groups` (a group id per row, e.g. the prompt uid; for prefix sharing) keeps each
    group's rows on one rank when every group has the same size and the groups divide evenly
    among the ranks; otherwise rows are balanced one by one (a warning says so). With `tokens`
    (each row's valid tokens) a group weighs the size of its prefix tree, the tokens a
    prefix-shared forward computes (prefix_packing.tree_size), instead of the sum of its rows'
    lengths: a group of identical answers then weighs one answer, not n (docs/performance.md,
    "The ranks balanced by the tokens they train").
    """
    lens = seqlens.tolist() if isinstance(seqlens, torch.Tensor) else list(seqlens)
    if groups is not None:
        members: dict = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        units = list(members.values())
        if len({len(u) for u in units}) == 1 and len(units) % dp_size == 0:
            weights = ([tree_size([tokens[i] for i in u]) for u in units] if tokens is not None
                       else [sum(lens[i] for i in u) for u in units])
            parts = get_seqlen_balanced_partitions(weights, dp_size, equal_size=True)
            return [i for p in parts for i in sorted(i for u in p for i in units[u])]
        logger.warning("balance_batch: %d groups of sizes %s cannot be split evenly over %d ranks; balancing rows "
                       "one by one (groups are split, so their shared prompts are computed on several ranks)",
                       len(units), sorted({len(u) for u in units}), dp_size)
    parts = get_seqlen_balanced_partitions(lens, dp_size, equal_size=True)
    return [i for p in parts for i in p]
