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
- Pickling (and so Ray transfer, ``save_to_disk``) is tensordict's native pickling, except that
  tensors that are views into a larger storage (after a slice or a chunk) are copied first, so a
  chunk does not ship its parent's whole storage.
- ``collate_fn`` keeps the ``meta_info`` of the first item (verl drops it).

Not provided: verl's auto-padding switch, ``make_iterator`` (use ``split``), the async
``DataProtoFuture`` and the all-gather helpers; ``single_controller`` does its own dispatch.
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

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
# helpers
# ---------------------------------------------------------------------------------------------


def as_object_array(values: Any) -> np.ndarray:
    """A 1-D ``dtype=object`` array with one element per row of ``values``.

    ``values`` is a list/tuple/iterable of per-row objects or an array whose first axis is the
    row. Elements are assigned one by one, so ``[[1, 2], [3, 4]]`` gives an array of length 2
    holding two lists (``np.array(..., dtype=object)`` would give a 2x2 array).
    """
    if isinstance(values, np.ndarray):
        if values.ndim == 0:
            raise ValueError("as_object_array needs at least one dimension, got a 0-d array")
        if values.ndim == 1:
            return values if values.dtype == object else values.astype(object)
        rows = list(values)  # one sub-array per row
    elif isinstance(values, torch.Tensor):
        raise TypeError("tensors belong in DataProto.batch, not in non_tensor_batch")
    else:
        rows = list(values)
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out


def _to_non_tensor(key: str, value: Any) -> np.ndarray:
    """Normalise one non-tensor column for ``from_dict`` (see module docstring)."""
    if isinstance(value, np.ndarray) and value.ndim > 1 and value.dtype != object:
        return value
    if isinstance(value, (str, bytes, dict)) or np.isscalar(value):
        raise ValueError(f"non_tensor_batch[{key!r}] must be a sequence with one entry per row, got {value!r}")
    return as_object_array(value)


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality for union checks: tensors, arrays (object or numeric), dicts, lists, NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.to(a.device)
        if a.is_floating_point() or a.is_complex():
            nan = torch.isnan(a)
            return bool(torch.equal(nan, torch.isnan(b))) and bool(torch.equal(a[~nan], b[~nan]))
        return bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # equal_nan on non-numeric dtypes (strings)
            return bool(np.array_equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return False
        return all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        return all(_values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # objects whose == returns something without a truth value
        return a is b


def union_tensor_dict(tensor_dict1: TensorDict | None, tensor_dict2: TensorDict | None) -> TensorDict | None:
    """Add the keys of ``tensor_dict2`` to ``tensor_dict1`` (in place) and return it.

    Both must have the same batch size. A key present in both must hold equal tensors, else
    ``ValueError`` naming the key. ``None`` stands for "no batch".
    """
    if tensor_dict1 is None:
        return tensor_dict2
    if tensor_dict2 is None:
        return tensor_dict1
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise ValueError(
            f"union: batch sizes differ: {tuple(tensor_dict1.batch_size)} vs {tuple(tensor_dict2.batch_size)}"
        )
    for key in tensor_dict2.keys():
        if key in tensor_dict1.keys():
            if not _values_equal(tensor_dict1[key], tensor_dict2[key]):
                raise ValueError(f"union: batch key {key!r} exists in both with different values")
        else:
            tensor_dict1[key] = tensor_dict2[key]
    return tensor_dict1


def union_numpy_dict(dict1: dict[str, np.ndarray], dict2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add the arrays of ``dict2`` to ``dict1`` (in place) and return it; a key in both must hold
    equal arrays (deep comparison of object elements), else ``ValueError`` naming the key."""
    for key, val in dict2.items():
        if key in dict1:
            if not _values_equal(dict1[key], val):
                raise ValueError(f"union: non_tensor_batch key {key!r} exists in both with different values")
        else:
            dict1[key] = val
    return dict1


def _union_meta(dict1: dict, dict2: dict) -> dict:
    for key, val in dict2.items():
        if key in dict1:
            if not _values_equal(dict1[key], val):
                raise ValueError(f"union: meta_info key {key!r} exists in both with different values")
        else:
            dict1[key] = val
    return dict1


def _merge_metrics(parts: list[Any]) -> dict[str, list]:
    """Merge per-part metrics (dicts, or lists of dicts) into one dict of flat lists."""
    merged: dict[str, list] = {}

    def add(metrics: dict) -> None:
        for key, val in metrics.items():
            bucket = merged.setdefault(key, [])
            if isinstance(val, (list, tuple)):
                bucket.extend(val)
            else:
                bucket.append(val)

    for metrics in parts:
        if metrics is None:
            continue
        if isinstance(metrics, dict):
            add(metrics)
        elif isinstance(metrics, (list, tuple)):
            for m in metrics:
                add(m)
        else:
            raise ValueError(f"meta_info['metrics'] must be a dict or a list of dicts, got {type(metrics).__name__}")
    return merged


def _index_tensor(idxs: Any, length: int) -> torch.Tensor:
    """Normalise list / numpy / torch indices or boolean masks to a 1-D LongTensor of row ids."""
    if isinstance(idxs, torch.Tensor):
        idx = idxs.detach().cpu()
    else:
        arr = np.asarray(idxs)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        idx = torch.from_numpy(np.ascontiguousarray(arr))
    if idx.ndim != 1:
        raise IndexError(f"row indices must be 1-D, got shape {tuple(idx.shape)}")
    if idx.dtype == torch.bool:
        if idx.numel() != length:
            raise IndexError(f"boolean mask has length {idx.numel()}, DataProto has {length} rows")
        return torch.nonzero(idx, as_tuple=False).flatten()
    if idx.is_floating_point() or idx.is_complex():
        raise IndexError(f"row indices must be integers or booleans, got dtype {idx.dtype}")
    idx = idx.long()
    if idx.numel() and (idx.max() >= length or idx.min() < -length):
        raise IndexError(f"row index out of range for DataProto with {length} rows")
    return torch.where(idx < 0, idx + length, idx)


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
        non_tensor_batch = {key: _to_non_tensor(key, val) for key, val in non_tensors.items()}
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
        idx = _index_tensor(idxs, len(self))
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
        _union_meta(dict(self.meta_info), other.meta_info)
        other_batch = other.batch.select(*other.batch.keys()) if other.batch is not None else None
        self.batch = union_tensor_dict(self.batch, other_batch)
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        _union_meta(self.meta_info, other.meta_info)
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
            meta_info["metrics"] = _merge_metrics(metrics_parts)

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

    def print_size(self, prefix: str = "") -> str:
        """Print (and return) the bytes held by tensors and by the numpy arrays, in GB.

        For object arrays this counts the pointers only, not the Python objects they hold.
        """
        tensor_bytes = 0
        if self.batch is not None:
            for tensor in self.batch.values(include_nested=True, leaves_only=True):
                tensor_bytes += tensor.numel() * tensor.element_size()
        numpy_bytes = sum(val.nbytes for val in self.non_tensor_batch.values())
        text = f"{prefix}Size of tensordict: {tensor_bytes / 1024**3} GB, size of non_tensor_batch: {numpy_bytes / 1024**3} GB"
        print(text)
        return text

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

    def save_to_disk(self, filepath: str) -> None:
        """Pickle to ``filepath``."""
        with open(filepath, "wb") as f:
            pickle.dump(self, f)

    @staticmethod
    def load_from_disk(filepath: str) -> DataProto:
        """Load a DataProto written by :meth:`save_to_disk` (pickle: trusted files only)."""
        with open(filepath, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise ValueError(f"{filepath} does not hold a DataProto (got {type(data).__name__})")
        return data


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
