"""The trainer's run directory (`trainer.default_local_dir`, docs/checkpoints.md): its lock, the
checkpoints saved into it and resumed from it, and the run fingerprint that keeps a resume to the
same run.

`RunDirectory` owns the folder and what is written there; the trainer (ray_trainer.py) owns the
worker groups and its counters, and hands them over when it saves (`save`) or takes them back when it
resumes (`resume_point`, then `load_state`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os

__all__ = ["RunDirectory", "DifferentRunError"]

logger = logging.getLogger(__name__)


class DifferentRunError(ValueError):
    """The checkpoint to resume was written by a run with other settings (its fingerprint differs)."""


class RunDirectory:
    """`trainer.default_local_dir` of one run: lock, save, resume and fingerprint.

    config: the run's JobConfig (its trainer section says where, how many to keep and how to resume;
    the fingerprint reads the model, data and algorithm keys)."""

    def __init__(self, config) -> None:
        self.config = config
        self.trainer = config.trainer
        self.root = os.path.abspath(self.trainer.default_local_dir)
        self._lock = None
        self._claimed: tuple[str | None] | None = None   # claim()'s resume point, until resume_point takes it

    def claim(self) -> "RunDirectory":
        """Take the folder before a cluster or a worker starts (main_ppo.run): the lock, then the
        checkpoint to resume, checked whole and checked to be this run's. A second run, a changed run
        and a damaged resume_path are refused in seconds, not after the start-up. The first
        `resume_point()` then returns what this found (the lock keeps it valid)."""
        self.acquire_lock()
        try:
            self._claimed = (self._resolve_resume_point(),)
        except BaseException:
            self.release_lock()
            raise
        return self

    # ------------------------------------------------------------------ lock
    def acquire_lock(self) -> None:
        """Before anything slow starts: a second run on the same folder is refused in seconds,
        naming the holder, not after its whole start-up."""
        from verl_arpo.utils.checkpoint.integrity import RunDirLock

        if self._lock is None:
            self._lock = RunDirLock(self.root).acquire()

    def release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @contextlib.contextmanager
    def holding_lock(self):
        """The lock for fit(): the one init_workers took, or its own when the workers came another way."""
        owned = self._lock is None
        self.acquire_lock()
        try:
            yield
        finally:
            if owned:
                self.release_lock()

    # ------------------------------------------------------------------ save
    def save(self, step: int, worker_groups: dict, state: dict) -> str:
        """Write step `step` as global_step_N: each worker group's shards into its own subfolder
        (`worker_groups`: subfolder name → group), the driver's `state` into data.pt, and the
        fingerprint; published atomically, then the oldest beyond max_actor_ckpt_to_keep removed.
        A failure leaves the previous checkpoint the one resume uses. Returns the folder."""
        from verl_arpo.utils.checkpoint import (abort_checkpoint, begin_checkpoint, cleanup_old_checkpoints,
                                                publish_checkpoint, save_dataloader_state)
        from verl_arpo.utils.checkpoint.integrity import FINGERPRINT_FILE

        staging = begin_checkpoint(self.root, step)
        try:
            for name, group in worker_groups.items():
                group.save_checkpoint(os.path.join(staging, name), step)
            # the data order is a pure function of (data.seed, step): the step is all it needs
            save_dataloader_state(staging, {"global_step": step, **state})
            with open(os.path.join(staging, FINGERPRINT_FILE), "w") as f:
                json.dump(self.fingerprint, f, indent=1)
            path = publish_checkpoint(self.root, step, staging)
        except BaseException:
            abort_checkpoint(staging)
            raise
        cleanup_old_checkpoints(self.root, self.trainer.max_actor_ckpt_to_keep)
        return str(path)

    # ------------------------------------------------------------------ resume
    def resume_point(self) -> str | None:
        """The checkpoint folder trainer.resume_mode resumes from, checked whole and checked to be
        this run's (None: start fresh); claim()'s answer the first time after a claim."""
        if self._claimed is not None:
            (path,), self._claimed = self._claimed, None
            return path
        return self._resolve_resume_point()

    def _resolve_resume_point(self) -> str | None:
        from verl_arpo.utils.checkpoint import COMPLETE_MARKER, find_resumable_checkpoint, list_checkpoints
        from verl_arpo.utils.checkpoint.integrity import verify_checkpoint

        mode = self.trainer.resume_mode
        if mode == "disable":
            return None
        if mode == "resume_path":
            path = self.trainer.resume_from_path
            if not path or not os.path.isdir(path):
                raise ValueError(f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a "
                                 f"global_step_N folder, got {path!r}")
            if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
                raise ValueError(f"trainer.resume_from_path={path} has no {COMPLETE_MARKER}: it was never fully "
                                 "written (a save cut short) or is not a global_step_N folder; choose a complete one")
            problems = verify_checkpoint(path, COMPLETE_MARKER)
            if problems:  # the user chose this one: no fallback
                raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems[:5])}")
        elif mode == "auto":
            path = find_resumable_checkpoint(self.root)
            if path is None:
                if list_checkpoints(self.root):
                    raise ValueError(f"every checkpoint under {self.root} is damaged (see the warnings); "
                                     "set trainer.resume_mode=disable to start over")
                return None
        else:
            raise ValueError(f"unknown trainer.resume_mode={mode!r}; accepted: auto, disable, resume_path")
        self._check_same_run(path)
        return str(path)

    @staticmethod
    def load_state(path: str) -> dict:
        """The driver's state saved with checkpoint `path` (global_step and what `save` was given)."""
        from verl_arpo.utils.checkpoint import load_dataloader_state

        state = load_dataloader_state(path) or {}
        if "global_step" not in state:
            raise ValueError(f"checkpoint {path} has no data.pt with the global step; it was not written by verl_arpo")
        return state

    # ------------------------------------------------------------------ fingerprint
    @functools.cached_property
    def fingerprint(self) -> dict:
        """This run's model, data and algorithm (checkpoint.integrity.run_fingerprint), computed once:
        it reads every weight file whole (~2 s for the quickstart's 0.5 GB here)."""
        from verl_arpo.utils.checkpoint.integrity import run_fingerprint

        return run_fingerprint(self.config)

    def _check_same_run(self, path: str) -> None:
        """Refuse to resume a checkpoint of another model, data or algorithm (trainer.force_resume
        overrides); checkpoints without a fingerprint (older versions) resume with a warning."""
        from verl_arpo.utils.checkpoint.integrity import FINGERPRINT_FILE, fingerprint_differences

        saved_file = os.path.join(path, FINGERPRINT_FILE)
        if not os.path.isfile(saved_file):
            logger.warning("checkpoint %s has no %s: cannot tell whether it belongs to this run", path, FINGERPRINT_FILE)
            return
        with open(saved_file) as f:
            diffs = fingerprint_differences(json.load(f), self.fingerprint)
        if not diffs:
            return
        listed = "\n  ".join(diffs)
        if self.trainer.force_resume:
            logger.warning("resuming %s although the run changed (trainer.force_resume=true):\n  %s", path, listed)
            return
        raise DifferentRunError(f"checkpoint {path} belongs to a different run:\n  {listed}\nUse a new "
                                "trainer.default_local_dir for a new run, or set trainer.force_resume=true to "
                                "continue this one with the changed settings")
