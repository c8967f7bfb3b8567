"""The Python tool's sandbox: one short-lived process tree per call, bounded in time, output,
memory and processes (docs/tools.md, "The Python sandbox"). `PythonTool` (python_tool.py) decides
what to run; this module runs it.

Threat model (bubblewrap mode, the default when ``bwrap`` runs here)

What is covered:
- Network: ``--unshare-all`` gives an empty network namespace (no loopback peers, no DNS).
- Filesystem: only /usr (+ the interpreter's own prefix) is visible, read-only; the work dir /tmp
  and /dev/shm are private size-limited tmpfs that disappear with the call. /root, /home, /work, /etc are absent.
- Secrets: the child gets a fixed minimal environment, never the host's; other processes are
  invisible (own PID namespace, own /proc).
- Privileges: when the host runs as root, the sandbox runs as uid/gid 65534 with no capabilities
  and no supplementary groups (dropped by util-linux's ``setpriv`` right after the launch, or by
  ``Popen`` itself where setpriv is missing: `as_user`).
- Resources: rlimits on address space (memory_mb), CPU seconds, processes (counted inside the
  sandbox's own user namespace, so one fork bomb does not starve other sandboxes), file size and
  open files; wall-clock timeout kills the whole sandbox (PID namespace + --die-with-parent); output
  is capped while it is read, so a flood cannot exhaust host memory.

What is not covered:
- Kernel exploits and side channels: there is no seccomp filter and no VM boundary.
- CPU share: two busy sandboxes compete with training for the cores until their timeouts.
- Memory is bounded per process (memory_mb), not per sandbox: a process tree can hold
  memory_mb x max_processes, plus the two tmpfs (/tmp, /dev/shm: tmpfs_mb each), until the timeout.
  There is no cgroup limit (none is available to an unprivileged launcher here).
- Determinism: time, randomness and /proc/cpuinfo are the host's.

The sandbox fails closed: ``auto`` uses bubblewrap, and where bubblewrap cannot start (it is
missing, or user namespaces are disabled) building the tool raises ``SandboxUnavailableError``,
which stops the run (docs/tools.md, "The Python sandbox").

``sandbox: none`` is the explicit opt-out: the code runs as a plain subprocess with the same
rlimits, minimal environment, a fresh temp work dir, and uid 65534 when root. Every tool built
this way logs a warning, and ``tools/python/unsandboxed`` is 1 in the metrics. What it still
covers: the child's own environment holds no host variable; the process running the tool is
made non-dumpable, so same-user code cannot read its ``/proc/<pid>/environ`` or attach to it;
descendants are killed when the call ends, also those that called setsid() to leave the process
group (the launcher is their subreaper, and orphans that outlive it are found by the call's
marker variable). NOT covered: network access (Ray's local ports included), reading world-readable
files (/etc, /usr, /tmp) and, when not root, everything the user can read (other processes'
command lines and environments, ``~/.netrc``) and write (the checkpoint directory: checkpoint
files load with ``weights_only=True``, so a planted file is data, never code).
"""
from __future__ import annotations

import ctypes
import logging
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from collections.abc import Sequence

logger = logging.getLogger(__name__)

DEFAULT_PYTHON = "/usr/bin/python3"
SANDBOX_UID = 65534  # "nobody"; only used when the host runs as root
# Variables the child sees: nothing from the host. Thread caps keep numpy from spawning a BLAS
# thread per core in every concurrent sandbox.
CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}
MARKER = "VERL_ARPO_SANDBOX_CALL"  # per-call token in the child's environment (finds its orphans)
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36
MAX_CODE_CHARS = 1_000_000
STDERR_CAP = 64 * 1024
TRACEBACK_LINES = 25

# Runs inside the sandbox before the user's code: it lowers its own rlimits (hard = soft, so the
# code cannot raise them back), reads the code from stdin (no argv/quoting limits), and on error
# prints a traceback without its own frame, with the model's source lines (via linecache).
# REPL echo (the reference's "expressions become prints"): the last top-level statement, if it is a
# bare expression other than print(...), is passed to sys.displayhook -- the hook the interactive
# interpreter uses (repr, nothing for None). It is done on the AST, so the source and line numbers
# in tracebacks stay the model's, and hostile code is only ever parsed inside the sandbox.
# Start-up cost matters (one interpreter per call): the AST comes from compile(PyCF_ONLY_AST) and the
# C module _ast instead of `import ast` (~15 ms), and traceback/linecache load only on error.
LAUNCHER = r"""
import _ast, resource, sys
_a = [int(x) for x in sys.argv[1:8]]
if _a[6]:  # no PID namespace (sandbox: none): become the subreaper of whatever the code starts
    import ctypes
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)


def _reap():
    # kill every descendant (setsid() ones included: as orphans they became our children), then
    # collect them; repeat while a fork raced the scan
    import os, signal
    me = os.getpid()
    for _ in range(10):
        kids = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open("/proc/" + d + "/stat", "rb") as f:
                        st = f.read()
                    kids.setdefault(int(st[st.rfind(b")") + 2:].split()[1]), []).append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
        todo, found = list(kids.get(me, [])), []
        while todo:
            p = todo.pop()
            found.append(p)
            todo += kids.get(p, [])
        if not found:
            return
        for p in found:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        for p in kids.get(me, []):
            try:
                os.waitpid(p, 0)
            except OSError:
                pass


for _r, _v in ((resource.RLIMIT_AS, _a[0]), (resource.RLIMIT_NPROC, _a[2]),
               (resource.RLIMIT_FSIZE, _a[3]), (resource.RLIMIT_NOFILE, _a[4])):
    if _v > 0:
        resource.setrlimit(_r, (_v, _v))
if _a[1] > 0:
    resource.setrlimit(resource.RLIMIT_CPU, (_a[1], _a[1] + 1))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_src = sys.stdin.buffer.read().decode("utf-8", "replace")
sys.stdin.close()
sys.stdin = open("/dev/null")
sys.argv = ["<code>"]


def _show(e, tb):
    import linecache, traceback
    linecache.cache["<code>"] = (len(_src), None, _src.splitlines(True), "<code>")
    sys.stderr.write("".join(traceback.format_exception(type(e), e, tb) if tb is not None
                             else traceback.format_exception_only(type(e), e)))
    sys.stderr.flush()
    sys.exit(1)


try:
    _tree = compile(_src, "<code>", "exec", _ast.PyCF_ONLY_AST)
    _last = _tree.body[-1] if _tree.body else None
    if _a[5] and isinstance(_last, _ast.Expr) and not (
            isinstance(_last.value, _ast.Call) and isinstance(_last.value.func, _ast.Name)
            and _last.value.func.id == "print"):
        _pos = {k: getattr(_last.value, k) for k in ("lineno", "col_offset", "end_lineno", "end_col_offset")}
        _call = _ast.Call(_ast.Name("__repl_echo__", _ast.Load(), **_pos), [_last.value], [], **_pos)
        _tree.body[-1] = _ast.Expr(_call, **_pos)
    _code = compile(_tree, "<code>", "exec")
except (SyntaxError, ValueError, RecursionError, MemoryError) as _e:
    _show(_e, None)
_g = {"__name__": "__main__", "__builtins__": __builtins__, "__repl_echo__": sys.displayhook}
try:
    exec(_code, _g)
except SystemExit:
    raise
except BaseException as _e:
    _g.clear()  # free what the code held (e.g. after a MemoryError) before importing traceback
    _show(_e, _e.__traceback__.tb_next)
finally:
    if _a[6]:
        sys.stdout.flush()
        _reap()
"""


def trim_traceback(text: str, max_lines: int = TRACEBACK_LINES) -> str:
    """Keep the header and the last lines of a long traceback (deep recursion repeats itself)."""
    lines = text.rstrip("\n").splitlines()
    if len(lines) <= max_lines:
        return "\n".join(lines)
    keep = lines[-(max_lines - 2):]
    return "\n".join([lines[0], f"  ... ({len(lines) - len(keep) - 1} lines omitted)"] + keep)


def readable_by_others(path: str) -> bool:
    """Can uid 65534 reach and run ``path``? (o+x on every directory on the way, o+rx on the file;
    checked for the path as written and for its symlink target.)"""
    for p in {Path(os.path.abspath(path)), Path(os.path.realpath(path))}:
        try:
            if any(not os.stat(d).st_mode & stat.S_IXOTH for d in p.parents):
                return False
            mode = os.stat(p).st_mode
        except OSError:
            return False
        if not (mode & stat.S_IXOTH and mode & stat.S_IROTH):
            return False
    return True


_probe_lock = threading.Lock()
_probe_result: bool | None = None
_probe_reason = ""
_host_protected = False


class SandboxUnavailableError(RuntimeError):
    """The sandbox the config asks for cannot run here (bubblewrap missing or unable to start)."""


def protect_host() -> None:
    """For sandbox=none: make this process non-dumpable (same-user code can then neither read its
    /proc/<pid>/environ, cmdline-adjacent files and memory, nor ptrace it) and the subreaper of its
    descendants (an orphaned sandbox process becomes our child, so a call can find and kill it)."""
    global _host_protected
    if _host_protected:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        logger.warning("PythonTool: prctl failed (errno %d): the host process stays readable by the code",
                       ctypes.get_errno())
    _host_protected = True


def drop_to() -> int | None:
    """uid to run the child as: 65534 when we are root (RLIMIT_NPROC ignores root), else ours."""
    return SANDBOX_UID if os.geteuid() == 0 else None


# Only system directories: the host's PATH does not choose the binary that drops root.
_SETPRIV_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def setpriv_path() -> str | None:
    """util-linux's setpriv (in every Debian/Ubuntu/Fedora base system), or None."""
    return shutil.which("setpriv", path=_SETPRIV_PATH)


def as_user(argv: list[str], uid: int | None) -> tuple[list[str], dict]:
    """The argv and `subprocess.Popen` keywords that start `argv` as `uid` and its group, with no
    supplementary groups (`uid` None: as ourselves, unchanged).

    Why setpriv: `Popen(user=...)` changes the ids between fork and exec, so CPython must fork
    instead of vfork. Forking the evaluator or a rollout worker (GBs of memory) copies its page
    tables and makes every page the host writes afterwards fault once: at 4 GB, 0.11 s for the
    launch and another ~0.3 s of faults, at every tool call (docs/performance.md, "Launching a tool
    without forking the host"). `setpriv --reuid --regid --clear-groups` makes the same drop
    (setgroups([]), setresgid, setresuid: real, effective and saved ids; the kernel then clears
    root's capabilities) in the launched process before it execs `argv`, so the host's Popen changes
    nothing in the child and vforks. Where setpriv is missing, Popen's own drop (a fork) is used."""
    if uid is None:
        return list(argv), {}
    setpriv = setpriv_path()
    if setpriv is None:
        return list(argv), {"user": uid, "group": uid, "extra_groups": []}
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv], {}


def bwrap_available() -> bool:
    """Probe once per process whether bubblewrap actually works here (not just installed)."""
    global _probe_result, _probe_reason
    with _probe_lock:
        if _probe_result is None:
            exe = shutil.which("bwrap")
            ok = False
            if exe:
                argv, as_kw = as_user([exe] + bwrap_system_args(64 << 20, []) + [DEFAULT_PYTHON, "-c", "pass"],
                                      drop_to())
                try:
                    r = subprocess.run(argv, env=dict(CHILD_ENV), capture_output=True, timeout=20, **as_kw)
                    ok = r.returncode == 0
                    if not ok:
                        _probe_reason = r.stderr.decode(errors="replace").strip()[:300] or f"exit {r.returncode}"
                        logger.warning("bubblewrap probe failed: %s", _probe_reason)
                except (OSError, subprocess.SubprocessError) as exc:
                    _probe_reason = str(exc)
                    logger.warning("bubblewrap probe failed: %s", exc)
            _probe_result = ok
        return _probe_result


def bwrap_unavailable_reason() -> str:
    """Why the last `bwrap_available()` probe failed ("" when it passed or never ran)."""
    return _probe_reason


def bwrap_system_args(tmpfs_bytes: int, ro_paths: Sequence[str]) -> list[str]:
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr"]
    # merged-/usr systems have /lib -> usr/lib symlinks; older ones have real directories
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # /dev/shm is part of --dev's unbounded tmpfs: give it its own size-limited one, like /tmp
    args += ["--dev", "/dev", "--size", str(tmpfs_bytes), "--tmpfs", "/dev/shm", "--proc", "/proc",
             "--size", str(tmpfs_bytes), "--tmpfs", "/tmp"]
    for path in ro_paths:  # after the /tmp tmpfs, which would otherwise hide an env under /tmp
        args += ["--ro-bind", path, path]
    return args + ["--chdir", "/tmp"]


def kill_marked(token: str) -> int:
    """SIGKILL (and collect, when they are our children) every process whose environment carries
    this call's marker: descendants that left the process group and outlived the launcher. Returns
    how many were found."""
    needle = f"{MARKER}={token}".encode() + b"\0"
    me, found = os.getpid(), 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read() + b"\0":
                    continue
            with open(f"/proc/{d}/stat", "rb") as f:
                st = f.read()
            ppid = int(st[st.rfind(b")") + 2:].split()[1])
            os.kill(int(d), signal.SIGKILL)
        except (OSError, ValueError, IndexError):  # gone, or not ours to read
            continue
        found += 1
        if ppid == me:  # we are its subreaper: collect it
            try:
                os.waitpid(int(d), 0)
            except ChildProcessError:
                pass
    return found


def run_bounded(argv: list[str], stdin: bytes, cwd: str, timeout: float,
                 out_cap: int, track_orphans: bool = False) -> tuple[int, bytes, bytes, bool, bool]:
    """Run ``argv`` with a wall timeout, reading at most ``out_cap`` bytes of stdout.

    Returns (returncode, stdout, stderr, timed_out, stdout_overflowed). On timeout or overflow the
    whole process group is SIGKILLed; for bwrap that takes the PID namespace down with it. With
    ``track_orphans`` (no PID namespace) the child's environment carries a per-call marker, and
    processes holding it are killed once the launcher is gone: a setsid() daemon can neither outlive
    the call nor hold its pipes open until the timeout.
    """
    token = secrets.token_hex(8) if track_orphans else ""
    env = dict(CHILD_ENV, **({MARKER: token} if token else {}))
    launch, as_kw = as_user(argv, drop_to())
    proc = subprocess.Popen(
        launch, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
        env=env, start_new_session=True, close_fds=True, **as_kw,
    )
    out, err = bytearray(), bytearray()
    timed_out = overflow = False
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    for f in (proc.stdin, proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
    pending = memoryview(stdin)
    if pending:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    try:
        while len(sel.get_map()) > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            if token and proc.poll() is not None:
                kill_marked(token)  # the launcher is gone: whoever still holds the pipes is an orphan
            for key, _ in sel.select(timeout=min(left, 0.5)):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        n = os.write(f.fileno(), pending[:65536])
                    except (BrokenPipeError, BlockingIOError):
                        n = len(pending)  # child gone or closed stdin: stop feeding
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    sel.unregister(f)
                    continue
                if f is proc.stdout:
                    out += chunk
                    if len(out) > out_cap:
                        overflow = True
                        break
                elif len(err) < STDERR_CAP:
                    err += chunk[: STDERR_CAP - len(err)]
            if overflow:
                break
    finally:
        sel.close()
        if timed_out or overflow or proc.poll() is None:
            # pipes are closed/EOF: give the child a moment to exit on its own before the kill
            try:
                if timed_out or overflow:
                    raise subprocess.TimeoutExpired(argv, 0)
                proc.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = timed_out or not overflow
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f and not f.closed:
                f.close()
        if token:
            for _ in range(10):  # a fork racing the scan is caught by the next round
                if not kill_marked(token):
                    break
    return proc.returncode, bytes(out), bytes(err), timed_out, overflow
