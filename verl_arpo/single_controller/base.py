"""``Worker``: the base class of every process a worker group drives.

A worker learns its place from the usual torch.distributed environment variables, which
:class:`~verl_arpo.single_controller.ray.RayWorkerGroup` sets for each Ray actor (``torchrun`` sets
the same ones, so a worker also runs outside Ray):

``RANK``, ``WORLD_SIZE``
    global rank and number of workers in the group;
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``
    rank among the workers of the same node (= bundle index in that node's placement group);
``MASTER_ADDR``, ``MASTER_PORT``
    where rank 0 listens for the process-group rendezvous.

How this differs from verl's ``Worker``:

- The environment is the single source of truth: ``rank`` etc. are properties that read it, so a
  subclass works even if it forgets ``super().__init__()``.
- No ``WorkerMeta`` / ``WorkerHelper`` / register-center actor: before creating the actors, the
  group runs :func:`find_master_addr_port` as a small task in rank 0's bundle (same node as rank 0)
  and gives the answer to every rank at creation, so even ``__init__`` may call
  :meth:`init_process_group`.
- :meth:`init_process_group` is explicit and idempotent; workers call it when they need
  collectives (in ``__init__`` or later).
- No NPU / ``hccl`` support and no ``CUDA_VISIBLE_DEVICES`` juggling: Ray assigns GPUs per actor.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from datetime import timedelta
from typing import Any

__all__ = ["Worker"]

_INT_VARS = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}
GROUP_HOSTS_ENV = "VERL_ARPO_GROUP_HOSTS"
"""Number of distinct host addresses among the group's ranks (set by ``RayWorkerGroup``)."""


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return _INT_VARS[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def node_ip_address() -> str:
    """This node's IP as Ray sees it (the address other nodes reach it at); without Ray, the
    address the host name resolves to, else ``127.0.0.1``."""
    ray = sys.modules.get("ray")   # a process that never imported Ray (trainer.single_process) is not in a cluster
    try:
        if ray is not None and ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # not connected: fall through
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def find_master_addr_port() -> tuple[str, int]:
    """This node's IP and a free port on it. ``RayWorkerGroup`` runs this as a Ray task in rank 0's
    bundle before creating any actor, so every rank (rank 0 included) starts with ``MASTER_ADDR`` /
    ``MASTER_PORT`` already set."""
    return node_ip_address(), find_free_port()


# Ray's workers listen on 10002-19999 by default (``--min/max-worker-port``); we pick above them.
_FIRST_PORT = 20000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns by itself (``bind(0)`` and the source port of every
    outgoing connection): Linux's ``ip_local_port_range``, else the common default 32768-60999."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as handle:
            low, high = (int(v) for v in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port(host: str = "") -> int:
    """A TCP port that is free on this node right now, for a rendezvous another process opens later.

    Picked at random *below* the kernel's ephemeral range (and above Ray's worker ports): a port in
    that range can be handed out as the source port of any outgoing connection between this probe
    and the moment rank 0 listens on it — Ray opens many —, which failed a CI run with EADDRINUSE in
    ``init_process_group``. Outside it only another listener can take the port. Falls back to a port
    the OS picks when that band is empty or full. ``SystemRandom``: training seeds ``random``, and
    two groups seeded alike must not draw the same port.
    """
    low, _ = ephemeral_port_range()
    draw = random.SystemRandom()
    if low - _FIRST_PORT >= 64:
        for _ in range(64):
            port = draw.randrange(_FIRST_PORT, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def interface_of(ip: str) -> str | None:
    """Name of the network interface that holds the IPv4 address ``ip`` on this host, or ``None``."""
    try:
        import psutil
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def pick_gloo_interface() -> str | None:
    """For a gloo group spanning nodes: unless ``GLOO_SOCKET_IFNAME`` is set, set it to the interface
    holding this node's Ray IP and return that name.

    Gloo otherwise binds to the address the host name resolves to, which on many hosts is a loopback
    address (``127.0.1.1`` on Debian); the other nodes are then told to connect to it and the group
    fails with "Connection refused, remote=[127.0.0.1]". Set ``GLOO_SOCKET_IFNAME`` yourself (on the
    ``ray start`` command of each node or in ``ray_init.runtime_env.env_vars``) to choose another one.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    ip = node_ip_address()
    name = interface_of(ip) if not ip.startswith("127.") else None
    if name and name != "lo":
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


class Worker:
    """Base class for the classes a ``RayWorkerGroup`` instantiates (one instance per rank).

    Subclasses decorate the methods the driver calls with
    :func:`verl_arpo.single_controller.decorator.register`.
    """

    def __init__(self) -> None:
        # Nothing to store: the rank information lives in the environment (see module docstring).
        pass

    # -- identity ---------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """Global rank (``RANK``, default 0)."""
        return _env_int("RANK")

    @property
    def world_size(self) -> int:
        """Number of workers in the group (``WORLD_SIZE``, default 1)."""
        return _env_int("WORLD_SIZE")

    @property
    def local_rank(self) -> int:
        """Rank on this node (``LOCAL_RANK``, default 0)."""
        return _env_int("LOCAL_RANK")

    @property
    def local_world_size(self) -> int:
        """Workers on this node (``LOCAL_WORLD_SIZE``, default 1)."""
        return _env_int("LOCAL_WORLD_SIZE")

    @property
    def master_addr(self) -> str | None:
        """Rendezvous host (``MASTER_ADDR``), ``None`` until known."""
        return os.environ.get("MASTER_ADDR") or None

    @property
    def master_port(self) -> int | None:
        """Rendezvous port (``MASTER_PORT``), ``None`` until known."""
        raw = os.environ.get("MASTER_PORT")
        return int(raw) if raw else None

    def spans_hosts(self) -> bool:
        """Whether the group's ranks live on more than one host: ``VERL_ARPO_GROUP_HOSTS`` > 1 (set
        by ``RayWorkerGroup`` from where Ray placed the ranks); without it (torchrun), whether some
        ranks are on other nodes (``LOCAL_WORLD_SIZE < WORLD_SIZE``)."""
        raw = os.environ.get(GROUP_HOSTS_ENV, "")
        if raw.isdigit():
            return int(raw) > 1
        return self.local_world_size < self.world_size

    def set_environment(self, env: dict[str, str]) -> None:
        """Add variables to this worker's environment (credentials that must not travel in Ray's
        runtime_env, whose agent logs it)."""
        os.environ.update({str(k): str(v) for k, v in env.items()})

    def get_node_info(self) -> dict[str, Any]:
        """Where this worker runs: ``hostname``, ``ip``, ``pid``, ``rank``, ``world_size``,
        ``local_rank``, ``local_world_size``, ``master_addr``, ``master_port``,
        ``gloo_socket_ifname`` and, inside Ray, ``node_id``, ``placement_group_id`` and
        ``assigned_resources`` (bundle-qualified names)."""
        info: dict[str, Any] = {
            "hostname": socket.gethostname(),
            "ip": node_ip_address(),
            "pid": os.getpid(),
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }
        try:
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                ctx = ray.get_runtime_context()
                info["node_id"] = ctx.get_node_id()
                info["placement_group_id"] = ctx.get_placement_group_id()
                info["assigned_resources"] = ctx.get_assigned_resources()
        except Exception:  # informational only
            pass
        return info

    # -- process group ----------------------------------------------------------------------------

    def init_process_group(self, backend: str | None = None, timeout_seconds: float = 1800.0) -> None:
        """Join the group's ``torch.distributed`` default process group (no-op if already joined).

        ``backend`` defaults to ``cpu:gloo,cuda:nccl`` with CUDA, else ``gloo``
        (:mod:`verl_arpo.utils.device`); with NCCL in it the local device is selected first. A gloo group spanning hosts
        (:meth:`spans_hosts`) binds to the interface of this node's Ray IP unless
        ``GLOO_SOCKET_IFNAME`` is set (:func:`pick_gloo_interface`); on one host gloo keeps its
        default (the address the host name resolves to, often loopback). ``timeout_seconds``
        bounds every collective, so a dead peer turns into an error instead of a hang.
        """
        import torch.distributed as dist

        from verl_arpo.utils.device import get_dist_backend, set_local_device

        if dist.is_initialized():
            return
        if self.master_addr is None or self.master_port is None:
            raise RuntimeError(
                f"rank {self.rank}: MASTER_ADDR/MASTER_PORT are not set; start the worker through a "
                "RayWorkerGroup (or torchrun) before calling init_process_group()"
            )
        backend = backend or get_dist_backend()
        if "nccl" in backend:
            set_local_device(self.local_rank)
        if "gloo" in backend and self.spans_hosts():
            pick_gloo_interface()
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=float(timeout_seconds)),
        )

    def destroy_process_group(self) -> None:
        """Leave the default process group if this process joined one."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # -- liveness ---------------------------------------------------------------------------------

    def _ping(self) -> bool:
        """Liveness probe: returns ``True``."""
        return True
