"""Prefix-shared packing: the rows of a micro-batch as one token tree (docs/performance.md,
"Prefix sharing").

Rows that start with the same tokens — the n samples of a prompt, and ARPO's branches, which
also share the response up to their branch point — compute identical hidden states for that
prefix under causal attention. Packed with a tree mask, the prefix is computed once: node i
holds one token at position depth(i) and attends to itself and its ancestors only. Each row's
tokens are a root-to-leaf path, so every logit a row needs is the logit of one node, and the
forward, the loss and (by the chain rule, summing over the rows that share a node) the gradient
equal those of the rows computed one by one.

Construction: sort the rows lexicographically. The longest prefix a row shares with any earlier
row is the one it shares with its predecessor (a property of sorted strings), so a row reuses
its predecessor's first LCP nodes and appends the rest. Nodes are numbered in creation order,
so parents come before children. Number of nodes = Σ len(row) − Σ LCP(consecutive sorted rows).

The numbering is a depth-first preorder: the rows below a node are one run of the sorted rows,
and every node they create is a descendant, so a node's subtree is the index range [i, end(i)),
end(i) = the first later node at a depth ≤ depth(i). Hence the mask in O(N) numbers,

    node q attends to node k  ⇔  k ≤ q < end(k)        (`visibility_ends`)

which also describes plain packing (positions restarting at 0: end(k) = the next row's start).
Block-sparse kernels (FlexAttention's BlockMask) take this form instead of the N × N mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PrefixTree", "build_prefix_tree", "ancestor_mask", "visibility_ends", "tree_size", "valid_rows"]


@dataclass(frozen=True)
class PrefixTree:
    """tokens / depth: [N] token id and position of each node; node_index: [B, S] the node that
    holds each valid slot of the padded rows (−1 at padding)."""

    tokens: torch.Tensor
    depth: torch.Tensor
    node_index: torch.Tensor


def valid_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The valid tokens of each padded row, in order."""
    mask = attention_mask.bool()
    return [input_ids[b][mask[b]].tolist() for b in range(mask.shape[0])]


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tree_size(rows: Sequence[Sequence[int]]) -> int:
    """Nodes of the prefix tree of `rows` (tokens a prefix-shared forward computes):
    Σ len − Σ LCP of consecutive rows in sorted order."""
    ordered = sorted(tuple(r) for r in rows)
    return sum(len(r) for r in ordered) - sum(_lcp(a, b) for a, b in zip(ordered, ordered[1:]))


def build_prefix_tree(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PrefixTree:
    """The prefix tree of the valid tokens of padded rows [B, S] (module docstring)."""
    mask = attention_mask.bool()
    rows = valid_rows(input_ids, mask)
    node_index = torch.full(mask.shape, -1, dtype=torch.long)
    tokens: list[int] = []
    depth: list[int] = []
    prev: list[int] = []
    prev_nodes: list[int] = []
    for b in sorted(range(len(rows)), key=lambda i: rows[i]):
        row = rows[b]
        shared = _lcp(prev, row)
        nodes = prev_nodes[:shared] + list(range(len(tokens), len(tokens) + len(row) - shared))
        tokens.extend(row[shared:])
        depth.extend(range(shared, len(row)))
        node_index[b, mask[b].cpu()] = torch.tensor(nodes, dtype=torch.long)
        prev, prev_nodes = row, nodes
    device = input_ids.device
    return PrefixTree(tokens=torch.tensor(tokens, dtype=input_ids.dtype, device=device),
                      depth=torch.tensor(depth, dtype=torch.long, device=device),
                      node_index=node_index.to(device))


def ancestor_mask(tree: PrefixTree) -> torch.Tensor:
    """[N, N] bool: node i may attend to node j iff j is i or an ancestor of i.

    Each row's path p gets the causal pattern p[i] → p[j≤i]. Entries are never contradicted by
    another row: in a tree no node is both an ancestor and a descendant of another."""
    n = tree.tokens.shape[0]
    out = torch.zeros(n, n, dtype=torch.bool, device=tree.node_index.device)
    for path in tree.node_index:
        p = path[path >= 0]
        if p.numel():
            out[p.unsqueeze(1), p.unsqueeze(0)] = torch.ones(p.numel(), p.numel(), dtype=torch.bool,
                                                             device=out.device).tril()
    return out


def visibility_ends(depth: torch.Tensor) -> torch.Tensor:
    """end [N] for nodes in depth-first preorder (a prefix tree, or packed rows whose positions
    restart at 0): end(k) = the first index j > k with depth(j) ≤ depth(k), else N. Node q attends to
    node k iff k ≤ q < end(k) (module docstring): the same relation as `ancestor_mask`."""
    d = depth.tolist()
    end = [len(d)] * len(d)
    open_nodes: list[int] = []   # nodes whose subtree is still open, depths increasing
    for j, dj in enumerate(d):
        while open_nodes and d[open_nodes[-1]] >= dj:
            end[open_nodes.pop()] = j
        open_nodes.append(j)
    return torch.tensor(end, dtype=torch.long, device=depth.device)
