"""The reward scorers' process pool: scores (index, data_source, solution_str, ground_truth,
extra_info) items in order, bounded by a deadline (docs/algorithms.md, "Rewards").

Batches with at least `parallel_threshold` items, and every batch when `score_timeout` is set (the
default), are scored by a persistent `ProcessPoolExecutor` (`num_workers` processes, at least one;
spawn start method by default: no fork of a process that holds torch / Ray threads), in contiguous
chunks whose results are concatenated in order, so the output is identical to serial scoring.
Under a timeout this is what bounds a scorer: a process stuck anywhere, even in C code holding the
GIL (catastrophic regex backtracking), or one that swallows every exception, is killed; a thread
could not be. Workers import no torch (they run `reward_score.custom.score_items`). A scorer that
cannot be pickled (a lambda) is scored serially in this process, with one warning, bounded by a
signal watchdog that works only while the scorer runs Python code. A pool that breaks while its
workers start (an OOM kill, a scorer module that crashes on import) scores that batch serially
(`serial_fallback`). The reward manager (reward_manager.py) decides what is scored; this module
only how.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FuturesTimeout
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from verl_arpo.utils.reward_score.custom import score_items

__all__ = ["ScoringPool", "RewardTimeoutError", "leave_process_group"]

logger = logging.getLogger(__name__)


class RewardTimeoutError(TimeoutError):
    """Scoring a batch took longer than `reward_model.score_timeout`."""


class _ScoreDeadline(BaseException):
    """Raised inside the main thread by the watchdog's signal (a BaseException: a scorer's own
    `except Exception` cannot swallow it)."""


def leave_process_group() -> None:
    """A scoring worker's first act: a process group of its own. `timeout`, job control and Slurm
    signal the driver's whole group on preemption; the driver finishes its step (scoring included)
    before it stops, so its workers must not die with the signal (the driver ends them itself,
    `close`/`_kill_pool`, and a worker whose driver died exits on its closed pipe)."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()


class ScoringPool:
    """Score items with `compute_score`, in worker processes when that is possible and worth it.

    Args:
        compute_score: `f(data_source, solution_str, ground_truth, extra_info)`.
        num_workers: scoring processes for large batches (<= 1: serial unless a timeout is set).
        parallel_threshold: minimum batch size for parallel scoring without a timeout.
        mp_start_method: multiprocessing start method ("spawn", "forkserver", "fork").
        score_timeout: seconds one batch's scoring may take (None: no limit).
    """

    def __init__(self, compute_score: Callable, num_workers: int, parallel_threshold: int,
                 mp_start_method: str = "spawn", score_timeout: float | None = None):
        self.compute_score = compute_score
        self.num_workers = int(num_workers)
        self.parallel_threshold = int(parallel_threshold)
        self.mp_start_method = mp_start_method
        self.score_timeout = score_timeout
        self.serial_fallback = False   # the last batch was scored serially because the pool broke
        self._pool: ProcessPoolExecutor | None = None
        self._warm_pool: ProcessPoolExecutor | None = None   # the pool whose workers are started
        self._picklable: bool | None = None

    @property
    def started(self) -> bool:
        """Whether worker processes exist now (a killed or closed pool starts again when needed)."""
        return self._pool is not None

    def _can_parallelize(self, n: int) -> bool:
        """Score in the worker processes: a large batch, or any batch under a timeout (a process can be
        killed; a thread stuck in C code, such as a backtracking regex, holds the GIL and cannot even
        be signalled)."""
        if self.score_timeout is None and (self.num_workers <= 1 or n < self.parallel_threshold):
            return False
        if self._picklable is None:
            try:
                pickle.dumps(self.compute_score)
                self._picklable = True
            except Exception as exc:
                logger.warning("compute_score %r cannot be pickled (%s); scoring serially in this process, where "
                           "reward_model.score_timeout cannot stop a scorer stuck in C code", self.compute_score, exc)
                self._picklable = False
        return self._picklable

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            ctx = multiprocessing.get_context(self.mp_start_method)
            self._pool = ProcessPoolExecutor(max_workers=max(1, self.num_workers), mp_context=ctx,
                                             initializer=leave_process_group)
        return self._pool

    def close(self) -> None:
        """Shut the worker pool down (it is re-created on the next large batch)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:  # best effort; call close() explicitly when you can
        try:
            self._kill_pool()
        except Exception:
            pass

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pool"] = state["_warm_pool"] = None
        return state

    def score_all(self, items: list[tuple[int, Any, str, Any, Any]]) -> list[Any]:
        """Score (index, data_source, solution_str, ground_truth, extra_info) tuples, in order."""
        self.serial_fallback = False
        if not items:
            return []
        if not self._can_parallelize(len(items)):
            deadline = time.monotonic() + self.score_timeout if self.score_timeout else None
            return self._score_serially(items, deadline)
        # a small batch (here because of the timeout) goes one sample per task, so that a timeout
        # names the sample; a large one in contiguous chunks
        small = len(items) < self.parallel_threshold
        n_chunks = len(items) if small else min(len(items), max(1, self.num_workers) * 4)
        bounds = np.linspace(0, len(items), n_chunks + 1).astype(int)
        chunks = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        try:
            pool = self._get_pool()
            self._warm(pool)   # workers spawned and the scorer imported before the clock starts
            deadline = time.monotonic() + self.score_timeout if self.score_timeout else None
            futures = [pool.submit(score_items, self.compute_score, chunk, True) for chunk in chunks]
            results = []
            for chunk, future in zip(chunks, futures):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    results += future.result(timeout=left)
                except FuturesTimeout:
                    self._kill_pool()
                    which = (f"sample {chunk[0][0]} (data_source={chunk[0][1]!r}) was" if len(chunk) == 1 else
                             f"samples {chunk[0][0]}..{chunk[-1][0]} (data sources "
                             f"{sorted({str(c[1]) for c in chunk})}) were")
                    raise RewardTimeoutError(
                        f"reward scoring did not finish within reward_model.score_timeout={self.score_timeout:g}s: "
                        f"{which} still being scored; the scoring processes were killed") from None
            return results
        except BrokenProcessPool as exc:
            # [reliability: issue 51] the pool can break while its workers start (an OOM kill, a scorer module
            # that crashes on import): the serial fallback gets the whole timeout, as start-up is not scoring
            logger.warning("reward worker pool broke (%s); scoring this batch serially", exc)
            self._pool, self._warm_pool, self.serial_fallback = None, None, True
            deadline = time.monotonic() + self.score_timeout if self.score_timeout else None
            return self._score_serially(items, deadline)

    def _warm(self, pool: ProcessPoolExecutor) -> None:
        """Start every worker and unpickle the scorer in it once per pool (no timeout: start-up is
        not scoring)."""
        if self._warm_pool is pool:
            return
        workers = max(1, self.num_workers)
        for future in [pool.submit(score_items, self.compute_score, []) for _ in range(workers)]:
            future.result()
        self._warm_pool = pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for proc in list(getattr(pool, "_processes", {}).values()):  # a hung scorer ignores shutdown
            proc.kill()
        # wait=True: the workers are dead, so this only joins the pool's manager thread. One left
        # running races CPython 3.11's exit hook for the pool (`_python_exit` writes to the wake-up
        # pipe that thread is closing: an "OSError: [Errno 9] Bad file descriptor" traceback printed
        # after a run's last line; fixed upstream in 3.12, gh-125451)
        pool.shutdown(wait=True, cancel_futures=True)

    def _score_serially(self, items: list[tuple], deadline: float | None) -> list[Any]:
        """Score in this thread; past `deadline` a watchdog stops the scorer (the main thread: a
        signal interrupts even a blocking call, and math-verify keeps its own alarm-based timeouts)
        or the wait for it (any other thread)."""
        if deadline is None:
            return score_items(self.compute_score, items, tolerate=True)
        current = [None]  # the sample being scored, for the error message

        def scored() -> list[Any]:
            out = []
            for item in items:
                current[0] = item
                out += score_items(self.compute_score, [item], tolerate=True)
            return out

        def timeout_error() -> RewardTimeoutError:
            index, source = (current[0][0], current[0][1]) if current[0] else ("?", "?")
            return RewardTimeoutError(
                f"reward scoring did not finish within reward_model.score_timeout={self.score_timeout:g}s: "
                f"sample {index} (data_source={source!r}) was still being scored")

        if threading.current_thread() is not threading.main_thread():
            box: dict[str, Any] = {}
            runner = threading.Thread(target=lambda: box.update(out=_capture(scored)), daemon=True,
                                      name="reward-scoring")
            runner.start()
            runner.join(max(0.0, deadline - time.monotonic()))
            if runner.is_alive():
                raise timeout_error()  # the thread cannot be stopped; the run ends with this error
            kind, value = box["out"]
            if kind == "error":
                raise value
            return value
        fired = threading.Event()
        done = threading.Event()
        main_id = threading.main_thread().ident

        def watchdog() -> None:
            if not done.wait(max(0.0, deadline - time.monotonic())):
                fired.set()
                signal.pthread_kill(main_id, signal.SIGUSR2)

        def on_signal(signum, frame):
            if fired.is_set() and not done.is_set():
                raise _ScoreDeadline()

        previous = signal.signal(signal.SIGUSR2, on_signal)
        guard = threading.Thread(target=watchdog, daemon=True, name="reward-watchdog")
        guard.start()
        try:
            return scored()
        except _ScoreDeadline:
            raise timeout_error() from None
        finally:
            done.set()
            guard.join()
            signal.signal(signal.SIGUSR2, previous if previous is not None else signal.SIG_DFL)


def _capture(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except BaseException as exc:  # handed to the waiting thread
        return "error", exc
