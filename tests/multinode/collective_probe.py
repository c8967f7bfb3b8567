"""Run by test_two_hosts.py inside namespace A: a 2-rank gloo group with one rank per host; rank 0
blocks in an all-reduce that rank 1 (on host B) has not joined yet. Prints ``BLOCKING`` once the
call is under way; the test then kills host B. Prints one ``RESULT {json}`` line: the error the
group raised, and how long after the call started.

When B is lost, rank 0's all-reduce fails at once ("Connection closed by peer"), about a second
before Ray reports rank 1's death: the group must still name rank 1 and B's address.
"""

import json
import sys
import threading
import time

import ray

from verl_arpo.single_controller.base import Worker
from verl_arpo.single_controller.decorator import Dispatch, register
from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


class CollectiveWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def setup(self) -> int:
        self.init_process_group(backend="gloo", timeout_seconds=300)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_late(self, rank1_delay: float) -> float:
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            time.sleep(rank1_delay)
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)


def main() -> None:
    ray.init(address=sys.argv[1], log_to_driver=False)
    pool = RayResourcePool([1, 1], cpus_per_bundle=1, name_prefix="collective")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(CollectiveWorker), call_timeout=240)
    result = {"node_infos": [{k: i.get(k) for k in ("rank", "ip", "pid")} for i in wg.node_infos]}
    assert wg.setup() == [0, 1]
    assert wg.all_reduce_late(0.0) == [2.0, 2.0]  # the group works across the hosts

    def announce():
        time.sleep(2.0)
        print("BLOCKING", flush=True)

    threading.Thread(target=announce, daemon=True).start()
    start = time.monotonic()
    try:
        wg.all_reduce_late(120.0)
        result["error"] = None
    except Exception as exc:
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
    result["seconds"] = time.monotonic() - start
    wg.shutdown()
    pool.remove()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
