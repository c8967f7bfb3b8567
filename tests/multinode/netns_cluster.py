"""Two Ray "hosts" on one machine: two network namespaces joined by a veth pair.

    namespace varpmn-a                         namespace varpmn-b
    lo 127.0.0.1                               lo 127.0.0.1
    varpmn-a0 10.200.0.1/24  <── veth ──>      varpmn-b0 10.200.0.2/24
    Ray head (GCS :6379, raylet, 2 CPUs)       Ray worker node (raylet, 2 CPUs)
    the driver (python -m ...main_ppo)

Each namespace has its own loopback and one end of the veth pair, and no route anywhere else: a
process inside can reach only the other namespace (and its own loopback), never the host's
interfaces or any outside address. Both ends of the pair are created directly inside the
namespaces, so nothing is added to the host's network namespace.

Processes: the namespaces share the host's process table, so ``ray stop`` (which kills every Ray
process it can see by name) would kill other people's Ray clusters. We never call it: a "host" is
stopped by SIGKILL of exactly the processes whose network namespace is ours (``ip netns pids``).

Names use the prefix ``varpmn``; :func:`remove_leftovers` deletes whatever a crashed earlier run
left (namespaces with the prefix, their processes, our Ray temp dir) and runs before and after.
The names are fixed, so a second run on the same machine waits for the first: the cluster holds
an exclusive lock on ``/tmp/varpmn.lock`` from before the clean-up until after the teardown.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "varpmn"
NS = {"a": f"{PREFIX}-a", "b": f"{PREFIX}-b"}
IFACE = {"a": f"{PREFIX}-a0", "b": f"{PREFIX}-b0"}
ADDR = {"a": "10.200.0.1", "b": "10.200.0.2"}
RAY_PORT = 6379
# Ray's unix sockets live under its temp dir and must stay under 107 characters: a short fixed path.
RAY_TMP = Path(f"/tmp/{PREFIX}")
LOCK_FILE = Path(f"/tmp/{PREFIX}.lock")
ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
IP = shutil.which("ip") or "/usr/sbin/ip"

# Environment of every Ray process and driver we start. RAY_AUTH_MODE=token: the head runs with
# token authentication (the token lives in ~/.ray/auth_token; `ray start` does not create it, so
# start_ray generates it first); the worker node and the drivers must say so too or the GCS refuses them.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def skip_reason() -> str | None:
    """Why the two-host tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not os.path.exists(IP):
        return "needs the `ip` command (iproute2: bash scripts/test.sh --multinode installs it)"
    if not (VENV_BIN / "ray").exists():
        return f"no ray executable next to {sys.executable}"
    return None


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def our_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(PREFIX)]


def namespace_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (only processes we started can be in it)."""
    out = _ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def kill_namespace(ns: str, timeout: float = 30) -> list[int]:
    """SIGKILL every process in ``ns`` (a machine losing power) until none is left; returns the pids."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        pids = namespace_pids(ns)
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {ns} survive SIGKILL: {pids}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def remove_leftovers() -> None:
    """Delete our namespaces (after killing their processes) and our Ray temp dir. Host links with
    our prefix cannot normally exist (the veth ends are born inside the namespaces); if one does, it
    is ours from an interrupted set-up and is deleted too."""
    for ns in our_namespaces():
        kill_namespace(ns)
        _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                _ip("link", "del", name, check=False)
    shutil.rmtree(RAY_TMP, ignore_errors=True)


class TwoHosts:
    """The two namespaces and a Ray cluster across them. Use as a context manager or call
    :meth:`start` / :meth:`teardown`."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **RAY_ENV, **(extra_env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.address = f"{ADDR['a']}:{RAY_PORT}"
        self._lock = None

    def acquire(self, timeout: float = 1200) -> None:
        """Wait (at most ``timeout`` s) until no other run on this machine uses the names."""
        if self._lock is not None:
            return
        lock = open(LOCK_FILE, "w")
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock = lock
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise RuntimeError(f"another two-host run holds {LOCK_FILE} for more than {timeout}s") from None
                time.sleep(1)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None

    # -- network ----------------------------------------------------------------------------------
    def create_network(self) -> None:
        self.acquire()
        remove_leftovers()
        for ns in NS.values():
            _ip("netns", "add", ns)
        _ip("link", "add", IFACE["a"], "netns", NS["a"], "type", "veth", "peer", "name", IFACE["b"], "netns", NS["b"])
        for host in ("a", "b"):
            _ip("-n", NS[host], "addr", "add", f"{ADDR[host]}/24", "dev", IFACE[host])
            _ip("-n", NS[host], "link", "set", "lo", "up")
            _ip("-n", NS[host], "link", "set", IFACE[host], "up")

    def link_bytes(self, host: str) -> int:
        """rx + tx bytes of ``host``'s end of the veth pair."""
        stats = json.loads(_ip("-s", "-j", "-n", NS[host], "link", "show", "dev", IFACE[host]).stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    # -- processes --------------------------------------------------------------------------------
    def command(self, host: str, argv: list[str]) -> list[str]:
        return [IP, "netns", "exec", NS[host], *argv]

    def run_in(self, host: str, argv: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=str(ROOT))
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} in {NS[host]} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return proc

    def popen_in(self, host: str, argv: list[str], log_path: Path, **kwargs) -> subprocess.Popen:
        log = open(log_path, "w")
        return subprocess.Popen(self.command(host, argv), stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=str(ROOT), **kwargs)

    # -- Ray --------------------------------------------------------------------------------------
    def start_ray(self, host: str) -> None:
        """`ray start` inside ``host``'s namespace: the head in A, a worker node joining it in B.
        Each node has its own --temp-dir (sockets, logs) so nothing collides with other clusters."""
        ray = str(VENV_BIN / "ray")
        common = [f"--node-ip-address={ADDR[host]}", "--num-cpus=2", "--disable-usage-stats",
                  f"--temp-dir={RAY_TMP / ('ray_' + host)}", "--object-store-memory=200000000"]
        if host == "a":
            self.run_in(host, [ray, "get-auth-token", "--generate"], timeout=120)  # as docs/multinode.md says
            argv = [ray, "start", "--head", f"--port={RAY_PORT}", "--include-dashboard=false", *common]
        else:
            argv = [ray, "start", f"--address={self.address}", *common]
        self.run_in(host, argv, timeout=180)

    def alive_nodes(self) -> list[str]:
        """Node IPs the GCS lists as alive (asked by a short driver in A)."""
        code = ("import ray, json; ray.init(address=%r, log_to_driver=False); "
                "print('NODES', json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
                % self.address)
        out = self.run_in("a", [sys.executable, "-c", code], timeout=120).stdout
        line = [ln for ln in out.splitlines() if ln.startswith("NODES ")][-1]
        return json.loads(line[len("NODES "):])

    def wait_for_nodes(self, timeout: float = 120) -> None:
        """Until exactly A and B are alive (a killed B must be marked dead first: it would otherwise
        still count as a node the resource pool may pin a rank to)."""
        want = sorted([ADDR["a"], ADDR["b"]])
        deadline = time.monotonic() + timeout
        nodes: list[str] = []
        while time.monotonic() < deadline:
            nodes = self.alive_nodes()
            if nodes == want:
                return
            time.sleep(2)
        raise RuntimeError(f"cluster did not reach alive nodes {want} in {timeout}s: {nodes}")

    def kill_host(self, host: str) -> list[int]:
        """Lose a "host": SIGKILL every process in its namespace (Ray and workers alike)."""
        return kill_namespace(NS[host])

    def start(self) -> TwoHosts:
        RAY_TMP.mkdir(parents=True, exist_ok=True)
        self.create_network()
        self.start_ray("a")
        self.start_ray("b")
        self.wait_for_nodes()
        return self

    def teardown(self) -> None:
        if self._lock is None:  # never set up (or another run owns the names): nothing of ours to remove
            return
        try:
            for host in ("b", "a"):
                if NS[host] in our_namespaces():
                    kill_namespace(NS[host])
            remove_leftovers()
        finally:
            self.release()

    def __enter__(self) -> TwoHosts:
        try:
            return self.start()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc) -> None:
        self.teardown()
