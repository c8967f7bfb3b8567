"""Reading a checkpoint in one process, without a process group (the merge tool, evaluation)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from verl_arpo.utils.checkpoint.layout import META_FILE
from verl_arpo.utils.checkpoint.safe_load import SafeFileSystemReader, safe_dcp_load


@contextlib.contextmanager
def quiet_single_process():
    """Silence DCP's 'assuming single process' warning: without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")
        yield


# --------------------------------------------------------------------------- offline reading
def read_checkpoint_meta(actor_dir: str) -> dict:
    """The `checkpoint_meta.json` of a manager directory (clear error if it is not one)."""
    path = os.path.join(actor_dir, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{actor_dir} is not a complete verl_arpo checkpoint directory "
                                f"(no {META_FILE}); expected the 'actor' directory of a global_step_N")
    with open(path) as f:
        return json.load(f)


def load_model_state_offline(actor_dir: str, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Read the full (unsharded) model state dict of a manager directory in this one process.

    No process group is needed and any number of saved shards is fine: the tensors are allocated
    from the DCP metadata and filled by `safe_dcp_load` (nothing in the folder can run code).
    Memory: the whole model.
    """
    model_dir = os.path.join(actor_dir, "model")
    metadata = SafeFileSystemReader(model_dir).read_metadata()
    wanted = set(keys) if keys is not None else None
    state = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and (wanted is None or key in wanted):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with quiet_single_process():
        safe_dcp_load(state, model_dir, no_dist=True)
    return state
