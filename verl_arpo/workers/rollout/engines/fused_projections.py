"""Fused input projections for decode steps: one matmul where a layer has several on the same input.

Why: in a decode step each row brings one token, so every linear is a matmul of a few rows whose time
is mostly the call and the weights' streaming, not arithmetic (docs/performance.md, "Fused projections
in the decode step"). Attention's query, key and value projections read the same input, and so do the
MLP's gate and up projections: as one matmul over their weights stacked, a layer makes 4 linear calls
where it made 7.

What it computes: the stacked product's columns are the members' products, each output element the same
dot product as before. The CPU's kernels block a matmul by its shape, so the bits can still differ: on the
AMX Xeon of docs/performance.md they were identical at every decode shape tried (1–150 rows, 1 and 2
threads, bf16 and fp32) and not at prefill shapes of 200 rows and more in bf16. So only decode steps
(one token a row) use the stacked matmul; a prefill runs each member's own, on the same weights.

How: a group's weights live in one buffer and each member's Parameter is a view of its rows (no extra
memory), so the weight sync's in-place copies (`hf_weights.update_weights`) update the buffer too. A
member whose Parameter got other storage (`discard_weights` then a refill) rebinds its group before the
next decode step; `release` drops the buffers with the weights. A group holds the step's product between
its members' calls, so one model runs one forward at a time (the engine's loop does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
"""(submodule of a decoder layer, its linears that read the same input): Llama, Qwen2, Mistral and the
other decoder layers transformers builds alike."""


class _Group:
    """One group's stacked weight (and bias) and the decode input it last multiplied."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._input: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._pending = 0
        self._ptrs: list[int] = []   # each member's weight address when bound

    def bind(self) -> None:
        """Stack the members' current weights into one buffer and make each member's weight a view of it."""
        self.weight = torch.cat([m.weight.data for m in self.members])
        has_bias = self.members[0].bias is not None
        self.bias = torch.cat([m.bias.data for m in self.members]) if has_bias else None
        start = 0
        for m in self.members:
            rows = m.weight.shape[0]
            m.weight.data = self.weight[start:start + rows]
            if has_bias:
                m.bias.data = self.bias[start:start + rows]
            m._fused_rows = (start, start + rows)
            start += rows
        self._ptrs = [m.weight.data_ptr() for m in self.members]
        self._input = self._out = None

    def bound(self) -> bool:
        """Whether every member's weight is still the view bind() made (a refill gives it new storage)."""
        return self.weight is not None and [m.weight.data_ptr() for m in self.members] == self._ptrs

    def release(self) -> None:
        self.weight = self.bias = self._input = self._out = None

    def product(self, x: torch.Tensor, member: torch.nn.Linear) -> torch.Tensor:
        """`member`'s rows of the stacked product of x: computed once for the group's members."""
        if self._input is not x:
            if not self.bound():
                self.bind()
            self._out = F.linear(x, self.weight, self.bias)
            self._input, self._pending = x, len(self.members)
        start, end = member._fused_rows
        out = self._out[..., start:end]
        self._pending -= 1
        if self._pending == 0:   # every member had its part: hold no activation between steps
            self._input = self._out = None
        return out


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A member's forward: its rows of the group's product in a decode step, its own matmul otherwise."""
    if x.dim() >= 2 and x.shape[-2] == 1:
        return self._fused_group.product(x, self)
    return F.linear(x, self.weight, self.bias)


def fuse(model: torch.nn.Module) -> int:
    """Fuse every decoder layer's groups (GROUPS) that are plain linears with equal input sizes and all
    or none with a bias; returns the number of groups fused."""
    n = 0
    for layer in _decoder_layers(model):
        for sub_name, names in GROUPS:
            sub = getattr(layer, sub_name, None)
            members = [getattr(sub, name, None) for name in names] if sub is not None else []
            if not members or not all(type(m) is torch.nn.Linear for m in members):
                continue
            if len({m.in_features for m in members}) != 1 or len({m.bias is None for m in members}) != 1:
                continue
            group = _Group(members)
            group.bind()
            for m in members:
                m._fused_group = group
                m.forward = _forward.__get__(m)
            n += 1
    return n


def release(model: torch.nn.Module) -> None:
    """Drop the stacked buffers (the weights are being discarded); the next decode step rebinds."""
    for m in model.modules():
        group = getattr(m, "_fused_group", None)
        if group is not None:
            group.release()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []
