"""``RayWorkerGroup``: one Ray actor per bundle of a :class:`RayResourcePool`, driven as one object.

Start-up. First a resource-free Ray task runs in rank 0's bundle (bundle 0 of the first placement
group, so on rank 0's node) and reports that node's IP and a free port: ``MASTER_ADDR`` /
``MASTER_PORT``. Then all actors are created at once, each with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``VERL_ARPO_GROUP_HOSTS``
(the number of distinct node IPs of the group) in ``runtime_env["env_vars"]``, plus
``RAY_USAGE_STATS_ENABLED=0`` and ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` = the actor's whole
CPU share (at least 1) unless ``env_vars`` overrides them. (Why not ask rank 0's actor itself?
That serialises two actor start-ups and leaves rank 0's ``__init__`` without a master address; the
task gives the same node and the same kind of port.) The group waits until every actor answers
:meth:`Worker.get_node_info` and keeps the answers (``wg.node_infos``) for error messages.

Calls. Every method of the worker class tagged with ``@register`` becomes a method of the group:
``wg.name(*args)`` plans the per-rank calls (:mod:`..decorator`), submits them, waits, collects.
A method registered with ``blocking=False`` returns a :class:`PendingCall` at once (``.get()``).
``execute_all`` / ``execute_rank_zero`` call any method by name, registered or not.

Failures. The group waits on the per-rank results one at a time as they finish (``ray.wait``), so a
rank whose process died is reported as soon as Ray knows, even while other ranks are still
blocked (for example in a collective with the dead rank):

- an actor death (``RayActorError``) raises :class:`WorkerGroupError` (a ``RuntimeError``) naming
  the method, the rank, its node IP and pid; the trainer adds which checkpoint to resume from;
- an exception raised by the method itself is re-raised unchanged (its type is kept, so callers can
  catch ``ValueError`` etc.) with a note naming the rank, node and method;
- when one rank raises while others are still running, the group first waits up to
  ``peer_failure_grace`` seconds (default 10) for the others: if one of them died, the error is the
  :class:`WorkerGroupError` naming the dead rank and its node (a collective's "Connection closed by
  peer" on the survivor usually arrives first when a node is lost);
- with ``call_timeout`` (seconds) set, a call not finished in time raises
  :class:`WorkerGroupTimeoutError` (both a ``RuntimeError`` and a ``TimeoutError``) naming the ranks
  still running. The slow calls are not cancelled: kill the group if it cannot recover.

Colocation. Our design holds actor, rollout and reference in one class (``ActorRolloutRefWorker``)
in one process per slot, so no ``create_colocated_worker_cls`` is needed. Separate groups (e.g. a
critic beside the actor) share a pool built with ``max_colocate_count >= 2``: each group's actors
take ``1 / max_colocate_count`` of their bundle's CPU (and GPU), and each group forms its own
process group with its own master port.

How this differs from verl: no register-center actor, no ``detached`` / ``from_detached`` groups,
no ``spawn`` / ``fuse`` / colocated-class splitting, no ``DataProtoFuture``; errors name the rank and
node; an optional call timeout; ``shutdown()`` kills the actors.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_arpo.single_controller.base import GROUP_HOSTS_ENV, Worker, find_master_addr_port
from verl_arpo.single_controller.decorator import CallPlan, MethodSpec, bind_group_methods, plan_call
from verl_arpo.single_controller.ray.resource_pool import RayResourcePool
from verl_arpo.utils.threads import cpu_process_env

__all__ = ["PendingCall", "RayClassWithInitArgs", "RayWorkerGroup", "WorkerGroupError", "WorkerGroupTimeoutError"]

logger = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its error texts
_RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class WorkerGroupError(RuntimeError):
    """A worker of a group died (or could not start) during a call."""


class WorkerGroupTimeoutError(WorkerGroupError, TimeoutError):
    """A group call did not finish within the group's ``call_timeout``."""


class RayClassWithInitArgs:
    """A worker class (a :class:`Worker` subclass, or ``ray.remote`` of one) with its constructor
    arguments; ``update_options`` adds Ray actor options (e.g. ``max_concurrency``)."""

    def __init__(self, cls: type | Any, *args: Any, **kwargs: Any) -> None:
        user_cls = getattr(cls, "__ray_actor_class__", cls)  # unwrap ray.remote(cls)
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"RayClassWithInitArgs needs a subclass of verl_arpo.single_controller.base.Worker, got {cls!r}")
        self.cls = user_cls
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Extra keyword arguments for ``ActorClass.options`` (ours win on resources and env)."""
        self.options.update(options)


class PendingCall:
    """A non-blocking group call (``@register(blocking=False)``): ``.get()`` waits and collects."""

    def __init__(self, group: RayWorkerGroup, method: str, plan: CallPlan, refs: list) -> None:
        self._group, self._method, self._plan, self.refs = group, method, plan, refs

    def get(self, timeout: float | None = None) -> Any:
        """Wait (at most ``timeout`` s, default the group's ``call_timeout``) and collect."""
        outputs = self._group._wait(self._method, self._plan.ranks, self.refs, timeout)
        return self._plan.collect(outputs)


class RayWorkerGroup:
    """``world_size`` Ray actors of one worker class, one per bundle of ``resource_pool``."""

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        name_prefix: str | None = None,
        num_cpus_per_worker: float | None = None,
        env_vars: dict[str, str] | None = None,
        call_timeout: float | None = None,
        init_timeout: float = 300.0,
    ) -> None:
        """
        Args:
            resource_pool: where the actors go; one actor per bundle, rank order = bundle order.
            ray_cls_with_init: the worker class and its constructor arguments.
            name_prefix: prefix of the actor names (the class name when ``None``); a random
                suffix keeps names unique.
            num_cpus_per_worker: logical CPUs per actor (default: the bundle's CPUs divided by the
                pool's ``max_colocate_count``); must fit in that share.
            env_vars: extra environment for every actor (cannot set the rank variables).
            call_timeout: seconds a group call may take before ``WorkerGroupTimeoutError``
                (``None``: wait forever; change it later through ``wg.call_timeout``).
            init_timeout: seconds to wait for all actors to start.
        """
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            raise TypeError("ray_cls_with_init must be a RayClassWithInitArgs")
        bad = sorted(set(env_vars or {}) & set(_RESERVED_ENV))
        if bad:
            raise ValueError(f"env_vars cannot set {bad}: the worker group assigns them")
        self.resource_pool = resource_pool
        self.ray_cls_with_init = ray_cls_with_init
        self.worker_cls = ray_cls_with_init.cls
        self.name_prefix = f"{name_prefix or self.worker_cls.__name__}_{uuid.uuid4().hex[:6]}"
        self.call_timeout = call_timeout
        self.peer_failure_grace = 10.0  # see _dead_peer
        share = 1.0 / resource_pool.max_colocate_count
        bundle_cpus = resource_pool.cpus_per_bundle
        self.num_cpus_per_worker = float(num_cpus_per_worker) if num_cpus_per_worker is not None else bundle_cpus * share
        if not 0 <= self.num_cpus_per_worker <= bundle_cpus * share + 1e-9:
            raise ValueError(
                f"num_cpus_per_worker={self.num_cpus_per_worker} does not fit this group's share of a bundle "
                f"({bundle_cpus} CPUs / max_colocate_count {resource_pool.max_colocate_count})"
            )
        self.num_gpus_per_worker = share if resource_pool.use_gpu else 0.0
        self._env_vars = dict(env_vars or {})
        self._workers: list[Any] = []
        self.node_infos: list[dict] = []
        self.master_address: str | None = None
        self.master_port: int | None = None
        bind_group_methods(self, self.worker_cls, self._run_call)  # before any actor exists: a name clash costs nothing
        try:
            self._create_actors(init_timeout)
        except BaseException:
            self.shutdown()
            raise

    # -- properties --------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks (= bundles of the pool)."""
        return self.resource_pool.world_size

    @property
    def workers(self) -> list[Any]:
        """The Ray actor handles, index = rank."""
        return list(self._workers)

    # -- start-up ----------------------------------------------------------------------------------

    def _actor_options(self, rank: int, pg: Any, bundle: int, env: dict[str, str]) -> dict[str, Any]:
        """Ray options for rank ``rank``. Environment, later entries winning: our CPU defaults, the
        class's ``runtime_env["env_vars"]``, the group's ``env_vars``, the rank variables."""
        threads = str(max(1, int(self.num_cpus_per_worker)))
        options = dict(self.ray_cls_with_init.options)
        runtime_env = dict(options.pop("runtime_env", None) or {})
        env_vars = {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        env_vars.update(runtime_env.get("env_vars") or {})
        env_vars.update(self._env_vars)
        env_vars.update(env)
        # threads that sleep while they wait (a worker's siblings share its cores), unless a wait
        # policy is set above or by the user in this environment (theirs wins); MKL's code path
        runtime_env["env_vars"] = {**cpu_process_env(env_vars, alone=False), **env_vars}
        options.update(
            name=f"{self.name_prefix}:{rank}",
            num_cpus=self.num_cpus_per_worker,
            num_gpus=self.num_gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle),
            runtime_env=runtime_env,
            max_restarts=0,
            max_task_retries=0,
        )
        return options

    def _create_actors(self, init_timeout: float) -> None:
        pgs = self.resource_pool.get_placement_groups()
        world_size = self.resource_pool.world_size
        local_world = self.resource_pool.local_world_size_list()
        local_rank = self.resource_pool.local_rank_list()
        slots = [(pg, b) for pg, count in zip(pgs, self.resource_pool.store) for b in range(count)]

        # rank 0's node IP and a free port there, found by a resource-free task in rank 0's bundle
        probe = ray.remote(find_master_addr_port).options(
            num_cpus=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=slots[0][0], placement_group_bundle_index=slots[0][1]),
        )
        try:
            addr, port = ray.get(probe.remote(), timeout=init_timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerGroupTimeoutError(f"could not reach rank 0's bundle within {init_timeout}s to pick a master port") from None
        self.master_address, self.master_port = str(addr), int(port)

        remote_cls = ray.remote(self.worker_cls)
        cargs, ckwargs = self.ray_cls_with_init.args, self.ray_cls_with_init.kwargs
        self.node_infos = self._placeholder_infos(slots)  # for errors before the actors answer
        ips = {info["ip"] for info in self.node_infos}
        for rank, (pg, bundle) in enumerate(slots):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(local_rank[rank]),
                "LOCAL_WORLD_SIZE": str(local_world[rank]),
                "MASTER_ADDR": self.master_address,
                "MASTER_PORT": str(self.master_port),
            }
            if "?" not in ips:  # distinct host addresses of the group (Worker.init_process_group uses it)
                env[GROUP_HOSTS_ENV] = str(len(ips))
            options = self._actor_options(rank, pg, bundle, env)
            self._workers.append(remote_cls.options(**options).remote(*cargs, **ckwargs))
        refs = [w.get_node_info.remote() for w in self._workers]
        try:
            self.node_infos = self._wait("get_node_info", list(range(world_size)), refs, init_timeout)
        except WorkerGroupTimeoutError as exc:
            raise WorkerGroupTimeoutError(
                f"{exc}: the actors did not start. Is the pool full (more groups than max_colocate_count="
                f"{self.resource_pool.max_colocate_count}, or num_cpus_per_worker too large)? Is the worker's "
                f"__init__ slow (raise init_timeout)?"
            ) from None

    @staticmethod
    def _placeholder_infos(slots: list) -> list[dict]:
        """Rank and node IP of every slot, from where Ray placed its bundle."""
        ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
        infos = []
        for rank, (pg, bundle) in enumerate(slots):
            node_id = ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(bundle)
            infos.append({"rank": rank, "ip": ips.get(node_id, "?"), "node_id": node_id})
        return infos

    def _run_call(self, name: str, spec: MethodSpec, plan: CallPlan) -> Any:
        """Submit a planned call to the ranks; wait and collect, or return a PendingCall (blocking=False)."""
        refs = self._submit(name, plan)
        if not spec.blocking:
            return PendingCall(self, name, plan, refs)
        return plan.collect(self._wait(name, plan.ranks, refs))

    # -- calling -----------------------------------------------------------------------------------

    def _submit(self, method: str, plan: CallPlan) -> list:
        if len(self._workers) != self.world_size:
            raise WorkerGroupError(f"group {self.name_prefix!r} has no running actors (shut down); cannot call {method}")
        return [
            getattr(self._workers[rank], method).remote(*a, **kw)
            for rank, a, kw in zip(plan.ranks, plan.args, plan.kwargs)
        ]

    def _where(self, rank: int) -> str:
        info = self.node_infos[rank] if rank < len(self.node_infos) else {}
        return f"rank {rank} (node {info.get('ip', '?')}, pid {info.get('pid', '?')})"

    def _wait(self, method: str, ranks: list[int], refs: list, timeout: float | None = None) -> list:
        """Results of ``refs`` (one per entry of ``ranks``), failing fast on the first dead rank."""
        timeout = self.call_timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        position = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        what = f"{self.worker_cls.__name__}.{method}"
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = ", ".join(self._where(ranks[position[r]]) for r in pending)
                raise WorkerGroupTimeoutError(f"{what} did not finish within {timeout}s on {late}")
            for ref in ready:
                i = position[ref]
                try:
                    results[i] = ray.get(ref)
                except RayActorError as exc:
                    detail = " ".join(_ANSI.sub("", str(exc)).split())
                    raise WorkerGroupError(
                        f"worker {self._where(ranks[i])} of group {self.name_prefix!r} died during {what}: "
                        f"{type(exc).__name__}: {detail[:600]}"
                    ) from exc
                except Exception as exc:
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"raised by {what} on worker {self._where(ranks[i])} of group {self.name_prefix!r}")
                    dead = self._dead_peer(pending, position, deadline)
                    if dead is not None:  # the exception is the echo of a peer's death: name the dead one
                        j, death = dead
                        detail = " ".join(_ANSI.sub("", str(death)).split())
                        first = " ".join(_ANSI.sub("", str(exc)).split()[-40:])
                        raise WorkerGroupError(
                            f"worker {self._where(ranks[j])} of group {self.name_prefix!r} died during {what}: "
                            f"{type(death).__name__}: {detail[:600]} (first reported as an error on "
                            f"{self._where(ranks[i])}: ...{first[-400:]})"
                        ) from death
                    raise
        return results

    def _dead_peer(self, pending: list, position: dict, deadline: float | None) -> tuple[int, Exception] | None:
        """After one rank raised: wait up to ``peer_failure_grace`` s for the ranks still running and
        return ``(index, error)`` of the first that died, else ``None``. A rank blocked in a collective
        with a dead peer raises at once (gloo: "Connection closed by peer"), about a second before Ray
        reports the peer's death; without this the error would name the survivor, not the lost node."""
        grace = time.monotonic() + max(0.0, float(self.peer_failure_grace))
        if deadline is not None:
            grace = min(grace, deadline)
        pending = list(pending)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, grace - time.monotonic()))
            if not ready:
                return None
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    return position[ref], exc
                except Exception:  # another ordinary error: keep looking for a death
                    pass
        return None

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method_name`` with the same arguments on every rank; results in rank order."""
        plan = plan_call("ONE_TO_ALL", self.world_size, args, kwargs)
        return self._wait(method_name, plan.ranks, self._submit(method_name, plan))

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method_name`` on rank 0 only and return its result."""
        plan = plan_call("RANK_ZERO", self.world_size, args, kwargs)
        return plan.collect(self._wait(method_name, plan.ranks, self._submit(method_name, plan)))

    # -- teardown ----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill every actor of the group (running calls fail); the pool stays reserved."""
        for actor in self._workers:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead, or Ray shut down
                logger.debug("ray.kill failed: %s", exc)
        self._workers = []

    def __repr__(self) -> str:
        return f"RayWorkerGroup({self.worker_cls.__name__}, world_size={self.world_size}, name_prefix={self.name_prefix!r})"
