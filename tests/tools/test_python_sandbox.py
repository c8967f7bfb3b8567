"""Hostile code is contained and reported, and the host is unharmed.

Tests marked ``bwrap`` need a working bubblewrap; the rest also run against the plain-subprocess
fallback (``sandbox="none"``, an explicit opt-out), which keeps rlimits, the minimal environment,
uid 65534 under root, a non-dumpable host and descendant cleanup. The sandbox fails closed:
``auto`` without a working bubblewrap refuses to build the tool.
"""
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from verl_arpo.workers.rollout.tools import sandbox
from verl_arpo.workers.rollout.tools.python_tool import PythonTool, bwrap_available

BWRAP = bwrap_available()
needs_bwrap = pytest.mark.skipif(
    not BWRAP, reason="bubblewrap missing or not working here (apt-get install bubblewrap; it needs "
                      "unprivileged user namespaces) -- the fallback cannot isolate network/filesystem")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to uid 65534 needs root")
MODES = [pytest.param("bwrap", marks=needs_bwrap), "none"]


def tool(mode, **kw):
    params = dict(timeout=5, memory_mb=256, max_processes=32, max_output_chars=4000, sandbox=mode)
    params.update(kw)
    return PythonTool(**params)


def _processes_named(comm):
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                found.append(pid)
        except OSError:
            pass
    return found


@needs_bwrap
def test_secret_env_not_visible(monkeypatch):
    """bwrap: neither the code's environment nor any /proc entry it can see holds the host's secret
    (the fallback's version, which needs a secret present from process start, is
    test_fallback_as_non_root_with_a_secret_from_the_start)."""
    mode = "bwrap"
    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("VERL_TEST_SECRET_KEY", secret)
    out = tool(mode).execute(
        "import os\n"
        "print(dict(os.environ))\n"
        "for p in ('/proc/self/environ', f'/proc/{os.getppid()}/environ', '/proc/1/environ'):\n"
        "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print(p, e)\n")
    assert "PATH" in out  # the program did run and print its environment
    assert secret not in out and "VERL_TEST_SECRET_KEY" not in out


@pytest.mark.parametrize("mode", MODES)
def test_memory_bomb_contained(mode):
    t = tool(mode)
    assert t.execute("x = bytearray(8 * 1024 ** 3)").endswith("MemoryError")
    out = t.execute("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))")
    assert out.endswith("MemoryError")
    assert t.execute("print('still fine')") == "still fine\n"


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_killed_at_timeout(mode):
    t0 = time.monotonic()
    out = tool(mode, timeout=1).execute("while True:\n    pass")
    assert out == "Error: Execution timed out after 1 seconds."
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("mode", MODES)
def test_cpu_limit_kills_before_wall_timeout(mode):
    out = tool(mode, timeout=10, cpu_seconds=1).execute("while True:\n    pass")
    assert out.startswith("Error: process killed by SIGXCPU") or out.startswith("Error: process killed by SIGKILL")


@needs_root
@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_workdir_fail(mode, tmp_path):
    marker = f"pwned_{uuid.uuid4().hex}"
    targets = [f"/usr/{marker}", f"/root/{marker}", f"{tmp_path}/{marker}", f"/work/{marker}"]
    code = ("import os\n"
            f"for p in {targets!r}:\n"
            "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('denied', type(e).__name__)\n"
            "open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())")
    out = tool(mode).execute(code)
    assert "WROTE" not in out and out.count("denied") == len(targets)
    assert out.rstrip().endswith("ok")  # the work dir itself is writable
    for p in targets:
        assert not os.path.exists(p)


@needs_root
@pytest.mark.parametrize("mode", MODES)
def test_root_home_unreadable(mode):
    out = tool(mode).execute("import os\ntry:\n    print(os.listdir('/root'))\nexcept OSError as e:\n"
                             "    print('denied', type(e).__name__)")
    assert out.startswith("denied")


@needs_root
@pytest.mark.parametrize("mode", MODES)
def test_runs_as_unprivileged_user(mode):
    assert tool(mode).execute("import os; (os.getuid(), os.getgid(), os.getgroups())") == "(65534, 65534, [])\n"


LAUNCHERS = [pytest.param("setpriv", marks=pytest.mark.skipif(sandbox.setpriv_path() is None,
                                                                reason="util-linux's setpriv is not installed")),
             "popen"]


def _launch_with(launcher, monkeypatch):
    if launcher == "popen":  # what runs where setpriv is missing: Popen's own uid drop
        monkeypatch.setattr(sandbox, "setpriv_path", lambda: None)


@needs_root
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_uid_drop_leaves_no_id_group_or_capability_of_root(launcher, monkeypatch):
    """Both ways of starting the sandbox as 65534 give the same process: real, effective, saved and
    filesystem uid and gid 65534, no supplementary group, no capability (read from the kernel's
    /proc/self/status of the launched program)."""
    _launch_with(launcher, monkeypatch)
    rc, out, err, timed_out, _ = sandbox.run_bounded(["/bin/cat", "/proc/self/status"], b"", "/", 20, 1 << 20)
    assert rc == 0 and not timed_out, err
    status = {k: v.split() for k, v in (line.split(":", 1) for line in out.decode().splitlines())}
    assert status["Uid"] == ["65534"] * 4 and status["Gid"] == ["65534"] * 4
    assert status["Groups"] == []
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(status[caps][0], 16) == 0, (caps, status[caps])


@needs_root
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_tool_call_forks_the_host_only_without_setpriv(launcher, monkeypatch):
    """A fork marks every page of the host copy-on-write, so the host's next write to each page
    faults once; a vfork (what CPython does when Popen changes no ids: the setpriv launch) leaves
    the host's pages alone. Counted with the kernel's minor-fault counter of this process."""
    import mmap
    import resource

    _launch_with(launcher, monkeypatch)
    # private anonymous memory, like a model's tensors (a shared mapping is not copied on write)
    host = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # 4 KiB pages: a huge page could take one fault for 512
        host.madvise(mmap.MADV_NOHUGEPAGE)
    pages = len(range(0, len(host), 4096))
    host[::4096] = b"\1" * pages                   # every page written once before the call
    t = tool("bwrap" if BWRAP else "none")
    assert t.execute("print(6 * 7)") == "42\n"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    host[::4096] = b"\2" * pages
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    if launcher == "setpriv":
        assert faults < pages // 4, faults
    else:
        assert faults > pages // 2, faults


@needs_root
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("mode", MODES)
def test_the_code_runs_as_nobody_whichever_launcher(mode, launcher, monkeypatch):
    _launch_with(launcher, monkeypatch)
    assert tool(mode).execute("import os; (os.getresuid(), os.getresgid(), os.getgroups())") == \
        "((65534, 65534, 65534), (65534, 65534, 65534), [])\n"


@needs_root
@pytest.mark.parametrize("mode", MODES)
def test_a_uid_drop_that_fails_is_a_tool_error_not_the_codes_output(mode, monkeypatch, tmp_path):
    """Where setpriv cannot drop root (a container without CAP_SETUID), the call raises the
    executor's retryable ToolError naming it, instead of returning setpriv's complaint as if the
    model's code had printed it. A stand-in setpriv fails as util-linux's does (exit 127)."""
    from verl_arpo.workers.rollout.tools.base_tool import ToolError

    fake = tmp_path / "setpriv"
    fake.write_text("#!/bin/sh\necho 'setpriv: setresuid failed: Operation not permitted' >&2\nexit 127\n")
    fake.chmod(0o755)
    t = tool(mode)                     # built (and bwrap probed) with the real setpriv
    monkeypatch.setattr(sandbox, "setpriv_path", lambda: str(fake))
    with pytest.raises(ToolError, match="sandbox failed to start: setpriv: setresuid failed"):
        t.run("print(1)")


@needs_bwrap
def test_filesystem_view_is_minimal():
    top = eval(tool("bwrap").execute("import os; sorted(os.listdir('/'))"))
    assert {"usr", "tmp", "dev", "proc"} <= set(top)
    assert set(top) <= {"bin", "dev", "lib", "lib32", "lib64", "proc", "sbin", "tmp", "usr"}
    assert tool("bwrap").execute("import os; os.listdir('.')") == "[]\n"  # fresh work dir per call


@needs_bwrap
def test_network_connection_fails():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        out = tool("bwrap").execute(
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('CONNECTED')")
        assert "CONNECTED" not in out
        assert out.splitlines()[-1].split(":")[0] in ("ConnectionRefusedError", "OSError", "TimeoutError")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's listener
    finally:
        listener.close()


@needs_bwrap
def test_fork_bomb_contained_and_cleaned_up():
    name = f"fb{uuid.uuid4().hex[:10]}"
    # name the bomb's processes (inherited by every fork) so the host can look for survivors
    rename = f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
    t = tool("bwrap", timeout=2, max_processes=16)
    counted = t.execute(rename + "import os, sys\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                        "    except OSError:\n        break\n    if pid == 0:\n        import time; time.sleep(30)\n"
                        "    n += 1\nprint('forks', n)")
    forks = int(counted.split()[-1])
    assert 1 <= forks <= 16  # RLIMIT_NPROC, counted inside the sandbox's own user namespace
    result = {}
    bomb = threading.Thread(target=lambda: result.update(out=t.execute(
        rename + "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")))
    t0 = time.monotonic()
    bomb.start()
    time.sleep(0.5)
    # meanwhile another sandbox (same uid 65534, same limit) can still fork: the count is per sandbox
    neighbour = t.execute("import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.wait()\nprint('forked')")
    bomb.join()
    assert neighbour == "forked\n"
    assert "timed out" in result["out"] and time.monotonic() - t0 < 5
    deadline = time.monotonic() + 3
    while _processes_named(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_named(name) == []  # the whole PID namespace went down with the sandbox
    assert tool("bwrap").execute("print('host fine')") == "host fine\n"


@needs_bwrap
def test_disk_filling_limited():
    out = tool("bwrap", max_file_mb=8, tmpfs_mb=32).execute(
        "f = open('big', 'wb')\nf.write(b'x' * (64 << 20))")
    assert "File too large" in out
    many = tool("bwrap", max_file_mb=8, tmpfs_mb=32).execute(
        "for d in ('/tmp', '/dev/shm'):\n    for i in range(20):\n        try:\n"
        "            open(f'{d}/f{i}', 'wb').write(b'x' * (4 << 20))\n        except OSError as e:\n"
        "            print(d, i, e.strerror)\n            break")
    # many files below the file-size limit still stop at the tmpfs size: 8 x 4 MiB fill 32 MiB
    assert many.splitlines() == ["/tmp 8 No space left on device", "/dev/shm 8 No space left on device"]


@needs_bwrap
def test_concurrent_sandboxes_isolated():
    from concurrent.futures import ThreadPoolExecutor

    t = tool("bwrap")
    code = ("import os\nopen('mine', 'w').write('{i}')\nimport time; time.sleep(0.2)\n"
            "print(open('mine').read(), os.listdir('.'))")
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: t.execute(code.format(i=i)), range(4)))
    assert outs == [f"{i} ['mine']\n" for i in range(4)]


# ------------------------------------------------------------------------------ fail closed / opt-out
_SYSTEM_PYTHON = "/usr/bin/python3"
# Loads python_tool.py without the tools package's __init__ (which imports `requests`): the harness
# runs under the system Python as a non-root user, who cannot reach the project's virtualenv.
_HARNESS = r"""
import json, os, sys, types
root = sys.argv[1]
for name in ("verl_arpo", "verl_arpo.workers", "verl_arpo.workers.rollout", "verl_arpo.workers.rollout.tools"):
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = mod
from verl_arpo.workers.rollout.tools import python_tool as pt
mode = sys.argv[2]
try:
    tool = pt.PythonTool(sandbox=mode, timeout=20, max_output_chars=20000)
except pt.SandboxUnavailableError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
out = {"uid": os.getuid(), "metrics": tool.metrics()}
out["peek"] = tool.execute(
    "import os\n"
    "print('ENV', sorted(os.environ))\n"
    "for p in (f'/proc/{os.getppid()}/environ', f'/proc/{os.getppid()}/mem'):\n"
    "    try:\n        print(p, open(p, 'rb').read(4096))\n    except OSError as e:\n        print(p, type(e).__name__)\n")
for exit_how in ("return", "os._exit"):
    daemon = ("import subprocess, sys, os\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              "print('DAEMON', p.pid, flush=True)\n" + ("os._exit(0)\n" if exit_how == "os._exit" else ""))
    import time
    t0 = time.monotonic()
    text = tool.execute(daemon)
    seconds = time.monotonic() - t0
    pid = int(text.split("DAEMON")[1].split()[0])
    time.sleep(0.2)
    out[exit_how] = {"text": text, "seconds": seconds, "alive": os.path.exists(f"/proc/{pid}")}
print(json.dumps(out))
"""


def _harness(mode, env_extra=None, as_user=True, path=None):
    import json
    import subprocess

    if not os.path.exists(_SYSTEM_PYTHON):
        pytest.skip(f"{_SYSTEM_PYTHON} is needed to run the tool as another user")
    uid = 65533 if as_user and os.geteuid() == 0 else None  # an unprivileged user: not root, not "nobody"
    env = {"PATH": path or "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **(env_extra or {})}
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([_SYSTEM_PYTHON, "-c", _HARNESS, root, mode], env=env, cwd="/tmp", capture_output=True,
                       text=True, timeout=120, user=uid, group=uid, extra_groups=[] if uid else None)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_fallback_as_non_root_with_a_secret_from_the_start(tmp_path):
    """sandbox=none in a non-root process whose environment holds a secret since it started: the
    code's environment is clean, the host's /proc environ and memory are closed to it (non-dumpable),
    and a setsid() daemon neither outlives the call nor holds its pipes until the timeout -- whether
    the code returns or leaves through os._exit."""
    secret = f"sk-live-{uuid.uuid4().hex}"
    out, log = _harness("none", {"WANDB_API_KEY": secret})
    assert out["uid"] != 0
    assert "WITHOUT network or filesystem isolation" in log  # the opt-out is logged
    assert out["metrics"] == {"unsandboxed": 1.0}
    peek = out["peek"]
    assert "ENV" in peek and "WANDB_API_KEY" not in peek and secret not in peek
    assert peek.count("PermissionError") == 2, peek  # environ and mem of the host
    for how in ("return", "os._exit"):
        call = out[how]
        assert "timed out" not in call["text"], call
        assert call["seconds"] < 5, call  # not held until the 20 s timeout by the daemon's pipes
        assert not call["alive"], call  # the setsid() daemon was killed


def test_auto_refuses_to_start_without_a_working_bubblewrap():
    """Fail closed: where bwrap is missing, or present but unable to create namespaces, `auto` and
    `bwrap` raise an error naming the opt-out; nothing runs unsandboxed by accident."""
    import shutil
    import tempfile

    fake = Path(tempfile.mkdtemp(prefix="fakebwrap", dir="/tmp"))  # reachable by the harness's user
    fake.chmod(0o755)
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    try:
        _refusals(fake)
    finally:
        shutil.rmtree(fake, ignore_errors=True)


def _refusals(fake):
    for path in ("/nonexistent", f"{fake}:/usr/bin:/bin"):  # missing; installed but unable to start
        for mode in ("auto", "bwrap"):
            out, _ = _harness(mode, path=path)
            assert "refused" in out, out
            assert f"sandbox={mode}" in out["refused"] and "sandbox=none" in out["refused"]
            if path != "/nonexistent":
                assert "No permissions to creating new namespace" in out["refused"]


def test_a_tool_that_cannot_sandbox_stops_the_run_config():
    """Through the tools config (what main_ppo builds): the refusal is a ToolBuildError, not a skip."""
    import subprocess
    import sys

    code = ("from verl_arpo.workers.rollout.tools.registry import build_tools\n"
            "build_tools({'tool_instances': {'python': {'class_path': "
            "'verl_arpo.workers.rollout.tools.python_tool.PythonTool', 'params': {'sandbox': 'auto'}}}})\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PATH": "/nonexistent"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ToolBuildError" in r.stderr and "sandbox=none" in r.stderr, r.stderr[-2000:]
