"""Dispatch planning and collection without Ray: every mode against hand-computed results."""

import numpy as np
import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.single_controller.decorator import Dispatch, get_method_spec, plan_call, register


def make(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]}, meta_info={"t": 1.0})


def rows(d: DataProto) -> list[int]:
    return d.batch["x"].tolist()


def test_register_stores_mode_and_rejects_unknown_modes():
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def f(self, data):
        return data

    spec = get_method_spec(f)
    assert spec.dispatch_mode is Dispatch.DP_COMPUTE_PROTO and spec.blocking is False
    assert get_method_spec(register("rank_zero")(lambda self: 0)).dispatch_mode is Dispatch.RANK_ZERO

    @register
    def g(self):
        return 0

    assert get_method_spec(g).dispatch_mode is Dispatch.ALL_TO_ALL  # verl's default
    with pytest.raises(ValueError, match="unknown dispatch mode 'DP_COMPUTE'.*Dispatch.DP_COMPUTE_PROTO"):
        register(dispatch_mode="DP_COMPUTE")
    with pytest.raises(ValueError, match="unknown dispatch mode 3"):
        plan_call(3, 2)


def test_dp_split_pads_and_unpads():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make(5),))
    assert [rows(a[0]) for a in plan.args] == [[0, 1, 2], [3, 4, 0]]  # row 0 copied as padding
    assert plan.args[1][0].non_tensor_batch["uid"].tolist() == ["u3", "u4", "u0"]
    assert plan.args[0][0].meta_info == {"t": 1.0}
    # each rank answers x + 100 * rank
    outs = [DataProto.from_dict({"x": a[0].batch["x"] + 100 * r}) for r, a in enumerate(plan.args)]
    assert rows(plan.collect(outs)) == [0, 1, 2, 103, 104]


def test_dp_k_outputs_per_row_drop_k_rows_per_pad():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make(5),))
    outs = [a[0].repeat(3, interleave=True) for a in plan.args]
    assert rows(plan.collect(outs)) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]


def test_dp_padding_spanning_several_ranks():
    # 1 row on 3 ranks: ranks 1 and 2 get only padding
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 3, (make(1),))
    assert [rows(a[0]) for a in plan.args] == [[0], [0], [0]]
    outs = [a[0].repeat(2) for a in plan.args]
    assert rows(plan.collect(outs)) == [0, 0]
    # 4 rows on 3 ranks: chunks of 2, ranks hold [0,1] [2,3] [0,1]; rank 2 is all padding
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 3, (make(4),))
    assert [rows(a[0]) for a in plan.args] == [[0, 1], [2, 3], [0, 1]]
    assert rows(plan.collect([a[0] for a in plan.args])) == [0, 1, 2, 3]


def test_dp_no_padding_needed_accepts_any_output_size():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make(4),))
    outs = [make(1), make(3)]  # no padding anywhere: nothing to drop
    assert rows(plan.collect(outs)) == [0, 0, 1, 2]


def test_dp_metrics_only_outputs_merge_metrics():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make(3),))
    outs = [DataProto(meta_info={"metrics": {"loss": float(r)}}) for r in range(2)]
    out = plan.collect(outs)
    assert len(out) == 0 and out.meta_info["metrics"] == {"loss": [0.0, 1.0]}


def test_dp_errors():
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make(5),))
    with pytest.raises(ValueError, match="rank 1 got 3 rows \\(1 of them padding\\) and returned 4 rows"):
        plan.collect([make(3), make(4)])
    with pytest.raises(TypeError, match="mix of DataProto"):
        plan.collect([make(3), None])
    assert plan.collect([None, None]) == [None, None]
    with pytest.raises(ValueError, match="same number of rows"):
        plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (make(4), make(5)))
    with pytest.raises(ValueError, match="at least one DataProto"):
        plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (1,))


def test_dp_kwargs_and_broadcast_arguments():
    data = make(3)
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO, 2, (7,), {"data": data, "other": data, "flag": True})
    assert [a for a in plan.args] == [(7,), (7,)]
    assert [rows(kw["data"]) for kw in plan.kwargs] == [[0, 1], [2, 0]]
    assert all(kw["other"] is kw["data"] and kw["flag"] is True for kw in plan.kwargs)


def test_dp_with_func():
    fn = np.negative
    plan = plan_call(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, 2, (fn, make(3)))
    assert all(a[0] is fn for a in plan.args)
    assert [rows(a[1]) for a in plan.args] == [[0, 1], [2, 0]]
    with pytest.raises(ValueError, match="first positional argument must be a function"):
        plan_call(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, 2, (make(3),))


def test_one_to_all_rank_zero_all_to_all():
    plan = plan_call(Dispatch.ONE_TO_ALL, 3, (1,), {"k": 2})
    assert plan.ranks == [0, 1, 2] and plan.args == [(1,)] * 3 and plan.kwargs == [{"k": 2}] * 3
    assert plan.collect(["a", "b", "c"]) == ["a", "b", "c"]

    plan = plan_call(Dispatch.RANK_ZERO, 3, (1,))
    assert plan.ranks == [0] and plan.collect(["only"]) == "only"

    plan = plan_call(Dispatch.ALL_TO_ALL, 2, ([1, 2], ("a", "b")), {"k": [True, False]})
    assert plan.args == [(1, "a"), (2, "b")] and plan.kwargs == [{"k": True}, {"k": False}]
    with pytest.raises(ValueError, match="argument 0 must be a list with one entry per rank \\(2\\), got list of length 3"):
        plan_call(Dispatch.ALL_TO_ALL, 2, ([1, 2, 3],))
    with pytest.raises(ValueError, match="argument 'k' must be a list"):
        plan_call(Dispatch.ALL_TO_ALL, 2, (), {"k": 5})
