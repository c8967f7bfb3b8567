"""KV-cache layers that append into room set aside in advance: the HF engine's decode cache.

Why: transformers' `DynamicLayer` appends each step's keys and values with `torch.cat`, which
copies the whole cache of every layer at every decode step: at the quickstart's evaluation shape
(150 rows × ~400 cached positions, SmolLM2's 30 layers of 3 key-value heads of 64) ≈ 2.8 GB copied
a step in fp32, more than the 540 MB of weights the step reads. Here a layer's
keys and values live in a buffer with `room` spare positions; a step writes its new positions in
place, and `keys`/`values` are views of the filled part. The buffer is reallocated (with `room`
spare positions again) only when it is full, so a decode of m tokens copies the cache about
m / room times instead of m times (docs/performance.md, "Where the quickstart's time goes": 1.09×
on the evaluation's decode, bit-identical, +13% peak memory).

The values are the same as `DynamicLayer`'s, position for position; attention reads them through a
strided view, which the matmul kernels take without a copy. Padding positions (left padding of
a batch) are zeros, as in the engine's concatenated cache: a masked position's weight is 0, and
0 × 0 stays 0 where uninitialised memory could hold a NaN.

`room=0` gives the concatenating behaviour (a reallocation at every step), for comparisons.
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ROOM = 256
"""Spare positions per (re)allocation, at most: a decode that may still generate fewer tokens gets
only those (the engine passes its rows' largest remaining budget), so memory stays within `ROOM`
positions per row of what a concatenating cache holds."""


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` whose `update` writes into preallocated room instead of concatenating."""

    def __init__(self, room: int = ROOM):
        super().__init__()
        self.room = max(0, int(room))
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None
        self._key_view: torch.Tensor | None = None

    def _owns(self) -> bool:
        """Whether `keys` is still the view this layer made (code that assigns `keys` anew, such
        as `DynamicLayer.batch_select_indices`, makes the buffer stale)."""
        return self._key_buf is not None and self.keys is self._key_view

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if not self._owns() or n + t > self._key_buf.shape[-2]:
            self._reallocate(key_states, value_states, n, n + t + self.room)
        self._key_buf[:, :, n:n + t] = key_states
        self._value_buf[:, :, n:n + t] = value_states
        self._set_views(n + t)
        return self.keys, self.values

    def select_rows(self, index: torch.Tensor, first: int = 0) -> None:
        """Keep the rows `index` and drop the first `first` positions (padding in every kept row):
        one copy into a buffer that keeps the spare room."""
        n = self.get_seq_length()
        if n == 0:
            return
        if not self._owns():
            self._reallocate(self.keys, self.values, n, n + self.room)
        self._key_buf = _gather_rows(self._key_buf, index, first, n)
        self._value_buf = _gather_rows(self._value_buf, index, first, n)
        self._set_views(n - first)

    def fill(self, blocks: list[tuple[torch.Tensor, torch.Tensor] | None], length: int,
             extra: int, device: torch.device) -> "PreallocatedLayer":
        """Stack `blocks` (each `[b, H, n, D]` keys and values on any device, or None for one empty
        row) along the batch on `device`, each right-aligned to `length` positions (left padding =
        zeros), with room for `extra` more positions before a reallocation."""
        like = next(blk[0] for blk in blocks if blk is not None)
        rows = sum(1 if blk is None else blk[0].shape[0] for blk in blocks)
        shape = (rows, like.shape[-3], length + max(extra, 0), like.shape[-1])
        self._key_buf = torch.empty(shape, dtype=like.dtype, device=device)
        self._value_buf = torch.empty(shape, dtype=like.dtype, device=device)
        self._key_buf[:, :, :length].zero_()
        self._value_buf[:, :, :length].zero_()
        b = 0
        for blk in blocks:
            if blk is None:
                b += 1
                continue
            k, v = blk
            n = k.shape[-2]
            self._key_buf[b:b + k.shape[0], :, length - n:length] = k
            self._value_buf[b:b + k.shape[0], :, length - n:length] = v
            b += k.shape[0]
        self.device, self.is_initialized = torch.device(device), True
        self._set_views(length)
        return self

    def _reallocate(self, key_like, value_like, n: int, capacity: int) -> None:
        shape = (*key_like.shape[:-2], capacity, key_like.shape[-1])
        key_buf, value_buf = key_like.new_empty(shape), value_like.new_empty(shape)
        if n:
            key_buf[:, :, :n] = self.keys
            value_buf[:, :, :n] = self.values
        self._key_buf, self._value_buf = key_buf, value_buf

    def _set_views(self, n: int) -> None:
        self.keys = self._key_view = self._key_buf[:, :, :n]
        self.values = self._value_buf[:, :, :n]


def _gather_rows(buf: torch.Tensor, index: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """A new buffer of `buf`'s rows `index` with the positions `first:n` (the filled ones) copied, and
    the same spare room after them, not copied: room is written before any view covers it. Copying
    the filled part alone is 4-5x faster than copying the whole buffer (bf16, 150 rows, half the
    buffer filled: docs/performance.md, "The decode cache's compaction copies the filled positions
    only")."""
    out = buf.new_empty((index.numel(), buf.shape[1], buf.shape[2] - first, buf.shape[3]))
    torch.index_select(buf[:, :, first:n], 0, index, out=out[:, :, :n - first])
    return out


def preallocated_cache(layers: list[PreallocatedLayer] | None = None, room: int = ROOM) -> DynamicCache:
    """A `DynamicCache` of `PreallocatedLayer`s: the given ones, or, without them, layers created
    on first use (one per model layer, each with `room`)."""
    cache = DynamicCache()
    if layers:
        cache.layers = list(layers)
        cache.layer_class_to_replicate = None
    else:
        cache.layer_class_to_replicate = functools.partial(PreallocatedLayer, room=room)
    return cache


def select_cache_rows(cache: DynamicCache, index: torch.Tensor, first: int = 0) -> None:
    """Keep the rows `index` of every layer and drop their first `first` positions (which must be
    padding in every kept row)."""
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.select_rows(index, first)
        else:
            layer.batch_select_indices(index)
            if first and layer.get_seq_length():
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
