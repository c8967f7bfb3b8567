"""The trainer's run directory (`trainer.default_local_dir`, docs/checkpoints.md): its lock, saving
and resuming checkpoints, and the run fingerprint that keeps a resume to the same run.

`TrainerCheckpoints` is a mixin of `RayPPOTrainer` (ray_trainer.py): it reads the trainer's config,
worker groups, KL controller and counters, and owns nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

__all__ = ["TrainerCheckpoints"]

logger = logging.getLogger(__name__)


def _write_fingerprint(step_dir: str, fingerprint: dict) -> None:
    import json

    from verl_arpo.utils.checkpoint.integrity import FINGERPRINT_FILE

    with open(os.path.join(step_dir, FINGERPRINT_FILE), "w") as f:
        json.dump(fingerprint, f, indent=1)



class DifferentRunError(ValueError):
    """The checkpoint to resume was written by a run with other settings (its fingerprint differs)."""


class TrainerCheckpoints:
    """Lock, save, resume and fingerprint for `RayPPOTrainer` (see the module docstring)."""

    # ------------------------------------------------------------------ run lock
    def _acquire_run_lock(self) -> None:
        """Before anything slow starts: a second run on the same default_local_dir is refused in
        seconds, naming the holder, not after its whole start-up."""
        from verl_arpo.utils.checkpoint.integrity import RunDirLock

        if self._run_lock is None:
            self._run_lock = RunDirLock(self._ckpt_root()).acquire()

    def _release_run_lock(self) -> None:
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None

    @contextlib.contextmanager
    def _holding_run_lock(self):
        """The lock for fit(): the one init_workers took, or its own when the workers came another way."""
        owned = self._run_lock is None
        self._acquire_run_lock()
        try:
            yield
        finally:
            if owned:
                self._release_run_lock()

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> str:
        return os.path.abspath(self.config.trainer.default_local_dir)

    def save_checkpoint(self, step: int) -> str:
        from verl_arpo.utils.checkpoint import (abort_checkpoint, begin_checkpoint, cleanup_old_checkpoints,
                                                publish_checkpoint, save_dataloader_state)

        root = self._ckpt_root()
        staging = begin_checkpoint(root, step)
        try:
            self.actor_rollout_wg.save_checkpoint(os.path.join(staging, "actor"), step)
            if self.use_critic:
                self.critic_wg.save_checkpoint(os.path.join(staging, "critic"), step)
            # the data order is a pure function of (data.seed, step): the step is all we need
            save_dataloader_state(staging, {"global_step": step, "kl_coef": self.kl_ctrl.value if self.kl_ctrl else None,
                                            "consecutive_skipped": self.consecutive_skipped,
                                            "wandb_run_id": self.wandb_run_id})
            _write_fingerprint(staging, self.fingerprint)
            path = publish_checkpoint(root, step, staging)
        except BaseException:
            abort_checkpoint(staging)  # the previous checkpoint stays the one resume uses
            raise
        keep = self.config.trainer.max_actor_ckpt_to_keep
        cleanup_old_checkpoints(root, keep)
        self.last_checkpoint = str(path)
        return str(path)

    def load_checkpoint(self) -> int:
        """Resume per trainer.resume_mode; returns the step the checkpoint finished (0 = fresh)."""
        from verl_arpo.utils.checkpoint import (COMPLETE_MARKER, find_resumable_checkpoint, list_checkpoints,
                                                load_dataloader_state)
        from verl_arpo.utils.checkpoint.integrity import verify_checkpoint

        mode = self.config.trainer.resume_mode
        if mode == "disable":
            return 0
        if mode == "resume_path":
            path = self.config.trainer.resume_from_path
            if not path or not os.path.isdir(path):
                raise ValueError(f"trainer.resume_mode=resume_path needs trainer.resume_from_path to be a "
                                 f"global_step_N folder, got {path!r}")
        elif mode == "auto":
            path = find_resumable_checkpoint(self._ckpt_root())
            if path is None:
                if list_checkpoints(self._ckpt_root()):
                    raise ValueError(f"every checkpoint under {self._ckpt_root()} is damaged (see the warnings); "
                                     "set trainer.resume_mode=disable to start over")
                return 0
        else:
            raise ValueError(f"unknown trainer.resume_mode={mode!r}; accepted: auto, disable, resume_path")
        if mode == "resume_path":
            if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
                raise ValueError(f"trainer.resume_from_path={path} has no {COMPLETE_MARKER}: it was never fully "
                                 "written (a save cut short) or is not a global_step_N folder; choose a complete one")
            problems = verify_checkpoint(path, COMPLETE_MARKER)
            if problems:  # the user chose this one: no fallback
                raise ValueError(f"checkpoint {path} is damaged: {'; '.join(problems[:5])}")
        self._check_same_run(path)
        state = load_dataloader_state(path) or {}
        if "global_step" not in state:
            raise ValueError(f"checkpoint {path} has no data.pt with the global step; it was not written by verl_arpo")
        self.actor_rollout_wg.load_checkpoint(os.path.join(path, "actor"))
        if self.use_critic:
            self.critic_wg.load_checkpoint(os.path.join(path, "critic"))
        if self.kl_ctrl is not None and state.get("kl_coef") is not None:
            self.kl_ctrl.value = state["kl_coef"]
        self.wandb_run_id = state.get("wandb_run_id")
        self.consecutive_skipped = int(state.get("consecutive_skipped") or 0)   # the skip limit spans a resume
        self.last_checkpoint = str(path)
        step = int(state["global_step"])
        print(f"[verl_arpo] resumed from {path} (step {step})", flush=True)
        if step >= self.total_training_steps:
            print(f"[verl_arpo] the run in {self._ckpt_root()} is already complete (step {step} >= "
                  f"total_training_steps={self.total_training_steps}): nothing to train. Raise "
                  "trainer.total_training_steps to continue it, or use a new trainer.default_local_dir", flush=True)
        return step

    @functools.cached_property
    def fingerprint(self) -> dict:
        """This run's model, data and algorithm (checkpoint.integrity.run_fingerprint), computed once:
        it reads every weight file whole (~2 s for the quickstart's 0.5 GB here)."""
        from verl_arpo.utils.checkpoint.integrity import run_fingerprint

        return run_fingerprint(self.config)

    def _check_same_run(self, path: str) -> None:
        """Refuse to resume a checkpoint of another model, data or algorithm (trainer.force_resume
        overrides); checkpoints without a fingerprint (older versions) resume with a warning."""
        import json

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
        if self.config.trainer.force_resume:
            logger.warning("resuming %s although the run changed (trainer.force_resume=true):\n  %s", path, listed)
            return
        raise DifferentRunError(f"checkpoint {path} belongs to a different run:\n  {listed}\nUse a new "
                         "trainer.default_local_dir for a new run, or set trainer.force_resume=true to continue "
                         "this one with the changed settings")
