"""DataProto: the one batch type passed between the trainer, the workers and the rollout.

A ``DataProto`` holds N rows ("samples") in three parts:

``batch``
    a ``tensordict.TensorDict`` with ``batch_size == [N]``: every tensor whose first dimension is
    the row (``input_ids``, ``attention_mask``, ``responses``, ``old_log_probs``, ...).
``non_tensor_batch``
    ``dict[str, np.ndarray]``, one array of length N per key for per-row Python objects
    (``uid``, ``data_source``, ``reward_model``, tool-call traces, tree metadata...). Built by
    :func:`as_object_array`, a row holding a dict or a list stays *one* element of a 1-D
    ``dtype=object`` array, so a list of equal-length lists never turns into a 2-D array.
``meta_info``
    a plain dict that is not per row (``temperature``, ``micro_batch_size``, ``metrics``...).
    Row operations (index, slice, chunk, repeat...) carry it along unchanged.

The names and the behaviour follow verl's ``verl.protocol.DataProto`` so code written against verl
ports by changing the import. Where we differ, on purpose:

- Errors are exceptions with the offending key in the message (``ValueError`` for conflicts and
  inconsistent shapes, ``KeyError`` for missing keys, ``IndexError`` for out-of-range rows),
  not bare ``assert`` s that disappear under ``python -O``.
- ``concat`` merges ``meta_info["metrics"]`` of all parts into one ``dict[str, list]``
  (each part's scalar is appended, each part's list is extended, so ``np.mean`` over a value
  averages every recorded number). Every other ``meta_info`` key comes from the first part that
  has it. Parts that are completely empty (no batch, no non-tensors) are skipped, so
  ``DataProto.concat([DataProto(), part])`` works as an accumulator.
- ``from_dict`` turns 1-D arrays and lists into object arrays (as verl does) but keeps numeric
  arrays with more than one dimension as they are (one vector per row); ``check_consistency``
  accepts those and rejects object arrays that are not 1-D.
- Row operations give each result its own shallow copy of ``meta_info`` instead of sharing the
  parent's dict object; ``select(..., deepcopy=True)`` also clones the tensors.
- ``rename`` renames non-tensor keys too (verl renames batch keys only).
- Pickling (and so Ray transfer) is tensordict's native pickling, except that
  tensors that are views into a larger storage (after a slice or a chunk) are copied first, so a
  chunk does not ship its parent's whole storage.
- ``collate_fn`` keeps the ``meta_info`` of the first item (verl drops it).

Not provided: verl's ``print_size`` / ``save_to_disk`` / ``load_from_disk`` (pickle a DataProto
directly when debugging), the auto-padding switch, ``make_iterator`` (use ``split``), the async
``DataProtoFuture`` and the all-gather helpers; ``single_controller`` does its own dispatch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl_arpo.protocol_rows import (index_tensor, merge_metrics, to_non_tensor, union_meta, as_object_array,
                                     union_numpy_dict, union_tensor_dict)

__all__ = [
    "DataProto",
    "DataProtoItem",
    "as_object_array",
    "collate_fn",
    "pad_dataproto_to_divisor",
    "unpad_dataproto",
    "union_numpy_dict",
    "union_tensor_dict",
]


# ---------------------------------------------------------------------------------------------
# DataProto
# ---------------------------------------------------------------------------------------------


@dataclass
class DataProtoItem:
    """One row of a DataProto (``data[i]``): ``batch`` is a TensorDict with ``batch_size == []``,
    ``non_tensor_batch`` maps key -> that row's object, ``meta_info`` is the parent's."""

    batch: TensorDict | None = None
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """N rows of tensors (``batch``), per-row objects (``non_tensor_batch``) and ``meta_info``.

    See the module docstring; construct with :meth:`from_dict` / :meth:`from_single_dict`, or
    directly from a TensorDict and numpy object arrays (checked by :meth:`check_consistency`).
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.non_tensor_batch is None:
            self.non_tensor_batch = {}
        if self.meta_info is None:
            self.meta_info = {}
        self.check_consistency()

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
        num_batch_dims: int = 1,
    ) -> DataProto:
        """Build from a dict of tensors (sharing their first ``num_batch_dims`` dimensions), a
        dict of per-row sequences (made into object arrays) and ``meta_info``."""
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        if num_batch_dims < 1:
            raise ValueError(f"num_batch_dims must be >= 1, got {num_batch_dims}")
        if non_tensors and num_batch_dims != 1:
            raise ValueError("non_tensors need num_batch_dims == 1")
        batch = None
        if tensors:
            batch_size = None
            first_key = None
            for key, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"tensors[{key!r}] must be a torch.Tensor, got {type(tensor).__name__}")
                if tensor.ndim < num_batch_dims:
                    raise ValueError(f"tensors[{key!r}] has {tensor.ndim} dims, fewer than num_batch_dims={num_batch_dims}")
                size = tensor.shape[:num_batch_dims]
                if batch_size is None:
                    batch_size, first_key = size, key
                elif size != batch_size:
                    raise ValueError(
                        f"tensors[{key!r}] has batch shape {tuple(size)}, but tensors[{first_key!r}] has {tuple(batch_size)}"
                    )
            batch = TensorDict(tensors, batch_size=batch_size)
        non_tensor_batch = {key: to_non_tensor(key, val) for key, val in non_tensors.items()}
        return cls(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Build from one dict: tensors go to ``batch``; numpy arrays, lists and tuples go to
        ``non_tensor_batch``; anything else is a ``ValueError`` naming the key."""
        tensors, non_tensors = {}, {}
        for key, val in data.items():
            if isinstance(val, torch.Tensor):
                tensors[key] = val
            elif isinstance(val, (np.ndarray, list, tuple)):
                non_tensors[key] = val
            else:
                raise ValueError(f"from_single_dict: unsupported type {type(val).__name__} for key {key!r}")
        return cls.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta_info)

    # -- invariants ----------------------------------------------------------------------------

    def check_consistency(self) -> None:
        """Raise ``ValueError`` (naming the key) unless every part agrees on the number of rows:
        ``batch`` is a TensorDict (one batch dim when non-tensors exist); every non-tensor value
        is a numpy array with one entry per row, and object arrays are 1-D."""
        if self.batch is not None and not isinstance(self.batch, TensorDict):
            raise ValueError(f"DataProto.batch must be a TensorDict or None, got {type(self.batch).__name__}")
        if not isinstance(self.non_tensor_batch, dict):
            raise ValueError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        if not isinstance(self.meta_info, dict):
            raise ValueError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        if self.batch is not None and len(self.batch.batch_size) == 0:
            raise ValueError("DataProto.batch needs at least one batch dimension (batch_size=[N])")
        if self.batch is not None and self.non_tensor_batch and len(self.batch.batch_size) != 1:
            raise ValueError(
                f"batch has batch_size {tuple(self.batch.batch_size)}; non_tensor_batch needs exactly one batch dim"
            )
        expected = self.batch.batch_size[0] if self.batch is not None else None
        expected_from = "batch"
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):
                raise ValueError(
                    f"non_tensor_batch[{key!r}] must be a numpy array, got {type(val).__name__} "
                    "(build it with as_object_array or DataProto.from_dict)"
                )
            if val.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is a 0-d array; it needs one entry per row")
            if val.dtype == object and val.ndim != 1:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] is an object array of shape {val.shape}; object arrays must be "
                    "1-D (build it with as_object_array)"
                )
            if expected is None:
                expected, expected_from = val.shape[0], f"non_tensor_batch[{next(iter(self.non_tensor_batch))!r}]"
            elif val.shape[0] != expected:
                raise ValueError(
                    f"non_tensor_batch[{key!r}] has {val.shape[0]} rows but {expected_from} has {expected}"
                )

    # -- size and rows -------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        if self.non_tensor_batch:
            return int(next(iter(self.non_tensor_batch.values())).shape[0])
        return 0

    def _is_blank(self) -> bool:
        """No batch and no non-tensor columns at all (an empty accumulator)."""
        return self.batch is None and not self.non_tensor_batch

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """``data[i]`` -> DataProtoItem; ``data[a:b:c]`` -> DataProto of views;
        ``data[list | np.ndarray | LongTensor | bool mask]`` -> DataProto of copied rows."""
        if isinstance(item, torch.Tensor) and item.ndim == 0 and not item.is_floating_point() and item.dtype != torch.bool:
            item = int(item)
        if isinstance(item, (int, np.integer)) and not isinstance(item, (bool, np.bool_)):
            n = len(self)
            i = int(item)
            if not -n <= i < n:
                raise IndexError(f"row {i} out of range for DataProto with {n} rows")
            i %= n
            return DataProtoItem(
                batch=self.batch[i] if self.batch is not None else None,
                non_tensor_batch={key: val[i] for key, val in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (list, tuple, np.ndarray, torch.Tensor)):
            return self.select_idxs(item)
        raise TypeError(f"DataProto indices must be int, slice, list, np.ndarray or torch.Tensor, got {type(item).__name__}")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step``; tensors and arrays are views of this DataProto's."""
        s = slice(start, end, step)
        return DataProto(
            batch=self.batch[s] if self.batch is not None else None,
            non_tensor_batch={key: val[s] for key, val in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows picked by integer indices (repeats allowed, order kept) or by a boolean mask."""
        idx = index_tensor(idxs, len(self))
        idx_np = idx.numpy()
        batch = None
        if self.batch is not None:
            batch = self.batch[idx]
        return DataProto(
            batch=batch,
            non_tensor_batch={key: val[idx_np] for key, val in self.non_tensor_batch.items()},
            meta_info=dict(self.meta_info),
        )

    # -- keys ----------------------------------------------------------------------------------

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A DataProto with only the given keys (``None`` keeps every key of that part).

        Tensors are shared with ``self`` unless ``deepcopy`` (which also deep-copies the
        non-tensors and meta_info). A missing key is a ``KeyError`` naming it.
        """
        if batch_keys is None:
            batch = self.batch
        else:
            batch_keys = list(batch_keys)
            have = set(self.batch.keys()) if self.batch is not None else set()
            for key in batch_keys:
                if key not in have:
                    raise KeyError(f"select: batch key {key!r} not in DataProto.batch")
            batch = self.batch.select(*batch_keys) if self.batch is not None else None
        if batch is not None and batch is self.batch:
            batch = batch.select(*batch.keys())  # new container, same tensors
        non_tensor_batch = self._pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta_info = self._pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = batch.clone() if batch is not None else None
            non_tensor_batch = copy.deepcopy(non_tensor_batch)
            meta_info = copy.deepcopy(meta_info)
        return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    @staticmethod
    def _pick(source: dict, keys: Sequence[str] | None, part: str) -> dict:
        if keys is None:
            return dict(source)
        out = {}
        for key in keys:
            if key not in source:
                raise KeyError(f"select: key {key!r} not in {part}")
            out[key] = source[key]
        return out

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from ``self`` and return them as a new DataProto.

        ``None`` pops nothing from that part (as in verl). A missing key is a ``KeyError``
        naming it, raised before anything is removed.
        """
        batch_keys = list(batch_keys or [])
        non_tensor_batch_keys = list(non_tensor_batch_keys or [])
        meta_info_keys = list(meta_info_keys or [])
        have = set(self.batch.keys()) if self.batch is not None else set()
        for key in batch_keys:
            if key not in have:
                raise KeyError(f"pop: batch key {key!r} not in DataProto.batch")
        for key in non_tensor_batch_keys:
            if key not in self.non_tensor_batch:
                raise KeyError(f"pop: key {key!r} not in non_tensor_batch")
        for key in meta_info_keys:
            if key not in self.meta_info:
                raise KeyError(f"pop: key {key!r} not in meta_info")
        batch = None
        if batch_keys:
            batch = TensorDict({key: self.batch.pop(key) for key in batch_keys}, batch_size=self.batch.batch_size)
        non_tensor_batch = {key: self.non_tensor_batch.pop(key) for key in non_tensor_batch_keys}
        meta_info = {key: self.meta_info.pop(key) for key in meta_info_keys}
        return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename batch (or non-tensor) keys in place; returns ``self``."""
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename: {len(old_keys)} old keys but {len(new_keys)} new keys")
        for old, new in zip(old_keys, new_keys):
            if self.batch is not None and old in self.batch.keys():
                self.batch.rename_key_(old, new)
            elif old in self.non_tensor_batch:
                self.non_tensor_batch[new] = self.non_tensor_batch.pop(old)
            else:
                raise KeyError(f"rename: key {old!r} not in batch or non_tensor_batch")
        return self

    def union(self, other: DataProto) -> DataProto:
        """Merge ``other``'s keys into ``self`` (in place) and return ``self``.

        Keys present in both must hold equal values (tensor / array / meta), else ``ValueError``
        naming the key; the row counts must match.
        """
        if not self._is_blank() and not other._is_blank() and len(self) != len(other):
            raise ValueError(f"union: row counts differ: {len(self)} vs {len(other)}")
        # check everything before mutating anything
        if self.batch is not None and other.batch is not None:
            union_tensor_dict(self.batch.select(*self.batch.keys()), other.batch)
        union_numpy_dict(dict(self.non_tensor_batch), other.non_tensor_batch)
        union_meta(dict(self.meta_info), other.meta_info)
        other_batch = other.batch.select(*other.batch.keys()) if other.batch is not None else None
        self.batch = union_tensor_dict(self.batch, other_batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        union_meta(self.meta_info, other.meta_info)
        self.check_consistency()
        return self

    # -- splitting and joining -----------------------------------------------------------------

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` parts of equal size (views); ``len(self)`` must divide evenly."""
        if chunks <= 0:
            raise ValueError(f"chunk: chunks must be positive, got {chunks}")
        n = len(self)
        if n % chunks != 0:
            raise ValueError(f"chunk: only equal chunks are supported; {n} rows do not split into {chunks} chunks")
        size = n // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of ``split_size`` rows (views); the last part may be smaller."""
        if split_size <= 0:
            raise ValueError(f"split: split_size must be positive, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate rows of ``data`` in order (see module docstring for ``meta_info``)."""
        data = list(data)
        if not data:
            raise ValueError("concat: need at least one DataProto")
        meta_info: dict = {}
        metrics_parts = []
        for d in data:
            for key, val in d.meta_info.items():
                if key == "metrics":
                    metrics_parts.append(val)
                elif key not in meta_info:
                    meta_info[key] = val
        if metrics_parts:
            meta_info["metrics"] = merge_metrics(metrics_parts)

        parts = [d for d in data if not d._is_blank()]
        if not parts:
            return DataProto(meta_info=meta_info)

        with_batch = [d.batch is not None for d in parts]
        if any(with_batch) and not all(with_batch):
            raise ValueError("concat: some parts have a tensor batch and some do not")
        batch = None
        if all(with_batch):
            keys = set(parts[0].batch.keys())
            for d in parts[1:]:
                diff = keys.symmetric_difference(d.batch.keys())
                if diff:
                    raise ValueError(f"concat: batch keys differ between parts: {sorted(diff)}")
            batch = TensorDict.cat([d.batch for d in parts], dim=0)

        nt_keys = set(parts[0].non_tensor_batch)
        for d in parts[1:]:
            diff = nt_keys.symmetric_difference(d.non_tensor_batch)
            if diff:
                raise ValueError(f"concat: non_tensor_batch keys differ between parts: {sorted(diff)}")
        non_tensor_batch = {
            key: np.concatenate([d.non_tensor_batch[key] for d in parts], axis=0) for key in parts[0].non_tensor_batch
        }
        return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``[a, a, b, b]`` with ``interleave`` else ``[a, b, a, b]``."""
        if repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        rows = torch.arange(len(self))
        idx = rows.repeat_interleave(repeat_times) if interleave else rows.repeat(repeat_times)
        return self.select_idxs(idx)

    def reorder(self, indices: Any) -> None:
        """Permute (or gather) rows in place: row ``i`` becomes old row ``indices[i]``."""
        reordered = self.select_idxs(indices)
        self.batch = reordered.batch
        self.non_tensor_batch = reordered.non_tensor_batch

    # -- devices, size, persistence ------------------------------------------------------------

    def to(self, device: str | torch.device) -> DataProto:
        """Move the tensor batch to ``device`` (in place); returns ``self``."""
        if self.batch is not None:
            self.batch = self.batch.to(device)
        return self

    def __getstate__(self) -> dict:
        batch = self.batch
        if batch is not None:
            # A view (e.g. one chunk) would otherwise pickle its parent's whole storage.
            batch = batch.apply(
                lambda t: t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t
            )
        return {"batch": batch, "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict) -> None:
        self.batch = state["batch"]
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]



# ---------------------------------------------------------------------------------------------
# padding and collation
# ---------------------------------------------------------------------------------------------


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad ``data`` to a multiple of ``size_divisor`` rows by appending copies of its first rows
    (cycling when more padding than rows is needed). Returns ``(padded, pad_size)``."""
    if not isinstance(data, DataProto):
        raise TypeError(f"data must be a DataProto, got {type(data).__name__}")
    if size_divisor <= 0:
        raise ValueError(f"size_divisor must be positive, got {size_divisor}")
    n = len(data)
    if n == 0 or n % size_divisor == 0:
        return data, 0
    pad_size = size_divisor - n % size_divisor
    padding = data.select_idxs([i % n for i in range(pad_size)])
    return DataProto.concat([data, padding]), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the last ``pad_size`` rows (undo :func:`pad_dataproto_to_divisor`)."""
    if pad_size < 0:
        raise ValueError(f"pad_size must be >= 0, got {pad_size}")
    if pad_size == 0:
        return data
    return data[: len(data) - pad_size]


def collate_fn(items: Sequence[DataProtoItem]) -> DataProto:
    """Stack DataProtoItems (e.g. from a DataLoader over ``data[i]``) back into a DataProto."""
    items = list(items)
    if not items:
        raise ValueError("collate_fn: no items")
    batch = None
    if items[0].batch is not None:
        batch = torch.stack([item.batch for item in items]).contiguous()
    keys = list(items[0].non_tensor_batch)
    non_tensor_batch = {}
    for key in keys:
        non_tensor_batch[key] = as_object_array([item.non_tensor_batch[key] for item in items])
    return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(items[0].meta_info))
