"""Per-row helpers of DataProto (verl_arpo/protocol.py): object arrays for per-row Python values,
the union rules for tensors, non-tensors and meta_info, and row indexing. Torch, numpy and
tensordict only; no DataProto here, so protocol.py imports this module and not the reverse."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["as_object_array", "union_tensor_dict", "union_numpy_dict", "to_non_tensor", "union_meta", "merge_metrics",
           "index_tensor"]



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


def to_non_tensor(key: str, value: Any) -> np.ndarray:
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


def union_meta(dict1: dict, dict2: dict) -> dict:
    for key, val in dict2.items():
        if key in dict1:
            if not _values_equal(dict1[key], val):
                raise ValueError(f"union: meta_info key {key!r} exists in both with different values")
        else:
            dict1[key] = val
    return dict1


def merge_metrics(parts: list[Any]) -> dict[str, list]:
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


def index_tensor(idxs: Any, length: int) -> torch.Tensor:
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
