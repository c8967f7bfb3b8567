"""The HF engine's decode-batch KV cache: transformers' `DynamicCache` whose layers grow in place.

Why: `DynamicLayer.update` appends a step's keys and values with `torch.cat`, so every decode step
copies each layer's whole cache. At the evaluation's shape (150 rows, ~400 cached tokens, 30 layers
of SmolLM2-135M in fp32) that is ~1.4 GB of memory traffic a step, 11.6% of an evaluation's time
(docs/performance.md, "Where the quickstart's time goes").

`GrowingLayer` keeps each layer's keys/values in a buffer with spare positions
`[B, H_kv, capacity, D]`; `update` writes the new positions into the spare ones and exposes the
filled part as a view, so a decode step copies one position per row instead of all of them. When the
spare runs out the buffer is reallocated with `max(MIN_SPARE, filled // 4)` spare positions (the
copy is amortised over that many steps; memory is at most 1.25x the filled cache plus MIN_SPARE).

The arithmetic is unchanged: attention reads the same numbers through a view whose last two
dimensions are laid out as before (row stride `D`), so the engine's tokens, log-probs and entropies
are bit-identical to the `torch.cat` cache (tests/rollout/test_hf_cache.py checks it on a model).

What the engine does to a layer besides `update` keeps working: a layer whose `keys`/`values` were
replaced by another tensor (`batch_select_indices` when rows finish, the engine's column cut, a
merge of two batches) is adopted again on its next `update`: one copy into a fresh buffer. A column
cut that leaves a view into the same buffer is written on in place.
"""

from __future__ import annotations

import torch

MIN_SPARE = 32
"""Spare positions a (re)allocated buffer has at least: a short cache grows every 32 steps, not every step."""


def _offset_in(view: torch.Tensor, buf: torch.Tensor | None) -> int | None:
    """The first position (dim -2) of `buf` that `view` starts at, if `view` is `buf[:, :, o:o + n]`
    with the buffer's own strides; None otherwise (then the layer is adopted into a new buffer)."""
    if buf is None or view.dim() != 4 or view.shape[:2] != buf.shape[:2] or view.shape[3] != buf.shape[3]:
        return None
    if view.stride() != buf.stride() or view.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    delta = view.storage_offset() - buf.storage_offset()
    if delta < 0 or delta % buf.stride(2):
        return None
    o = delta // buf.stride(2)
    return o if o + view.shape[2] <= buf.shape[2] else None


def _grown(x: torch.Tensor, n_new: int) -> torch.Tensor:
    """A buffer holding `x` ([B, H, n, D]) in its first n positions, with room for n_new more and spare."""
    n = x.shape[2]
    cap = n + n_new + max(MIN_SPARE, (n + n_new) // 4)
    buf = x.new_empty((x.shape[0], x.shape[1], cap, x.shape[3]))
    buf[:, :, :n] = x
    return buf


def _make_growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A full-attention cache layer appended in place (see the module docstring)."""

        _kbuf: torch.Tensor | None = None
        _vbuf: torch.Tensor | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            L = key_states.shape[2]
            if self.keys.dim() != 4 or self.keys.shape[2] == 0:   # empty: the new states are the cache
                self._kbuf, self._vbuf = _grown(key_states, 0), _grown(value_states, 0)
                n, o = L, 0
            else:
                o, ov = _offset_in(self.keys, self._kbuf), _offset_in(self.values, self._vbuf)
                n = self.keys.shape[2]
                if (o is None or o != ov or o + n + L > self._kbuf.shape[2]
                        or key_states.shape[0] != self._kbuf.shape[0]):
                    self._kbuf, self._vbuf = _grown(self.keys, L), _grown(self.values, L)
                    o = 0
                self._kbuf[:, :, o + n:o + n + L] = key_states
                self._vbuf[:, :, o + n:o + n + L] = value_states
                n += L
            self.keys, self.values = self._kbuf[:, :, o:o + n], self._vbuf[:, :, o:o + n]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep rows `indices`: one copy of their filled and spare positions (the plain layer's
            copy of the filled ones would be copied again into a new buffer at the next update)."""
            o = _offset_in(self.keys, self._kbuf) if self.keys.dim() == 4 else None
            if o is None or o != _offset_in(self.values, self._vbuf):
                return super().batch_select_indices(indices)
            n = self.keys.shape[2]
            self._kbuf, self._vbuf = self._kbuf[indices, :, o:], self._vbuf[indices, :, o:]
            self.keys, self.values = self._kbuf[:, :, :n], self._vbuf[:, :, :n]

    GrowingLayer.__name__ = GrowingLayer.__qualname__ = "GrowingLayer"
    return GrowingLayer


_LAYER_CLASS = None


def growing_layer_class():
    """`GrowingLayer`, built on first use (transformers is imported lazily by the engine)."""
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        _LAYER_CLASS = _make_growing_layer_class()
    return _LAYER_CLASS


def grow_in_place(cache):
    """Make `cache` (a `DynamicCache` of plain full-attention layers, as the engine builds) append in
    place: its layers, and those it creates lazily, become `GrowingLayer`s. Returns `cache`."""
    from transformers.cache_utils import DynamicLayer

    cls = growing_layer_class()
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = cls
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = cls
    return cache
