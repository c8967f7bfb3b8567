"""``LocalWorkerGroup``: a worker group of one rank that lives in the driver's own process (no Ray).

``trainer.single_process=true`` (docs/performance.md, "One process on a laptop") builds the worker
groups with this class instead of :class:`~verl_arpo.single_controller.ray.RayWorkerGroup`. It has
the same face: every ``@register``-ed method of the worker class becomes a method of the group,
dispatched and collected by the same :func:`~verl_arpo.single_controller.decorator.plan_call` at
world size 1, plus ``execute_all``, ``execute_rank_zero``, ``node_infos`` and ``shutdown``. What it
saves on a CPU: Ray's daemons (~1.5 GB of memory), a second copy of the driver's libraries, the
transfer of every batch between processes, and the cluster's start-up.

What stays as under Ray:

- the worker's environment: ``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1``
  and a free ``MASTER_ADDR``/``MASTER_PORT`` for its 1-rank process group (restored on shutdown);
- the data: Ray pickles every argument and result, so a worker never shares an object with the
  driver. Here each call deep-copies its arguments and its result, so a worker that edits a batch it
  was given, or keeps a tensor it returned and changes it later, behaves as it would under Ray;
- ``call_timeout``: a call that runs past it stops the process (exit code 5, as the command line's
  ``WorkerGroupTimeoutError``), after printing which method and the main thread's stack. A call in
  the driver's own thread cannot be interrupted and resumed cleanly, so the run ends, as it does when
  a Ray call times out (``trainer.resume_mode=auto`` continues from the last checkpoint).

What differs: calls registered with ``blocking=False`` run at once (there is nothing to overlap
with in one process), and their ``.get()`` returns the stored result.
"""

from __future__ import annotations

import copy
import faulthandler
import os
import sys
import threading
from typing import Any

from verl_arpo.single_controller.base import Worker, find_free_port
from verl_arpo.single_controller.decorator import CallPlan, MethodSpec, bind_group_methods, plan_call

__all__ = ["LocalWorkerGroup", "TIMEOUT_EXIT_CODE"]

TIMEOUT_EXIT_CODE = 5
"""The command line's exit code for a worker call past `trainer.worker_call_timeout` (main_ppo)."""

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class _DoneCall:
    """A ``blocking=False`` call that already ran: ``.get()`` returns its result."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def get(self, timeout: float | None = None) -> Any:
        return self._result


class _CallWatchdog:
    """Ends the process if the call it guards runs past ``seconds`` (see the module docstring)."""

    def __init__(self, what: str, seconds: float | None) -> None:
        self.what, self.seconds = what, seconds
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _CallWatchdog:
        if self.seconds is not None:
            self._thread = threading.Thread(target=self._watch, name="worker-call-timeout", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(float(self.seconds)):
            return
        print(f"[verl_arpo] {self.what} did not finish within {self.seconds}s (trainer.worker_call_timeout) in "
              f"this process (trainer.single_process=true); its stack follows. Raise trainer.worker_call_timeout "
              f"if the call is only slow; trainer.resume_mode=auto continues from the last checkpoint in "
              f"trainer.default_local_dir (exit {TIMEOUT_EXIT_CODE})", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT_CODE)


class LocalWorkerGroup:
    """One instance of a :class:`Worker` subclass in this process, driven like a worker group."""

    world_size = 1

    def __init__(self, worker_cls: type, *args: Any, name_prefix: str | None = None, env_vars: dict | None = None,
                 call_timeout: float | None = None, num_threads: int | None = None, **kwargs: Any) -> None:
        """
        Args:
            worker_cls: the worker class (a :class:`Worker` subclass); ``args``/``kwargs`` build it.
            name_prefix: names the group in messages.
            env_vars: variables set in this process's environment before the worker is built (what
                a Ray worker gets in its runtime_env); cannot set the rank variables.
            call_timeout: seconds a call may take before the process ends (``None``: no limit).
            num_threads: torch's intra-op threads for the worker (a Ray worker gets its CPU share
                through ``OMP_NUM_THREADS``); ``None`` leaves torch's setting.
        """
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"LocalWorkerGroup needs a subclass of verl_arpo.single_controller.base.Worker, "
                            f"got {worker_cls!r}")
        bad = sorted(set(env_vars or {}) & set(_RANK_ENV))
        if bad:
            raise ValueError(f"env_vars cannot set {bad}: the worker group assigns them")
        self.worker_cls = worker_cls
        self.name_prefix = name_prefix or worker_cls.__name__
        self.call_timeout = call_timeout
        bind_group_methods(self, worker_cls, self._run_call)   # before the environment changes: a clash leaves nothing
        self._saved_env = {k: os.environ.get(k) for k in (*_RANK_ENV, *(env_vars or {}))}
        master_port = os.environ.get("MASTER_PORT") if os.environ.get("WORLD_SIZE") == "1" else None
        os.environ.update({str(k): str(v) for k, v in (env_vars or {}).items()})
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=master_port or str(find_free_port("127.0.0.1")))
        if num_threads is not None:
            import torch

            torch.set_num_threads(max(1, int(num_threads)))
        try:
            with _CallWatchdog(f"{worker_cls.__name__}.__init__", call_timeout):
                self._worker: Worker | None = worker_cls(*args, **kwargs)
        except BaseException:
            self._restore_env()
            raise
        self.node_infos = [self._worker.get_node_info()]

    @property
    def workers(self) -> list[Any]:
        """The worker instance (index = rank), for a debugger."""
        return [self._worker] if self._worker is not None else []

    def _run_call(self, name: str, spec: MethodSpec, plan: CallPlan) -> Any:
        result = plan.collect(self._call(name, plan))
        return result if spec.blocking else _DoneCall(result)

    def _call(self, method: str, plan: CallPlan) -> list:
        if self._worker is None:
            raise RuntimeError(f"group {self.name_prefix!r} is shut down; cannot call {method}")
        outputs = []
        for args, kwargs in zip(plan.args, plan.kwargs):
            args, kwargs = copy.deepcopy((tuple(args), dict(kwargs)))   # as Ray's pickling: no shared objects
            with _CallWatchdog(f"{self.worker_cls.__name__}.{method}", self.call_timeout):
                result = getattr(self._worker, method)(*args, **kwargs)
            outputs.append(copy.deepcopy(result))
        return outputs

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method_name`` on the worker; a list of its one result (as for a group of one)."""
        return self._call(method_name, plan_call("ONE_TO_ALL", 1, args, kwargs))

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on the worker and return its result."""
        return self.execute_all(method_name, *args, **kwargs)[0]

    def shutdown(self) -> None:
        """Drop the worker, leave its process group, and restore the environment it was built in."""
        if self._worker is None:
            return
        try:
            self._worker.destroy_process_group()
        finally:
            self._worker = None
            self._restore_env()

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def __repr__(self) -> str:
        return f"LocalWorkerGroup({self.worker_cls.__name__}, name_prefix={self.name_prefix!r})"
