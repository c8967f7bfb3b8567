"""The command line's local Ray head (verl_arpo/trainer/local_ray.py): a session of its own, so a
signal to the driver's process group does not reach it, and it dies with a driver killed outright."""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from verl_arpo.trainer.local_ray import LocalRayHead


def _session_members(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error, PermissionError):
            pass
    return out


def _wait_gone(sid: int, timeout: float = 60) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := _session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_the_head_runs_in_its_own_session_and_stop_leaves_nothing():
    head = LocalRayHead(num_cpus=1, env={"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"})
    address = head.start()
    try:
        sid = os.getsid(head.process.pid)
        assert sid == head.process.pid != os.getsid(0)  # a new session: our group's signals miss it
        names = {p.name() for p in _session_members(sid)}
        assert {"gcs_server", "raylet"} <= names, names   # the cluster's daemons are in it
        assert address.startswith("127.0.0.1:")
        # its address is recorded in its own temp dir, where a plain ray.init() elsewhere never looks
        assert (head.temp_dir / "ray_current_cluster").read_text().endswith(address.split(":")[1])
        default = Path("/tmp/ray/ray_current_cluster")
        assert not default.exists() or not default.read_text().endswith(address.split(":")[1])
    finally:
        head.stop()
    assert _wait_gone(sid) == [] and not head.temp_dir.exists()


def test_a_machine_where_ray_never_ran_gets_a_token_and_the_head_starts(tmp_path, monkeypatch):
    """Token mode on a HOME without ~/.ray/auth_token (a fresh GPU node): `ray start` alone refuses
    to start there; the head creates the token first, keeps it out of its log, and reuses it."""
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    token_file = tmp_path / ".ray" / "auth_token"
    head = LocalRayHead(num_cpus=1, env={"HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        head.start()
        token = token_file.read_text().strip()
        assert len(token) >= 32, token_file
        assert token not in head.log.read_text()
        head.ensure_auth_token()                     # a second run finds it: not written again
        assert token_file.read_text().strip() == token
    finally:
        head.stop()


def _ray_finds_a_token(env: dict) -> bool:
    """Ray's own lookup (its C++ token loader), in a fresh process with `env`."""
    code = ("from ray._raylet import AuthenticationTokenLoader\n"
            "print(AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1] == "True"


def test_a_token_found_where_ray_looks_skips_generating_one(tmp_path):
    """`ensure_auth_token` skips its `ray get-auth-token` subprocess when a token exists. Each place
    `existing_auth_token` finds one, Ray's own loader finds one too; where it finds none, neither does Ray."""
    from verl_arpo.trainer.local_ray import existing_auth_token

    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    home, empty_home = tmp_path / "home", tmp_path / "empty_home"
    (home / ".ray").mkdir(parents=True)
    empty_home.mkdir()
    (home / ".ray" / "auth_token").write_text("a" * 32 + "\n")
    named = tmp_path / "elsewhere_token"
    named.write_text("b" * 32)
    blank = tmp_path / "blank_token"
    blank.write_text("\n")
    cases = {
        "the file in HOME": ({"HOME": str(home)}, str(home / ".ray" / "auth_token")),
        "the variable": ({"HOME": str(empty_home), "RAY_AUTH_TOKEN": "c" * 32}, "RAY_AUTH_TOKEN"),
        "the named file": ({"HOME": str(empty_home), "RAY_AUTH_TOKEN_PATH": str(named)}, str(named)),
        "nothing": ({"HOME": str(empty_home)}, None),
        "a blank named file": ({"HOME": str(empty_home), "RAY_AUTH_TOKEN_PATH": str(blank)}, None),
    }
    for label, (extra, expected) in cases.items():
        env = {**base, **extra}
        assert existing_auth_token(env) == expected, label
        if expected is not None:
            assert _ray_finds_a_token(env), label
        elif label == "nothing":
            assert not _ray_finds_a_token(env), label
    head = LocalRayHead(num_cpus=1, env={"HOME": str(empty_home), "RAY_AUTH_MODE": "token",
                                         "RAY_AUTH_TOKEN_PATH": str(named)})
    head.ensure_auth_token()    # found: nothing generated into the empty HOME
    assert not (empty_home / ".ray").exists()
    head.stop()                 # never started: its log and temp dir go all the same
    assert not head.temp_dir.exists() and not head.log.exists()


def test_the_head_dies_with_a_driver_killed_outright(tmp_path):
    """A driver that never reaches stop() (SIGKILL, or the preemption watchdog's os._exit): the
    kernel's parent-death signal stops the head, and the head stops its daemons."""
    out = tmp_path / "sid"
    code = textwrap.dedent(f"""
        import os
        from verl_arpo.trainer.local_ray import LocalRayHead
        head = LocalRayHead(num_cpus=1, env={{"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}})
        head.start()
        open({str(out)!r}, "w").write(str(os.getsid(head.process.pid)))
        os._exit(1)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    sid = int(out.read_text())
    assert _wait_gone(sid) == []


def test_a_head_that_cannot_start_says_why(monkeypatch):
    head = LocalRayHead(num_cpus=1)
    monkeypatch.setattr(head, "command", lambda port: [sys.executable, "-c", "print('no such thing'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="did not start.*no such thing"):
        head.start(timeout_s=30)
    assert head.process is None and head.log.exists()
    head.stop()      # as init_ray's clean-up does after the failure: the log the error names stays
    assert head.log.exists()
    head.log.unlink()
    shutil.rmtree(head.temp_dir, ignore_errors=True)
