"""``RayResourcePool``: the slots (placement-group bundles) worker groups run in.

``process_on_nodes=[a, b, ...]`` asks for ``a`` workers on one node, ``b`` on another, and so on
(``trainer.n_gpus_per_node`` repeated ``trainer.nnodes`` times). Each entry becomes one placement
group with one bundle per worker, ``{"CPU": cpus_per_bundle}`` plus ``{"GPU": 1}`` when ``use_gpu``.

Placement strategy:

- Inside a node: each placement group is ``STRICT_PACK``, so all its bundles sit on one node and
  bundle ``i`` is local rank ``i`` there.
- Across nodes: when the pool has several entries and the cluster has at least that many alive
  nodes whose *total* resources fit an entry, each group is pinned to its own node with a per-bundle
  label selector on Ray's default ``ray.io/node-id`` label (a hard constraint, unlike
  ``_soft_target_node_id``). Nodes are taken in a fixed order: the driver's node first, then by IP
  and node id, so rank 0 lives beside the driver and ``[1, 1]`` on a 2-node cluster gives one rank
  per node. With fewer suitable nodes than entries (a single machine running ``[1, 1]``) nothing is
  pinned and Ray packs the groups where they fit, possibly on one node; a warning says so.
- Pinning uses total, not free, resources (Ray has no public per-node availability). If a chosen
  node is busy, :meth:`get_placement_groups` fails after ``ready_timeout`` seconds with an error
  listing the request and the cluster's free resources, and removes what it reserved.

Sharing (colocation): several worker groups may use one pool. Each group's actor takes
``1 / max_colocate_count`` of its bundle (CPU and GPU), so ``max_colocate_count=2`` fits an actor
group and a critic group on the same bundles.

How this differs from verl: verl makes one ``PACK`` (or ``STRICT_PACK``) group per node and lets
Ray choose the nodes, so two groups may land on one node; we pin them. The CPU count of a bundle
is a parameter (``cpus_per_bundle``) instead of ``max_colocate_count``. No detached lifetime:
the groups die with the driver; call :meth:`remove` to free them earlier.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

__all__ = ["RayResourcePool"]

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"


class ClusterTooSmallError(RuntimeError):
    """The cluster can never hold the pool: fewer nodes with enough total CPUs/GPUs than it needs."""

    def __init__(self, workers_per_node: int, nodes_needed: int, per_node: dict[str, float], nodes: list[dict]):
        self.workers_per_node, self.nodes_needed, self.per_node, self.nodes = workers_per_node, nodes_needed, per_node, nodes
        super().__init__(f"{nodes_needed} node(s) with {per_node} each are needed for {workers_per_node} workers per "
                         f"node; the cluster's alive nodes have {nodes}")


class RayResourcePool:
    """Placement groups for ``process_on_nodes`` workers, created on first use."""

    def __init__(
        self,
        process_on_nodes: list[int],
        use_gpu: bool = False,
        name_prefix: str = "",
        max_colocate_count: int = 1,
        cpus_per_bundle: float = 1.0,
        ready_timeout: float = 120.0,
        spread_nodes: bool = True,
    ) -> None:
        """
        Args:
            process_on_nodes: workers per node, one entry per node.
            use_gpu: give every bundle one GPU.
            name_prefix: prefix of the placement-group names (a random one when empty).
            max_colocate_count: how many worker groups may share each bundle.
            cpus_per_bundle: logical CPUs reserved per bundle.
            ready_timeout: seconds to wait for the reservation before raising.
            spread_nodes: pin each entry to its own node when the cluster allows it.
        """
        counts = [int(c) for c in process_on_nodes]
        if not counts or any(c < 1 for c in counts):
            raise ValueError(f"process_on_nodes must be a non-empty list of positive counts, got {process_on_nodes!r}")
        if int(max_colocate_count) < 1:
            raise ValueError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        if float(cpus_per_bundle) <= 0:
            raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
        self._store = counts
        self.use_gpu = bool(use_gpu)
        self.name_prefix = name_prefix or f"pool_{uuid.uuid4().hex[:6]}"
        self.max_colocate_count = int(max_colocate_count)
        self.cpus_per_bundle = float(cpus_per_bundle)
        self.ready_timeout = float(ready_timeout)
        self.spread_nodes = bool(spread_nodes)
        self._pgs: list[PlacementGroup] | None = None

    # -- shape ------------------------------------------------------------------------------------

    @property
    def store(self) -> list[int]:
        """Workers per node (a copy of ``process_on_nodes``)."""
        return list(self._store)

    @property
    def world_size(self) -> int:
        """Total number of bundles (= workers per group)."""
        return sum(self._store)

    def bundle(self) -> dict[str, float]:
        """The resources of one bundle."""
        spec = {"CPU": self.cpus_per_bundle}
        if self.use_gpu:
            spec["GPU"] = 1.0
        return spec

    def local_world_size_list(self) -> list[int]:
        """For every rank, the number of workers on its node."""
        return [n for n in self._store for _ in range(n)]

    def local_rank_list(self) -> list[int]:
        """For every rank, its index on its node."""
        return [i for n in self._store for i in range(n)]

    # -- placement groups -------------------------------------------------------------------------

    def get_placement_groups(self) -> list[PlacementGroup]:
        """The pool's placement groups (one per entry of ``process_on_nodes``), reserved and ready.

        Created on the first call; raises ``RuntimeError`` if Ray is not initialised or if the
        reservation is not ready within ``ready_timeout`` seconds.
        """
        if self._pgs is None:
            self._pgs = self._create()
        return self._pgs

    def remove(self) -> None:
        """Release the placement groups (actors in them die). Safe to call twice."""
        for pg in self._pgs or []:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # Ray already shut down, or the group is gone
                logger.debug("remove_placement_group failed: %s", exc)
        self._pgs = None

    def check_capacity(self) -> None:
        """Raise `ClusterTooSmallError` at once when no set of alive nodes can ever hold the pool
        (each entry of ``process_on_nodes`` on its own node, by the nodes' *total* resources), instead
        of waiting out ``ready_timeout`` for a reservation that cannot succeed. A cluster that is only
        busy passes: its reservation waits as before."""
        need = {k: v * n for k, v in self.bundle().items() for n in [max(self._store)]}
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        fitting = sum(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in nodes)
        if fitting < len(self._store):
            have = [{k: res.get(k, 0.0) for k in ("CPU", "GPU") if k in res or k in need} for res in nodes]
            raise ClusterTooSmallError(workers_per_node=max(self._store), nodes_needed=len(self._store),
                                       per_node=need, nodes=have)

    def _create(self) -> list[PlacementGroup]:
        if not ray.is_initialized():
            raise RuntimeError("RayResourcePool needs a running Ray: call ray.init() first")
        self.check_capacity()
        targets = self._pick_nodes()
        pgs = []
        for i, count in enumerate(self._store):
            bundles = [self.bundle() for _ in range(count)]
            kwargs: dict[str, Any] = {}
            if targets[i] is not None:
                kwargs["bundle_label_selector"] = [{NODE_ID_LABEL: targets[i]} for _ in range(count)]
            pgs.append(placement_group(bundles, strategy="STRICT_PACK", name=f"{self.name_prefix}_node{i}", **kwargs))
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout)
        if len(ready) < len(pgs):
            for pg in pgs:
                remove_placement_group(pg)
            raise RuntimeError(
                f"RayResourcePool {self.name_prefix!r}: could not reserve {self._store} bundles of {self.bundle()} "
                f"within {self.ready_timeout:.0f}s (pinned nodes: {targets}); cluster free resources: "
                f"{ray.available_resources()}, total: {ray.cluster_resources()}"
            )
        return pgs

    def _pick_nodes(self) -> list[str | None]:
        """Node id per entry (see module docstring), or ``None`` everywhere when not pinning."""
        unpinned: list[str | None] = [None] * len(self._store)
        if not self.spread_nodes or len(self._store) == 1:
            return unpinned
        here = ray.get_runtime_context().get_node_id()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        nodes.sort(key=lambda n: (n["NodeID"] != here, n.get("NodeManagerAddress", ""), n["NodeID"]))
        used: set[str] = set()
        chosen: list[str | None] = []
        for count in self._store:
            need = {key: val * count for key, val in self.bundle().items()}
            for node in nodes:
                res = node.get("Resources", {})
                if node["NodeID"] not in used and all(res.get(k, 0.0) >= v for k, v in need.items()):
                    used.add(node["NodeID"])
                    chosen.append(node["NodeID"])
                    break
            else:
                logger.warning(
                    "RayResourcePool %r: %d alive node(s) cannot hold %s on separate nodes; placement groups "
                    "are not pinned and may share a node", self.name_prefix, len(nodes), self._store,
                )
                return unpinned
        return chosen

    def __repr__(self) -> str:
        return (
            f"RayResourcePool(process_on_nodes={self._store}, use_gpu={self.use_gpu}, "
            f"max_colocate_count={self.max_colocate_count}, bundle={self.bundle()})"
        )
