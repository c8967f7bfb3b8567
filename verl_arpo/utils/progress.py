"""Signs of life inside a long step: one plain line at a time (readable in CI and cluster logs,
where stdout is a file), at most every `VERL_ARPO_PROGRESS_S` seconds (default 15; 0 = every
event, a negative value = never), printed by rank 0 only (`RANK`, set for every worker).

    [rollout] round 2: 18/32 trajectories finished, 25 tool calls, 3412 tokens generated (21 s)
    [update] micro-batch 5/9 of mini-batch 1/1 (34 s)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

ENV_INTERVAL = "VERL_ARPO_PROGRESS_S"


class Progress:
    """`progress(message)` prints `[what] message (elapsed)` when the interval has passed since the
    last line (or `force=True`); silent on ranks other than 0."""

    def __init__(self, what: str, interval_s: float | None = None):
        if interval_s is None:
            try:
                interval_s = float(os.environ.get(ENV_INTERVAL, "15"))
            except ValueError:
                interval_s = 15.0
        self.what, self.interval_s = what, interval_s
        self.enabled = interval_s >= 0 and os.environ.get("RANK", "0") == "0"
        self.start = self.last = time.monotonic()

    def __call__(self, message: str | Callable[[], str], force: bool = False) -> None:
        """`message` may be a callable: it is only built when a line is printed (hot loops)."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self.last < self.interval_s):
            return
        self.last = now
        text = message() if callable(message) else message
        print(f"[{self.what}] {text} ({now - self.start:.0f} s)", file=sys.stdout, flush=True)
