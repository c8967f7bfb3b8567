"""Run by test_multinode.py in its own process: a 2-node Ray cluster on this machine (two raylets
with 2 logical CPUs each, via ``ray.cluster_utils.Cluster``), then prints one JSON line.

Checks that ``process_on_nodes=[1, 1]`` puts one rank on each node (rank 0 on the driver's node)
and that the two ranks still form a gloo group, and that ``[2]`` keeps both ranks on one node.
"""

import json
import os
import sys

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import single_controller_workers  # noqa: E402
from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402


def main() -> None:
    node_args = {"num_cpus": 2, "object_store_memory": 100 * 1024**2}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(single_controller_workers)
        driver_node = ray.get_runtime_context().get_node_id()
        result = {"nodes": len([n for n in ray.nodes() if n["Alive"]]), "driver_node": driver_node}

        spread = RayResourcePool([1, 1], cpus_per_bundle=1, name_prefix="spread")
        wg = RayWorkerGroup(spread, RayClassWithInitArgs(single_controller_workers.DistWorker), call_timeout=120)
        result["spread_nodes"] = [i["node_id"] for i in wg.node_infos]
        result["spread_local"] = [(i["local_rank"], i["local_world_size"]) for i in wg.node_infos]
        wg.setup_dist()
        result["spread_all_reduce"] = wg.all_reduce_sum([[1.0], [2.0]])
        wg.shutdown()
        spread.remove()

        packed = RayResourcePool([2], cpus_per_bundle=0.5, name_prefix="packed")
        wg = RayWorkerGroup(packed, RayClassWithInitArgs(single_controller_workers.DistWorker), call_timeout=120)
        result["packed_nodes"] = [i["node_id"] for i in wg.node_infos]
        wg.shutdown()
        packed.remove()
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
