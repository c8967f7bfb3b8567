"""Where checkpoints live and how one is published (the layout in this package's docstring): names,
crash-safe publishing through a staging directory, the tracker file, cleanup, the dataloader state,
and the messages of a failed save."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time

import torch
from torch.distributed.checkpoint.api import CheckpointException

from verl_arpo.utils.checkpoint.integrity import build_manifest, find_intact_checkpoint
from verl_arpo.utils.checkpoint.safe_load import safe_torch_load

logger = logging.getLogger(__name__)

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
    checksums; damaged newer ones are skipped with a warning (integrity.py)."""
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
        atomic_write_text(os.path.join(staging, COMPLETE_MARKER), json.dumps(marker, indent=1))
        aside = None
        if os.path.exists(final):  # re-saving a step: move the old one aside, then swap
            aside = os.path.join(root, f".global_step_{int(step)}.replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(final, aside)
        os.rename(staging, final)
        _fsync(root)
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
        atomic_write_text(os.path.join(root, TRACKER_FILE), str(int(step)))
    except OSError as e:
        raise CheckpointSaveError(save_failure_message(staging, e)) from e
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


def atomic_write_text(path: str, text: str) -> None:
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


def save_failure_message(path: str, exc: BaseException) -> str:
    root = _root_of(path)
    prev = find_latest_ckpt_path(root) if root else None
    tail = (f"the previous checkpoint {prev} is intact and is the one resume will use"
            if prev else "no earlier checkpoint exists under this root")
    return f"could not write checkpoint to {path}: {_reason(exc, path)}. Nothing was published; {tail}."
