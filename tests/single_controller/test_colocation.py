"""Two worker groups share one resource pool (an actor-like group and a critic-like group)."""

import time

import torch
from single_controller_workers import DistWorker

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup


def wait_for(condition, seconds: float = 5.0) -> bool:
    """Ray's resource view is updated asynchronously: poll briefly."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_two_groups_share_one_pool(ray_session, shared_pool, toy_group):
    actor = toy_group  # already on shared_pool (max_colocate_count=2)
    cpu_free = ray_session.available_resources().get("CPU", 0.0)
    critic = RayWorkerGroup(shared_pool, RayClassWithInitArgs(DistWorker), name_prefix="critic", call_timeout=120)
    try:
        assert actor.num_cpus_per_worker == critic.num_cpus_per_worker == 0.5
        infos = actor.node_infos + critic.node_infos
        pg_ids = {info["placement_group_id"] for info in infos}
        assert len(pg_ids) == 1 and len({info["pid"] for info in infos}) == 4
        assert [i["local_rank"] for i in critic.node_infos] == [0, 1]
        # Both bundles (1 CPU each) are now fully used by 2 x 0.5 CPU, and the critic took nothing
        # from outside the pool.
        pg = pg_ids.pop()

        def shared() -> bool:
            free = ray_session.available_resources()
            full = free.get(f"CPU_group_0_{pg}", 0.0) == free.get(f"CPU_group_1_{pg}", 0.0) == 0.0
            return full and free.get("CPU", 0.0) == cpu_free

        assert wait_for(shared), ray_session.available_resources()
        # separate process groups (own master ports), each all-reduces on its own
        assert actor.master_port != critic.master_port
        assert actor.setup_dist() == critic.setup_dist() == ["gloo", "gloo"]
        assert critic.all_reduce_sum([[5.0], [7.0]]) == [[12.0], [12.0]]
        assert actor.all_reduce_sum([[1.0], [2.0]]) == [[3.0], [3.0]]
        data = DataProto.from_dict({"x": torch.arange(3)}, {"uid": ["a", "b", "c"]})
        assert actor.scale_plus_rank(data).batch["y"].tolist() == [0, 10, 21]
    finally:
        critic.shutdown()
