"""PythonTool: run model-written Python in a fresh sandbox per call (fixed public API).

Behaviour kept from the reference: the code of ``<python>...</python>`` runs in a separate
interpreter (``<conda_path>/envs/<conda_env>/bin/python`` when the seeds' params are given) with a
wall-clock timeout, and a final bare expression is printed like in a REPL.

Differences from the reference, and why:
- The reference ran ``python -c '<code>'`` through a shell string with the host's environment and
  filesystem. Quotes in the code broke it, and the code could read API keys, delete files and use
  the network. Here the code goes through stdin, the environment is a fixed minimal one, and (when
  bubblewrap works) each call gets its own namespaces.
- The reference returned stdout only, so errors came back as ``""``. Here a failing program
  returns its stdout followed by a traceback trimmed to the user's frames.
- Output is bounded: reading stops (and the program is killed) past ``max_output_chars``.
- A program that succeeds silently returns a short note instead of ``""``: an empty result would
  make the executor retry (and re-run) correct code.

The sandbox, its threat model and what `sandbox: none` still covers: sandbox.py in this folder
(docs/tools.md, "The Python sandbox").
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence

from verl_arpo.workers.rollout.tools.base_tool import BaseTool, ToolError
from verl_arpo.workers.rollout.tools.sandbox import (  # noqa: F401 - DEFAULT_PYTHON, trim_traceback: re-exported
    DEFAULT_PYTHON, LAUNCHER, MAX_CODE_CHARS, SANDBOX_UID, SandboxUnavailableError, bwrap_available,
    bwrap_system_args, bwrap_unavailable_reason, drop_to, protect_host, readable_by_others, run_bounded,
    trim_traceback)

logger = logging.getLogger(__name__)


class PythonTool(BaseTool):
    """Python code interpreter; tag ``<python>``.

    Params (YAML ``tool_instances.python.params``): ``timeout`` (wall seconds per call),
    ``max_output_chars``, ``memory_mb`` (RLIMIT_AS), ``cpu_seconds`` (default: timeout + 1),
    ``max_processes``, ``max_file_mb``, ``tmpfs_mb``, ``sandbox`` (auto | bwrap | none),
    ``python_path`` or the seeds' ``conda_path`` + ``conda_env``, ``extra_ro_paths``, ``preprocess``
    (REPL echo of a final bare expression, default on).
    """

    name = "python"
    trigger_tag = "python"
    description = "Run Python code in a sandbox and return what it prints (stdout, or the error)."
    argument, argument_description = "code", "the Python program to run; print what you need to see"

    def __init__(
        self,
        timeout: float = 60,
        max_output_chars: int = 10_000,
        memory_mb: int = 2048,
        cpu_seconds: int | None = None,
        max_processes: int = 64,
        max_file_mb: int = 64,
        tmpfs_mb: int = 256,
        sandbox: str = "auto",
        python_path: str | None = None,
        conda_path: str | None = None,
        conda_env: str | None = None,
        extra_ro_paths: Sequence[str] = (),
        preprocess: bool = True,
    ):
        if sandbox not in ("auto", "bwrap", "none"):
            raise ValueError(f"sandbox must be auto, bwrap or none, got {sandbox!r}")
        self.timeout = float(timeout)
        self.max_output_chars = int(max_output_chars)
        self.memory_mb = int(memory_mb)
        # CPU limit one second past the wall timeout: the wall clock decides a plain timeout (one
        # message, no race); the CPU limit still stops work that escapes the wall-clock kill.
        self.cpu_seconds = int(cpu_seconds if cpu_seconds is not None else max(1, round(self.timeout)) + 1)
        self.max_processes = int(max_processes)
        self.max_file_mb = int(max_file_mb)
        self.tmpfs_mb = int(tmpfs_mb)
        self.preprocess = preprocess
        self.python_path = self._resolve_python(python_path, conda_path, conda_env)
        self.ro_paths = self._interpreter_prefixes(self.python_path) + [str(p) for p in extra_ro_paths]
        if sandbox in ("auto", "bwrap") and not bwrap_available():
            raise SandboxUnavailableError(
                f"PythonTool (sandbox={sandbox}): bubblewrap cannot start here ({bwrap_unavailable_reason() or 'not installed'}); "
                "model-written code runs only inside a sandbox. Install bubblewrap (apt-get install bubblewrap) and "
                "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
                "user.max_user_namespaces > 0), or set tool_instances.python.params.sandbox=none to run it as a "
                "plain subprocess without network or filesystem isolation (an explicit opt-out: logged, and "
                "tools/python/unsandboxed=1 in the metrics)")
        self.sandbox = sandbox
        if sandbox == "none":
            logger.warning("PythonTool: sandbox=none -- model-written code runs WITHOUT network or filesystem "
                           "isolation (rlimits, a minimal environment and descendant cleanup only); see the "
                           "threat model in docs/tools.md")
            protect_host()

    # ----------------------------------------------------------------- configuration helpers
    @staticmethod
    def _resolve_python(python_path, conda_path, conda_env) -> str:
        wanted = python_path
        if not wanted and conda_path and conda_env:
            wanted = os.path.join(str(conda_path), "envs", str(conda_env), "bin", "python")
        if not wanted:
            return DEFAULT_PYTHON
        if not os.path.isfile(wanted):
            # The seeds ship `conda_path: /path/to/conda`; keep their YAML usable as is.
            logger.warning("python interpreter %s not found; using %s", wanted, DEFAULT_PYTHON)
            return DEFAULT_PYTHON
        if drop_to() is not None and not readable_by_others(wanted):
            raise ValueError(f"interpreter {wanted} is not readable by uid {SANDBOX_UID} (the sandbox "
                             f"user); use a world-readable one such as {DEFAULT_PYTHON}")
        return wanted

    @staticmethod
    def _interpreter_prefixes(python: str) -> list[str]:
        """Directories to bind read-only so a non-/usr interpreter (conda env, venv) can start."""
        out: list[str] = []
        for p in (os.path.abspath(python), os.path.realpath(python)):
            prefix = os.path.dirname(os.path.dirname(p))
            if prefix not in ("/", "/usr") and not prefix.startswith("/usr/") and prefix not in out:
                out.append(prefix)
        return out

    def _use_bwrap(self) -> bool:
        return self.sandbox != "none"  # the constructor refused every other case without bubblewrap

    def metrics(self) -> dict[str, float]:
        """``unsandboxed``: 1 when this tool runs code without bubblewrap (sandbox=none)."""
        return {"unsandboxed": float(self.sandbox == "none")}

    # -------------------------------------------------------------------------------- running
    def run(self, content: str) -> str:
        if len(content) > MAX_CODE_CHARS:
            raise ToolError(f"code too long ({len(content)} characters, limit {MAX_CODE_CHARS})",
                            retryable=False)
        use_bwrap = self._use_bwrap()
        limits = [self.memory_mb << 20, self.cpu_seconds, self.max_processes, self.max_file_mb << 20, 256,
                  int(self.preprocess), int(not use_bwrap)]
        cmd = [self.python_path, "-I", "-c", LAUNCHER] + [str(v) for v in limits]
        workdir = None
        if use_bwrap:
            argv = [shutil.which("bwrap")] + bwrap_system_args(self.tmpfs_mb << 20, self.ro_paths) + cmd
            cwd = "/"
        else:
            workdir = tempfile.mkdtemp(prefix="pytool_")
            if drop_to() is not None:
                os.chown(workdir, SANDBOX_UID, SANDBOX_UID)
            argv, cwd = cmd, workdir
        try:
            rc, out, err, timed_out, overflow = run_bounded(
                argv, content.encode("utf-8", "replace"), cwd, self.timeout, 4 * self.max_output_chars + 4,
                track_orphans=not use_bwrap)
        finally:
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        # The sandbox itself failed to start, not the code: bubblewrap (e.g. EAGAIN under load), or the
        # uid drop or the exec after it (setpriv's exit 126/127: sandbox.as_user). Worth a retry.
        if (use_bwrap and rc == 1 and err.startswith(b"bwrap:")) or (rc in (126, 127) and err.startswith(b"setpriv:")):
            raise ToolError("sandbox failed to start: " + err.decode("utf-8", "replace").strip()[:300])
        return self._format(rc, out, err, timed_out, overflow, signal_base=128 if use_bwrap else None)

    def _format(self, rc, out: bytes, err: bytes, timed_out: bool, overflow: bool, signal_base) -> str:
        text = out.decode("utf-8", errors="replace")
        if overflow or len(text) > self.max_output_chars:
            text = text[: self.max_output_chars] + (
                f"\n... [output truncated: more than {self.max_output_chars} characters]")
        if timed_out:
            note = f"Error: Execution timed out after {self.timeout:g} seconds."
            return f"{text.rstrip()}\n{note}" if text.strip() else note
        if rc == 0 or overflow:
            return text if text.strip() else "Code executed successfully with no output."
        sig = -rc if rc < 0 else (rc - signal_base if signal_base and rc > signal_base else None)
        if sig:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            why = {"SIGXCPU": f"CPU time limit of {self.cpu_seconds} s exceeded",
                   "SIGKILL": "killed, likely over the CPU or memory limit"}.get(name, "terminated")
            msg = f"Error: process killed by {name} ({why})."
        else:
            tb = trim_traceback(err.decode("utf-8", errors="replace")) if err.strip() else ""
            msg = tb or f"Error: process exited with status {rc}."
        return f"{text.rstrip()}\n{msg}" if text.strip() else msg
