"""Preemption: SIGTERM (what Slurm, Kubernetes and Ray send before they kill) ends a run with a
checkpoint instead of losing everything since the last `save_freq` step.

While `PreemptionGuard` is active in the driver's main thread, SIGTERM only records the request:
the step in flight finishes (its workers are mid-call and cannot be interrupted consistently), the
trainer saves a checkpoint of that step, and the run exits with `Preempted` (exit code 143, as a
process killed by SIGTERM). A save in progress is never aborted by the signal. If the checkpoint is
not written within `trainer.preemption_grace_s` seconds of the signal, the process exits 143 at
once: better a clean exit from the last complete checkpoint than a SIGKILL in the middle of a
write (a half-written staging directory is never published). Resuming continues exactly where the
saved step ended (docs/configuration.md, section `trainer`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

EXIT_CODE = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Preempted(SystemExit):
    """The run stopped on SIGTERM after saving `checkpoint` (exit code 143)."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(EXIT_CODE)
        self.step, self.checkpoint = step, checkpoint

    def __str__(self) -> str:
        return (f"preempted (SIGTERM) after step {self.step}; checkpoint: {self.checkpoint or 'none'}; "
                "restart with trainer.resume_mode=auto to continue")


class PreemptionGuard:
    """Context manager: SIGTERM sets `requested`; a watchdog exits the process `grace_s` seconds
    later unless `done()` was called. Outside the main thread it does nothing (signals go there)."""

    def __init__(self, grace_s: float | None):
        self.grace_s = float(grace_s) if grace_s else None
        self.requested_at: float | None = None
        self._previous = None
        self._done = threading.Event()
        self._active = False

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            return
        self.requested_at = time.monotonic()
        print(f"[verl_arpo] SIGTERM: finishing the step in flight, then saving a checkpoint and exiting "
              f"(grace period {self.grace_s or 'unlimited'} s)", file=sys.stderr, flush=True)
        if self.grace_s:
            threading.Thread(target=self._watchdog, daemon=True, name="preemption-watchdog").start()

    def _watchdog(self) -> None:
        if not self._done.wait(self.grace_s):
            print(f"[verl_arpo] preemption grace period of {self.grace_s:g} s is over before the checkpoint "
                  "was written: exiting now; resume uses the last complete checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(EXIT_CODE)

    def done(self) -> None:
        """The checkpoint is written: the watchdog stands down."""
        self._done.set()

    def __enter__(self) -> "PreemptionGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._active:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._active = False
