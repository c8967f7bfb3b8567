"""Two worker groups share one resource pool (an actor group and a critic-like group)."""

from single_controller_workers import ToyWorker

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


def bundle_of(info: dict) -> set[str]:
    """The bundle-qualified CPU resources an actor holds, e.g. {"CPU_group_1_<pg id>"}."""
    return {k for k in info["assigned_resources"] if k.startswith("CPU_group_") and not k.startswith("CPU_group_<")}


def test_two_groups_share_one_pool(ray_session):
    import torch

    pool = RayResourcePool([2], cpus_per_bundle=1, max_colocate_count=2)
    groups = []
    try:
        actor = RayWorkerGroup(pool, RayClassWithInitArgs(ToyWorker, scale=10), name_prefix="actor")
        groups.append(actor)
        critic = RayWorkerGroup(pool, RayClassWithInitArgs(ToyWorker, scale=100), name_prefix="critic")
        groups.append(critic)
        assert actor.num_cpus_per_worker == critic.num_cpus_per_worker == 0.5
        for r in range(2):
            a, c = actor.node_infos[r], critic.node_infos[r]
            assert a["placement_group_id"] == c["placement_group_id"]
            assert bundle_of(a) == bundle_of(c) and len(bundle_of(a)) == 1  # same bundle r
            assert a["pid"] != c["pid"]
        assert bundle_of(actor.node_infos[0]) != bundle_of(actor.node_infos[1])
        # separate process groups (own master ports), each all-reduces on its own
        assert actor.master_port != critic.master_port
        assert actor.setup_dist() == critic.setup_dist() == ["gloo", "gloo"]
        assert actor.all_reduce_sum([[1.0], [2.0]]) == [[3.0], [3.0]]
        assert critic.all_reduce_sum([[5.0], [7.0]]) == [[12.0], [12.0]]
        data = DataProto.from_dict({"x": torch.arange(3)}, {"uid": ["a", "b", "c"]})
        assert actor.scale_plus_rank(data).batch["y"].tolist() == [0, 10, 21]
        assert critic.scale_plus_rank(data).batch["y"].tolist() == [0, 100, 201]
    finally:
        for g in groups:
            g.shutdown()
        pool.remove()
