"""Hostile code is contained and reported, and the host is unharmed.

Tests marked ``bwrap`` need a working bubblewrap; the rest also run against the plain-subprocess
fallback (``sandbox="none"``), which keeps rlimits, the minimal environment and uid 65534.
"""
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("mode", MODES)
def test_secret_env_not_visible(mode, monkeypatch):
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
