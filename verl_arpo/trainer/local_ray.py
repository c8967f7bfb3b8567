"""The local Ray cluster of a command-line run, in a session of its own (docs/checkpoints.md,
"Preemption").

`timeout -s TERM`, a shell's job control and Slurm signal every process of the job's process group,
not the driver alone. A cluster that `ray.init()` starts is made of the driver's children, in the
driver's group: the group's SIGTERM killed the GCS, the raylet and the workers in the middle of the
step the driver was finishing for its checkpoint. So `main_ppo` starts the head as `ray start --head
--block` in a new session, where a signal to the driver's group does not reach it, and joins it with
`ray.init(address=...)`:

- the driver alone decides when the cluster ends: `stop()` after the run, whatever its outcome;
- if the driver dies without that (SIGKILL, or the preemption watchdog's `os._exit`), the kernel
  sends the head SIGTERM (PR_SET_PDEATHSIG), and `ray start --block` stops what it started;
- the head gets its own free GCS and client ports and its own temp dir, so runs on one machine never
  share a cluster, and a plain `ray.init()` elsewhere on the machine never finds this one (`ray
  start` records its address in `<temp dir>/ray_current_cluster`, where `ray.init()` looks under
  /tmp/ray by default).

Library users who call `ray.init()` themselves keep Ray's usual behaviour (`init_ray(job)`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
READY_LINE = "Ray runtime started"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def existing_auth_token(env: dict) -> str | None:
    """Where Ray will find its authentication token under `env`, or None when it may have none: the
    RAY_AUTH_TOKEN variable, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token when that
    variable is unset (Ray's own order). Only a non-empty value or file counts."""
    if env.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    named = env.get("RAY_AUTH_TOKEN_PATH")
    home = env.get("HOME") or os.path.expanduser("~")
    path = Path(named).expanduser() if named else Path(home) / ".ray" / "auth_token"
    try:
        return str(path) if path.read_text().strip() else None
    except OSError:
        return None


class LocalRayHead:
    """`ray start --head --block` in its own session; `start()` returns the address to join."""

    def __init__(self, num_cpus: int | None = None, include_dashboard: bool = False, env: dict | None = None):
        self.num_cpus, self.include_dashboard = num_cpus, include_dashboard
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self.address: str | None = None
        self.kept_log = False   # stop(keep_log=True) ran: a later stop() leaves the log alone
        fd, name = tempfile.mkstemp(prefix="verl_arpo_ray_head_", suffix=".log")
        os.close(fd)
        self.log = Path(name)
        # short: Ray's unix sockets live below it and must stay under 107 characters
        self.temp_dir = Path(tempfile.mkdtemp(prefix="va_ray_", dir="/tmp" if os.path.isdir("/tmp") else None))

    def command(self, port: int) -> list[str]:
        # Ray's CLI as a module of this interpreter: no `ray` executable needs to be on the PATH
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
               f"--ray-client-server-port={_free_port()}", f"--include-dashboard={str(self.include_dashboard).lower()}",
               "--disable-usage-stats", f"--temp-dir={self.temp_dir}"]
        return cmd + ([f"--num-cpus={int(self.num_cpus)}"] if self.num_cpus else [])

    def ensure_auth_token(self) -> None:
        """In token mode, make sure a token exists before `ray start`: the head refuses to start
        without one and, unlike `ray.init()`, does not create it, so a machine where Ray never ran
        (a fresh GPU node, a new user's HOME) failed the first run. `ray get-auth-token --generate`
        writes ~/.ray/auth_token only when none is found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH and the
        file are looked at first); it prints the token, which is a secret, so its stdout is dropped."""
        if self.env.get("RAY_AUTH_MODE", "").lower() != "token" or existing_auth_token(self.env):
            return   # (a token found here saves a `ray` subprocess: 2-4 s of every run's start-up)
        r = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"],
                           env=self.env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError("the local Ray head needs an authentication token (RAY_AUTH_MODE=token) and "
                               f"`ray get-auth-token --generate` failed (exit {r.returncode}):\n{r.stderr[-2000:]}\n"
                               "Create one with `ray get-auth-token --generate`, or set RAY_AUTH_MODE=disabled "
                               "on a machine no one else can reach.")

    def start(self, timeout_s: float = 300.0) -> str:
        self.ensure_auth_token()
        port = _free_port()
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(self.command(port), stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop(keep_log=True)
                raise RuntimeError(f"the local Ray head did not start (`{' '.join(self.command(port))}`; "
                                   f"log {self.log}):\n{tail}")
            time.sleep(0.2)
        self.address = f"127.0.0.1:{port}"
        return self.address

    def stop(self, grace_s: float = 30.0, keep_log: bool = False) -> None:
        """SIGTERM to `ray start --block` (it stops the processes it started), then SIGKILL to whatever
        of its session is left; its log and temp dir go too (also for a head never started)."""
        if self.process is None:
            if not keep_log and not self.kept_log:   # a failed start keeps the log its error names
                self.log.unlink(missing_ok=True)
                shutil.rmtree(self.temp_dir, ignore_errors=True)
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("the local Ray head did not stop within %.0f s: killing its session", grace_s)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)   # the session leader's group: the head's processes
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.process = None
        self.kept_log = keep_log
        if not keep_log:
            self.log.unlink(missing_ok=True)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
