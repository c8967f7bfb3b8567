"""Reading a checkpoint never runs code from it (docs/checkpoints.md, "What a checkpoint can and cannot do").

A checkpoint folder can be written by someone else (a shared file system, a downloaded run) or by
the model itself (the Python tool's sandbox shares nothing with it, but a run directory may be
mounted elsewhere). Every file is therefore read as data:

- `safe_torch_load(path)`: `torch.load(weights_only=True)` for `data.pt` and `extra_state_*.pt`.
- `SafeFileSystemReader`: torch DCP's reader, except that `.metadata` is unpickled by
  `MetadataUnpickler`, which resolves only the classes a DCP metadata file holds (the metadata
  dataclasses, torch.Size, dtypes, layouts, memory formats, a path). Torch 2.13's own reader uses
  plain `pickle.load`.
- `SafeLoadPlanner`: DCP's default planner, except that a non-tensor entry (optimizer param groups
  and the like, written with `torch.save`) is read with `weights_only=True`; torch's planner uses
  `weights_only=False`.
- `safe_dcp_load(state, path)`: `dcp.load` with both, for every loader (resume, offline reading,
  the merge tool, evaluation from a checkpoint).

What this defends: a planted or altered file cannot execute anything while it is read; the load
fails with an error naming the file. What it does not defend: the values themselves. A file that
holds other valid weights loads them; the CRC-32 manifest (integrity.py) catches accidental
damage, not a deliberate rewrite of file and manifest together.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["UnsafeCheckpointError", "safe_torch_load", "MetadataUnpickler", "SafeFileSystemReader",
           "SafeLoadPlanner", "safe_dcp_load"]

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
      ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
      ("collections", "OrderedDict")}
"""(module, name) pairs a DCP `.metadata` file may name; torch dtypes and memory formats are checked apart."""


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something other than data (a pickled reference to code)."""


def safe_torch_load(path: str) -> Any:
    """torch.load that cannot run code: `weights_only=True` (tensors, numbers, strings, containers),
    plus numpy's array reconstruction so that checkpoints written before RNG states were stored as
    tensors still load. A file planted in a checkpoint directory is data at worst, never a program."""
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        allowed.append(np._core.multiarray._reconstruct)  # numpy >= 2
    except AttributeError:
        allowed.append(np.core.multiarray._reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path}: refused to load, it holds more than plain data ({exc})") from exc


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, resolving only the globals such a file holds."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of a DCP metadata file")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by `MetadataUnpickler` (never plain `pickle.load`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, TypeError, EOFError) as exc:
                raise UnsafeCheckpointError(f"{path}: refused to load, not a DCP metadata file of plain data "
                                            f"({exc})") from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: refused to load, it holds a {type(metadata).__name__}, not "
                                        "DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with non-tensor entries read by `torch.load(weights_only=True)`."""

    def __init__(self, reader: SafeFileSystemReader, **kwargs: Any):
        super().__init__(**kwargs)
        self._reader = reader

    def _file_of(self, read_item) -> str:
        info = getattr(self._reader, "storage_data", {}).get(read_item.storage_index)
        return os.path.join(str(self._reader.path), info.relative_path) if info is not None else str(self._reader.path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpointError(f"{self._file_of(read_item)}: refused to load entry "
                                        f"{read_item.dest_index.fqn!r}, it holds more than plain data ({exc})") from exc
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state: dict, path: str, *, no_dist: bool) -> None:
    """`dcp.load(state, checkpoint_id=path)` with the safe reader and planner (see the module docstring).
    A refused file raises UnsafeCheckpointError naming it (DCP would wrap it in a CheckpointException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SafeFileSystemReader(path)
    reader.read_metadata()   # the metadata first, here: its refusal is then raised as it is
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=no_dist)
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exception", failure)
            if isinstance(inner, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(inner)) from exc
        raise
