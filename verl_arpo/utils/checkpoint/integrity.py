"""Resume the right thing, only: checkpoint manifests, a run-directory lock, a run fingerprint.

- **Manifest.** `publish_checkpoint` records every file of a checkpoint with its size and CRC-32
  in the completeness marker. `verify_checkpoint` re-reads them; `find_intact_checkpoint` walks the
  complete checkpoints newest first and returns the first that verifies, warning about each one it
  skips (a disk that flipped bits, a file truncated by a copy, a planted file).
- **Lock.** `RunDirLock` holds an exclusive `flock` on `<default_local_dir>/.run.lock` for the
  driver's lifetime: a second run on the same directory stops at start-up, naming the holder,
  instead of deleting the first run's staging directories and checkpoints.
- **Fingerprint.** `run_fingerprint(config)` summarises what makes two runs the same run: the model
  (path, config, and the size and CRC-32 of every whole weight file), the training data (path, size, head) and the
  algorithm (advantage estimator, losses, branching). It is saved with every checkpoint;
  `fingerprint_differences` lists what changed, and the trainer refuses to resume across a change
  unless `trainer.force_resume=true` (docs/configuration.md, section `trainer`).
- **Loading** never runs code from a checkpoint: safe_load.py.

CRC-32 (zlib) detects accidental corruption at several GB/s; it is not a defence against an
attacker who can write the directory (safe loading is: a planted file is data).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import zlib
from collections.abc import Iterable
from typing import Any


logger = logging.getLogger(__name__)

FINGERPRINT_FILE = "run_fingerprint.json"
LOCK_FILE = ".run.lock"
_BLOCK = 8 << 20
_HEAD = 1 << 20  # bytes of a file's head digest (kept beside the whole-file CRC-32 for older checkpoints)

# what makes a run "the same run" besides model and data (JobConfig paths)
ALGORITHM_KEYS = (
    "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo", "algorithm.use_kl_in_reward",
    "algorithm.gamma", "algorithm.lam",
    "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.enable_entropy_balanced_clipping",
    "actor_rollout_ref.actor.enable_entropy_balanced_advantage",
    "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.initial_rollouts",
    "actor_rollout_ref.rollout.branch_rule", "actor_rollout_ref.rollout.enable_dynamic_rollouts",
    "actor_rollout_ref.model.lora_rank",
)


# ------------------------------------------------------------------------------------- manifest
def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            crc = zlib.crc32(block, crc)
    return crc


def build_manifest(top: str, skip: Iterable[str] = ()) -> dict[str, dict[str, int]]:
    """{relative path: {"size", "crc32"}} of every file under `top` (except `skip` names)."""
    skip = set(skip)
    out: dict[str, dict[str, int]] = {}
    for dirpath, _, names in os.walk(top):
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, top)
            if rel in skip or os.path.islink(path):
                continue
            out[rel] = {"size": os.path.getsize(path), "crc32": file_crc32(path)}
    return dict(sorted(out.items()))


def verify_checkpoint(path: str, marker_name: str) -> list[str]:
    """Problems of the checkpoint at `path` against its marker's manifest ([] = intact). A marker
    without a manifest (an older checkpoint) verifies by presence only."""
    try:
        with open(os.path.join(path, marker_name)) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        return [f"completeness marker unreadable: {exc}"]
    files = marker.get("files")
    if files is None:
        return [f"{name}: missing" for name in marker.get("contents", [])
                if not os.path.exists(os.path.join(path, name))]
    problems = []
    for rel, want in files.items():
        full = os.path.join(path, rel)
        try:
            size = os.path.getsize(full)
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        if size != want["size"]:
            problems.append(f"{rel}: {size} bytes, expected {want['size']}")
        elif file_crc32(full) != want["crc32"]:
            problems.append(f"{rel}: checksum mismatch")
    return problems


def find_intact_checkpoint(checkpoints: list[tuple[int, str]], marker_name: str) -> str | None:
    """The newest of `checkpoints` ((step, path), oldest first) that verifies; each newer one that
    does not is reported with its problems."""
    for step, path in reversed(checkpoints):
        problems = verify_checkpoint(path, marker_name)
        if not problems:
            return path
        logger.warning("checkpoint %s is damaged (%s); falling back to the previous complete checkpoint",
                       path, "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return None


# ------------------------------------------------------------------------------------------ lock
class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory."""


class RunDirLock:
    """Exclusive, non-blocking `flock` on `<root>/.run.lock` (released when the process exits, even
    by SIGKILL). The file records the holder for the error message of the next one."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.path = os.path.join(self.root, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> "RunDirLock":
        os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirLockedError(
                f"another run is using trainer.default_local_dir={self.root} ({holder}); two runs in one "
                "directory would delete each other's checkpoints. Give this run its own default_local_dir, "
                "or stop the other one") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------------- fingerprint
def _head_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(_HEAD)).hexdigest()[:16]


def _describe_files(paths: Iterable[str]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        p = os.path.abspath(os.path.expanduser(str(p)))
        try:
            # the whole file (CRC-32 at GB/s): a same-size change anywhere (a fine-tune with frozen
            # embeddings swapped into the folder) is a different run; "head" keeps older checkpoints comparable
            out.append({"path": p, "size": os.path.getsize(p), "head": _head_digest(p), "crc32": file_crc32(p)})
        except OSError:
            out.append({"path": p, "size": None, "head": None, "crc32": None})
    return out


def _same_files(saved: Any, current: Any) -> bool:
    """File lists equal on the fields both records have (a checkpoint from before whole-file CRCs
    compares on path, size and head only)."""
    if not isinstance(saved, list) or not isinstance(current, list) or len(saved) != len(current):
        return saved == current
    return all(isinstance(a, dict) and isinstance(b, dict) and all(a[k] == b[k] for k in set(a) & set(b))
               for a, b in zip(saved, current))


def _same_section(saved: Any, current: Any) -> bool:
    if isinstance(saved, dict) and isinstance(current, dict) and set(saved) == set(current):
        return all(_same_files(saved[k], current[k]) if isinstance(saved[k], list) else saved[k] == current[k]
                   for k in saved)
    return _same_files(saved, current)


def _raw(config: Any, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def _select(config: Any, dotted: str) -> Any:
    node = _raw(config, dotted)
    return node if node is None or isinstance(node, (str, int, float, bool)) else str(node)


def run_fingerprint(config: Any) -> dict[str, Any]:
    """What identifies a run: model, training data, algorithm (see the module docstring)."""
    model = os.path.abspath(os.path.expanduser(str(_select(config, "actor_rollout_ref.model.path"))))
    weights = sorted(os.path.join(model, n) for n in os.listdir(model)
                     if n.endswith((".safetensors", ".bin", ".pt"))) if os.path.isdir(model) else []
    cfg_file = os.path.join(model, "config.json")
    files = _raw(config, "data.train_files") or []
    files = [files] if isinstance(files, str) else list(files)
    return {
        "model": {"path": model, "config": _head_digest(cfg_file) if os.path.isfile(cfg_file) else None,
                  "weights": _describe_files(weights)},
        "data": _describe_files(files),
        "algorithm": {k: _select(config, k) for k in ALGORITHM_KEYS},
    }


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between two fingerprints ([] = the same run)."""
    diffs = []
    for section in ("model", "data"):
        if not _same_section(saved.get(section), current.get(section)):
            diffs.append(f"{section}: was {json.dumps(saved.get(section))[:300]}, now "
                         f"{json.dumps(current.get(section))[:300]}")
    old, new = saved.get("algorithm", {}), current.get("algorithm", {})
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            diffs.append(f"{key}: was {old.get(key)!r}, now {new.get(key)!r}")
    return diffs
