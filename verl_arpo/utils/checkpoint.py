"""Checkpoints: sharded save/load of FSDP2 (or plain) modules, crash-safe publishing, offline reading.

Layout (directory names as in verl, so scripts and users find things where they expect them):

    <root>/latest_checkpointed_iteration.txt   step of the newest *published* checkpoint
    <root>/global_step_{N}/                    a published checkpoint (never written in place)
        checkpoint_complete.json                marker written just before publishing
        data.pt                                 dataloader state (written by the trainer)
        actor/   critic/                        one `FSDPCheckpointManager` directory each:
            model/  optim/                      torch.distributed.checkpoint (DCP), sharded per rank
            extra_state_rank_{r}.pt             lr scheduler + RNG states of rank r
            huggingface/                        config, generation config, tokenizer (rank 0)
            lora_adapter/adapter_config.json    only for peft LoRA models
            checkpoint_meta.json                written last: the directory is complete
    <root>/.global_step_{N}.partial/           staging directory of a save in progress

Crash safety: a save goes to the staging directory; only after every writer has finished does the
driver fsync it, rename it to `global_step_N` (atomic) and then rewrite the tracker file through a
temporary file and `os.replace` (atomic). A SIGKILL or a full disk at any point leaves at worst a
`.partial` directory, which resume ignores; the previous checkpoint is never touched.

Model keys are the module's own parameter names: HF names for FSDP2 (`fully_shard` adds no prefix)
and plain modules, peft's names for LoRA models (then `checkpoint_meta.json` records `lora`).

Not done here: asynchronous saves, HDFS copies, and reading verl's own FSDP1 sharded files
(`model_world_size_W_rank_R.pt`); checkpoints are written and read in this project's DCP layout.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from verl_arpo.utils.checkpoint_integrity import build_manifest, find_intact_checkpoint
from verl_arpo.utils.checkpoint_safe_load import SafeFileSystemReader, safe_dcp_load, safe_torch_load

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "checkpoint_complete.json"
META_FILE = "checkpoint_meta.json"
FORMAT = "verl_arpo.dcp/1"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_STAGING_RE = re.compile(r"^\.global_step_(\d+)\.partial$")
_NEARLY_FULL = 64 * 1024**2  # below this many free bytes, a failed write is reported as disk full

logger = logging.getLogger(__name__)


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the message names the path and the surviving checkpoint."""


# --------------------------------------------------------------------------- layout + publishing
def checkpoint_dir(root: str, step: int) -> str:
    """The published directory of step `step`: `root/global_step_{step}`."""
    return os.path.join(root, f"global_step_{int(step)}")


def staging_dir(root: str, step: int) -> str:
    """The staging directory of a save in progress: `root/.global_step_{step}.partial`."""
    return os.path.join(root, f".global_step_{int(step)}.partial")


def is_complete_checkpoint(path: str) -> bool:
    """True when `path` is a published checkpoint directory (it holds the completeness marker)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete `global_step_*` directories under `root`, as (step, path), oldest first."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and is_complete_checkpoint(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def find_latest_ckpt_path(root: str | None) -> str | None:
    """Path of the newest complete checkpoint under `root`, or None.

    Reads the tracker file first (verl's behaviour); when it is missing, unreadable or points to a
    directory that is not complete, falls back to the newest complete `global_step_*` directory.
    Staging (`.partial`) directories are never returned.
    """
    if not root or not os.path.isdir(root):
        return None
    tracker = os.path.join(root, TRACKER_FILE)
    try:
        with open(tracker) as f:
            step = int(f.read().strip())
        path = checkpoint_dir(root, step)
        if is_complete_checkpoint(path):
            return path
        logger.warning(f"{tracker} points to step {step}, but {path} is missing or incomplete; "
                      "scanning for the newest complete checkpoint")
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        logger.warning(f"cannot read {tracker} ({e}); scanning for the newest complete checkpoint")
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def find_resumable_checkpoint(root: str | None) -> str | None:
    """The newest complete checkpoint under `root` whose files match their recorded sizes and
    checksums; damaged newer ones are skipped with a warning (checkpoint_integrity.py)."""
    return find_intact_checkpoint(list_checkpoints(root), COMPLETE_MARKER) if root else None


def get_checkpoint_step(path: str) -> int:
    """The step number of a `global_step_N` directory (or of a path inside one)."""
    for part in reversed(os.path.normpath(os.path.abspath(path)).split(os.sep)):
        m = _STEP_RE.match(part) or _STAGING_RE.match(part)
        if m:
            return int(m.group(1))
    raise ValueError(f"{path} is not inside a global_step_N directory")


def begin_checkpoint(root: str, step: int) -> str:
    """Create (after removing any stale one) and return the staging directory of step `step`.

    Workers write their parts into `<staging>/actor`, `<staging>/critic`; the trainer writes
    `<staging>/data.pt`; then the driver calls `publish_checkpoint`.
    """
    os.makedirs(root, exist_ok=True)
    staging = staging_dir(root, step)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    os.makedirs(staging)
    return staging


def abort_checkpoint(staging: str) -> None:
    """Best-effort removal of a staging directory after a failed save (frees the disk space)."""
    shutil.rmtree(staging, ignore_errors=True)


def publish_checkpoint(root: str, step: int, staging: str) -> str:
    """Make a finished staging directory the checkpoint of `step`; return its final path.

    Driver only, after every writer has returned. Order: fsync every file and directory of the
    staging tree, write the completeness marker, rename the staging directory to `global_step_N`,
    fsync `root`, then atomically rewrite the tracker file. Failing anywhere before the rename
    publishes nothing; failing after it leaves the tracker on the previous step (still valid).
    """
    if not os.path.isdir(staging):
        raise FileNotFoundError(f"staging directory {staging} does not exist")
    final = checkpoint_dir(root, step)
    try:
        _fsync_tree(staging)
        marker = {"global_step": int(step), "published_at": time.time(),
                  "contents": sorted(os.listdir(staging)),
                  "files": build_manifest(staging, skip=[COMPLETE_MARKER])}  # verified before a resume
        _atomic_write_text(os.path.join(staging, COMPLETE_MARKER), json.dumps(marker, indent=1))
        aside = None
        if os.path.exists(final):  # re-saving a step: move the old one aside, then swap
            aside = os.path.join(root, f".global_step_{int(step)}.replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(staging, final)
        _fsync(root)
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
        _atomic_write_text(os.path.join(root, TRACKER_FILE), str(int(step)))
    except OSError as e:
        raise CheckpointSaveError(_failure_message(staging, e)) from e
    return final


def cleanup_old_checkpoints(root: str, keep: int | None) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints (None or <= 0: keep all).

    The checkpoint the tracker points to is never deleted. Leftover staging directories of crashed
    saves are removed too, so call this on the driver between saves only. Returns removed paths.
    """
    if not root or not os.path.isdir(root):
        return []
    latest = find_latest_ckpt_path(root)
    removed = []
    if keep is not None and keep > 0:
        for _, path in list_checkpoints(root)[:-keep]:
            if latest and os.path.samefile(path, latest):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for name in sorted(os.listdir(root)):
        if _STAGING_RE.match(name) or name.endswith(".replaced"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(os.path.join(root, name))
    return removed


def save_dataloader_state(step_dir: str, state: dict) -> str:
    """Write the trainer's dataloader state to `<step_dir>/data.pt` (step_dir: staging or final)."""
    path = os.path.join(step_dir, "data.pt")
    torch.save(state, path)
    return path


def load_dataloader_state(step_dir: str) -> dict | None:
    """Read `<step_dir>/data.pt`, or None when it is absent."""
    path = os.path.join(step_dir, "data.pt")
    return safe_torch_load(path) if os.path.isfile(path) else None


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync(os.path.dirname(path) or ".")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: str) -> None:
    for dirpath, _, files in os.walk(top):
        for name in files:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _root_of(path: str) -> str | None:
    """The checkpoint root above a staging or step directory, if `path` lies inside one."""
    cur = os.path.abspath(path)
    while True:
        parent, name = os.path.split(cur)
        if _STAGING_RE.match(name) or _STEP_RE.match(name):
            return parent
        if parent == cur:
            return None
        cur = parent


def _reason(exc: BaseException, path: str) -> str:
    """A one-line reason; "disk full" when an errno says so or the filesystem is (nearly) full.

    Looks through DCP's CheckpointException (per-rank failures) and exception chains: a short write
    inside torch.save surfaces as a RuntimeError ("unexpected pos"), not as ENOSPC.
    """
    todo, seen, found = [exc], set(), []
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        if isinstance(e, CheckpointException):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in e.failures.values())
        todo.extend([e.__cause__, e.__context__])
    if any((isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
           or "No space left" in str(e) for e in found):
        return "no space left on device (disk full)"
    first = next((e for e in found if not isinstance(e, CheckpointException)), exc)
    text = f"{type(first).__name__}: {first}".splitlines()[0]
    free = _free_bytes(path)
    if free is not None and free < _NEARLY_FULL:
        return f"no space left on device (disk full: {free} bytes free; error: {text})"
    return text


def _free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _failure_message(path: str, exc: BaseException) -> str:
    root = _root_of(path)
    prev = find_latest_ckpt_path(root) if root else None
    tail = (f"the previous checkpoint {prev} is intact and is the one resume will use"
            if prev else "no earlier checkpoint exists under this root")
    return f"could not write checkpoint to {path}: {_reason(exc, path)}. Nothing was published; {tail}."


# --------------------------------------------------------------------------- model helpers
def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a peft wrapper (FSDP2 keeps the module itself)."""
    return model.get_base_model() if _is_peft(model) else model


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _reshard(model: torch.nn.Module) -> None:
    """Put FSDP2 modules back to sharded state (a no_grad forward leaves the root unsharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """Silence DCP's 'assuming single process' warning: without a process group that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")
        yield


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _world() -> int:
    return dist.get_world_size() if _dist_on() else 1


def _agree(error: str | None) -> list[str]:
    """Collective: every rank learns every rank's local error (also serves as a barrier)."""
    if not _dist_on():
        return [error] if error else []
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return [f"rank {r}: {e}" for r, e in enumerate(gathered) if e]


def tied_duplicate_keys(state_dict: dict, config) -> list[str]:
    """Keys HF does not store because they are tied to another (the LM head of tied models)."""
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (getattr(text_cfg, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)):
        return []
    out = []
    for head in [k for k in state_dict if k.endswith("lm_head.weight")]:
        emb = head[: -len("lm_head.weight")] + "model.embed_tokens.weight"
        if emb in state_dict and torch.equal(state_dict[head], state_dict[emb]):
            out.append(head)
    return out


def save_hf_safetensors(state_dict: dict, out_dir: str, max_shard_size: int = 5 * 1024**3) -> list[str]:
    """Write `state_dict` as HF safetensors (`model.safetensors`, or shards + index); return files.

    Shards are written one at a time, so at most one shard is copied in memory.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    nbytes = {k: t.numel() * t.element_size() for k, t in state_dict.items()}
    groups, size = [[]], 0
    for key in state_dict:
        if groups[-1] and size + nbytes[key] > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes[key]
    n = len(groups)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    names = names if n > 1 else ["model.safetensors"]
    for name, keys in zip(names, groups):
        shard, seen = {}, set()
        for k in keys:  # safetensors refuses tensors sharing storage: copy those
            t = state_dict[k].detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            shard[k] = t.clone() if ptr in seen else t
            seen.add(ptr)
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {k: name for name, keys in zip(names, groups) for k in sorted(keys)}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


# --------------------------------------------------------------------------- the manager
class FSDPCheckpointManager:
    """Save/load one model (+ optimizer, lr scheduler, RNG) as a sharded DCP checkpoint directory.

    Works with FSDP2 (`fully_shard`) modules on any number of ranks, and with plain modules when
    there is no process group. `checkpoint_contents` selects what is saved and loaded: "model",
    "optimizer", "extra" (lr scheduler + RNG), and optionally "hf_model" (also write full HF
    safetensors into `huggingface/`; gathers the full state dict, so costly for big models).
    All ranks must call `save_checkpoint`/`load_checkpoint` together.
    """

    def __init__(self, model, optimizer=None, lr_scheduler=None, processing_class=None,
                 checkpoint_contents: Iterable[str] = ("model", "optimizer", "extra"), hf_config=None):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.processing_class = processing_class
        self.checkpoint_contents = tuple(checkpoint_contents)
        unknown = set(self.checkpoint_contents) - {"model", "optimizer", "extra", "hf_model"}
        if unknown:
            raise ValueError(f"unknown checkpoint contents {sorted(unknown)}")
        self.hf_config = hf_config if hf_config is not None else getattr(unwrap_model(model), "config", None)

    # ---- save
    def save_checkpoint(self, local_path: str, global_step: int | None = None) -> None:
        """Write this model's checkpoint into `local_path` (a fresh directory, usually in staging).

        Raises `CheckpointSaveError` on every rank when any rank fails to write (e.g. disk full);
        the message names the path and the previous checkpoint, which stays intact.
        """
        contents = self.checkpoint_contents
        rank = _rank()
        try:
            os.makedirs(local_path, exist_ok=True)
            with _quiet_single_process():
                for sub, sd in self._dcp_state_dicts():
                    dcp.save(sd, checkpoint_id=os.path.join(local_path, sub), no_dist=not _dist_on())
            full_sd = None
            if "hf_model" in contents and not _is_peft(self.model):
                opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
                full_sd = get_model_state_dict(self.model, options=opts)
        except (OSError, CheckpointException) as e:  # collective steps fail on every rank alike
            raise CheckpointSaveError(_failure_message(local_path, e)) from e

        local_error = None
        try:
            if "extra" in contents:
                torch.save(self._extra_state(), os.path.join(local_path, f"extra_state_rank_{rank}.pt"))
            if rank == 0:
                self._save_hf_folder(os.path.join(local_path, "huggingface"), full_sd)
                self._save_lora_config(local_path)
        except OSError as e:
            local_error = _failure_message(local_path, e)
        errors = _agree(local_error)
        if not errors and rank == 0:
            try:
                meta = self._meta(global_step, contents)
                _atomic_write_text(os.path.join(local_path, META_FILE), json.dumps(meta, indent=1))
            except OSError as e:
                local_error = _failure_message(local_path, e)
        errors = errors or _agree(local_error)
        if errors:
            raise CheckpointSaveError(errors[0] if len(errors) == 1 else "; ".join(errors))

    def _dcp_state_dicts(self) -> list[tuple[str, dict]]:
        """(DCP sub-directory, state dict) pairs named by the contents (FSDP2 modules resharded)."""
        _reshard(self.model)
        if self.optimizer is not None and "optimizer" in self.checkpoint_contents:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            return [("model", model_sd)] * ("model" in self.checkpoint_contents) + [("optim", optim_sd)]
        return [("model", get_model_state_dict(self.model))] * ("model" in self.checkpoint_contents)

    def _extra_state(self) -> dict:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        # tensors and plain values only: the file loads with torch.load(weights_only=True)
        rng = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                       int(has_gauss), float(cached)),
               "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        sched = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {"lr_scheduler": sched, "rng": rng, "world_size": _world()}

    def _save_hf_folder(self, hf_dir: str, full_sd: dict | None) -> None:
        os.makedirs(hf_dir, exist_ok=True)
        if self.hf_config is not None:
            self.hf_config.save_pretrained(hf_dir)
        gen = getattr(unwrap_model(self.model), "generation_config", None)
        if gen is not None:
            gen.save_pretrained(hf_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(hf_dir)
        if full_sd is not None:
            for k in tied_duplicate_keys(full_sd, self.hf_config):
                del full_sd[k]
            save_hf_safetensors(full_sd, hf_dir)

    def _adapter(self):
        """(adapter name, peft config) of a peft model, else None."""
        if not _is_peft(self.model):
            return None
        name = getattr(self.model, "active_adapter", "default")
        return name, self.model.peft_config[name]

    def _save_lora_config(self, local_path: str) -> None:
        if self._adapter():
            self._adapter()[1].save_pretrained(os.path.join(local_path, "lora_adapter"))

    def _meta(self, global_step, contents) -> dict:
        lora = None
        if self._adapter():
            name, cfg = self._adapter()
            lora = {"adapter_name": name, "peft_type": str(getattr(cfg, "peft_type", "LORA")),
                    "config_dir": "lora_adapter", "base_model_name_or_path": cfg.base_model_name_or_path}
        return {"format": FORMAT, "global_step": global_step, "world_size": _world(),
                "contents": list(contents), "model_class": type(unwrap_model(self.model)).__name__,
                "lora": lora, "torch_version": torch.__version__, "saved_at": time.time()}

    # ---- load
    def load_checkpoint(self, local_path: str | None) -> None:
        """Load what `checkpoint_contents` names from `local_path` (None: do nothing).

        The number of ranks may differ from the one that saved (DCP reshards); RNG states are then
        not restored (there is no matching rank), with a warning.
        """
        if local_path is None:
            return
        meta = read_checkpoint_meta(local_path)
        contents = self.checkpoint_contents
        for part in ("model", "optimizer"):
            if part in contents and part not in meta["contents"] and (part == "model" or self.optimizer):
                raise FileNotFoundError(f"{local_path} holds no {part} state (saved: {meta['contents']}); "
                                        f"drop '{part}' from the checkpoint contents to load the rest")
        sds = dict(self._dcp_state_dicts())
        with _quiet_single_process():
            for sub, sd in sds.items():
                safe_dcp_load(sd, os.path.join(local_path, sub), no_dist=not _dist_on())
        if "optim" in sds:
            model_sd = sds.get("model") or get_model_state_dict(self.model)
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd,
                           optim_state_dict=sds["optim"])
        elif "model" in sds:
            set_model_state_dict(self.model, sds["model"])
        if "extra" in contents and "extra" in meta.get("contents", []):
            self._load_extra(local_path, meta)
        if _dist_on():
            dist.barrier()

    def _load_extra(self, local_path: str, meta: dict) -> None:
        rank = _rank()
        path = os.path.join(local_path, f"extra_state_rank_{rank}.pt")
        same_world = meta.get("world_size") == _world()
        if not os.path.isfile(path):
            path = os.path.join(local_path, "extra_state_rank_0.pt")
        state = safe_torch_load(path)
        if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if not same_world:
            logger.warning(f"checkpoint saved with {meta.get('world_size')} ranks, loading with "
                          f"{_world()}: RNG states are not restored")
            return
        rng = state["rng"]
        random.setstate(rng["python"])
        name, keys, *rest = rng["numpy"]
        keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)  # older files: an array
        np.random.set_state((name, keys.astype(np.uint32), *rest))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


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
    with _quiet_single_process():
        safe_dcp_load(state, model_dir, no_dist=True)
    return state
