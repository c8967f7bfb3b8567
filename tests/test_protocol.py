"""DataProto: row operations, key operations, merging, persistence and the padding helpers.

Expected values are written out by hand (row ids, lists), not computed with the code under test.
Rows of the fixture are numbered 0..n-1: tensor ``x[i] == [10*i, 10*i + 1]``, ``uid[i] == f"u{i}"``.
"""

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl_arpo.protocol import (
    DataProto,
    DataProtoItem,
    as_object_array,
    collate_fn,
    pad_dataproto_to_divisor,
    unpad_dataproto,
    union_numpy_dict,
    union_tensor_dict,
)


def make(n=6, meta=None):
    x = torch.tensor([[10 * i, 10 * i + 1] for i in range(n)])
    y = torch.tensor([float(i) for i in range(n)])
    uid = [f"u{i}" for i in range(n)]
    extra = [{"row": i, "tools": ["python"] * (i % 2)} for i in range(n)]
    return DataProto.from_dict(
        tensors={"x": x, "y": y}, non_tensors={"uid": uid, "extra": extra}, meta_info=dict(meta or {"temp": 1.0})
    )


def rows(data):
    """Row ids, read from the tensor and cross-checked against the non-tensor column."""
    from_tensor = [int(v) // 10 for v in data.batch["x"][:, 0].tolist()]
    from_uid = [int(u[1:]) for u in data.non_tensor_batch["uid"].tolist()]
    assert from_tensor == from_uid
    assert [int(v) for v in data.batch["y"].tolist()] == from_tensor
    assert [e["row"] for e in data.non_tensor_batch["extra"]] == from_tensor
    return from_tensor


# -- construction and invariants ---------------------------------------------------------------


def test_from_dict_shapes_and_object_arrays():
    data = make(4)
    assert len(data) == 4
    assert data.batch.batch_size == torch.Size([4])
    assert data.non_tensor_batch["uid"].dtype == object
    assert data.non_tensor_batch["uid"].shape == (4,)
    assert data.meta_info == {"temp": 1.0}


def test_equal_length_lists_and_dicts_stay_one_dimensional():
    lists = [[1, 2], [3, 4], [5, 6]]
    dicts = [{"a": 1}, {"a": 2}, {"a": 3}]
    data = DataProto.from_dict(non_tensors={"lists": lists, "dicts": dicts})
    assert data.non_tensor_batch["lists"].shape == (3,)
    assert data.non_tensor_batch["lists"][1] == [3, 4]
    assert data.non_tensor_batch["dicts"][2] == {"a": 3}
    assert len(data) == 3
    # still 1-D after row operations
    cat = DataProto.concat([data, data[[2, 0]]])
    assert cat.non_tensor_batch["lists"].shape == (5,)
    assert cat.non_tensor_batch["lists"].tolist() == [[1, 2], [3, 4], [5, 6], [5, 6], [1, 2]]
    rep = data.repeat(2, interleave=True)
    assert rep.non_tensor_batch["lists"].shape == (6,)
    arr = as_object_array([[0, 0], [1, 1]])
    assert arr.shape == (2,) and arr.dtype == object and arr[0] == [0, 0]


def test_from_single_dict_splits_tensors_from_non_tensors():
    data = DataProto.from_single_dict(
        {"ids": torch.zeros(3, 5), "src": np.array(["a", "b", "c"], dtype=object), "gt": ["1", "2", "3"]},
        meta_info={"k": 1},
    )
    assert list(data.batch.keys()) == ["ids"]
    assert sorted(data.non_tensor_batch) == ["gt", "src"]
    assert data.non_tensor_batch["gt"].tolist() == ["1", "2", "3"]
    assert data.meta_info == {"k": 1}
    with pytest.raises(ValueError, match="'bad'"):
        DataProto.from_single_dict({"ids": torch.zeros(3), "bad": 3})


def test_from_dict_batch_size_mismatch_names_key():
    with pytest.raises(ValueError, match="'b'"):
        DataProto.from_dict(tensors={"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)})


def test_num_batch_dims_two():
    data = DataProto.from_dict(tensors={"a": torch.zeros(2, 3, 4)}, num_batch_dims=2)
    assert data.batch.batch_size == torch.Size([2, 3])
    assert len(data) == 2


def test_consistency_errors_name_the_key():
    batch = TensorDict({"a": torch.zeros(3)}, batch_size=[3])
    with pytest.raises(ValueError, match="'short'"):
        DataProto(batch=batch, non_tensor_batch={"ok": as_object_array([1, 2, 3]), "short": as_object_array([1, 2])})
    with pytest.raises(ValueError, match="'as_list'"):
        DataProto(batch=batch, non_tensor_batch={"as_list": ["a", "b", "c"]})
    two_d = np.empty((3, 2), dtype=object)
    with pytest.raises(ValueError, match="'two_d'"):
        DataProto(batch=batch, non_tensor_batch={"two_d": two_d})
    # without a batch the non-tensor columns must agree among themselves
    with pytest.raises(ValueError, match="'second'"):
        DataProto(non_tensor_batch={"first": as_object_array([1, 2]), "second": as_object_array([1, 2, 3])})
    # an existing object is re-checked after a manual edit
    data = make(3)
    data.non_tensor_batch["late"] = as_object_array([1])
    with pytest.raises(ValueError, match="'late'"):
        data.check_consistency()


def test_numeric_multidim_non_tensor_allowed():
    data = DataProto.from_dict(
        tensors={"a": torch.zeros(3)}, non_tensors={"vec": np.arange(6).reshape(3, 2)}
    )
    assert data.non_tensor_batch["vec"].shape == (3, 2)
    assert data[[2, 0]].non_tensor_batch["vec"].tolist() == [[4, 5], [0, 1]]


def test_empty_dataproto():
    empty = DataProto()
    assert len(empty) == 0
    assert not empty
    part = make(3)
    out = DataProto.concat([empty, part])
    assert rows(out) == [0, 1, 2]
    assert len(DataProto.concat([DataProto(), DataProto()])) == 0
    only_nt = DataProto.from_dict(non_tensors={"a": [1, 2]})
    assert only_nt.batch is None and len(only_nt) == 2
    assert DataProto.concat([only_nt, only_nt]).non_tensor_batch["a"].tolist() == [1, 2, 1, 2]


# -- indexing ----------------------------------------------------------------------------------


def test_getitem_int_returns_item():
    data = make(4)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["x"].tolist() == [20, 21]
    assert item.non_tensor_batch["uid"] == "u2"
    assert item.non_tensor_batch["extra"] == {"row": 2, "tools": []}
    assert item.meta_info == {"temp": 1.0}
    assert data[-1].non_tensor_batch["uid"] == "u3"
    assert data[np.int64(1)].non_tensor_batch["uid"] == "u1"
    with pytest.raises(IndexError):
        data[4]
    assert [it.non_tensor_batch["uid"] for it in data] == ["u0", "u1", "u2", "u3"]


def test_getitem_slice():
    data = make(6)
    assert rows(data[1:4]) == [1, 2, 3]
    assert rows(data[::2]) == [0, 2, 4]
    assert rows(data[4:]) == [4, 5]
    assert data[1:3].meta_info == {"temp": 1.0}


@pytest.mark.parametrize(
    "index",
    [
        [4, 0, 0, 2],
        np.array([4, 0, 0, 2]),
        torch.tensor([4, 0, 0, 2]),
        (4, 0, 0, 2),
    ],
)
def test_getitem_integer_arrays(index):
    assert rows(make(6)[index]) == [4, 0, 0, 2]


@pytest.mark.parametrize(
    "mask",
    [
        np.array([True, False, False, True, True, False]),
        torch.tensor([True, False, False, True, True, False]),
        [True, False, False, True, True, False],
    ],
)
def test_getitem_bool_mask(mask):
    assert rows(make(6)[mask]) == [0, 3, 4]


def test_bool_mask_wrong_length_and_bad_types():
    data = make(6)
    with pytest.raises(IndexError):
        data[np.array([True, False])]
    with pytest.raises(IndexError):
        data[[0, 6]]
    with pytest.raises(TypeError):
        data["x"]


def test_negative_indices_in_array():
    assert rows(make(5)[[-1, 0]]) == [4, 0]


# -- key operations ----------------------------------------------------------------------------


def test_select_keeps_only_named_keys_and_shares_tensors():
    data = make(3, meta={"a": 1, "b": 2})
    sel = data.select(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=["b"])
    assert list(sel.batch.keys()) == ["x"]
    assert list(sel.non_tensor_batch) == ["uid"]
    assert sel.meta_info == {"b": 2}
    # the original keeps everything
    assert sorted(data.batch.keys()) == ["x", "y"]
    assert sorted(data.non_tensor_batch) == ["extra", "uid"]
    # shallow: same tensor storage
    sel.batch["x"][0, 0] = -7
    assert data.batch["x"][0, 0].item() == -7
    with pytest.raises(KeyError, match="'nope'"):
        data.select(batch_keys=["nope"])


def test_select_deepcopy_detaches():
    data = make(3, meta={"m": [1]})
    sel = data.select(deepcopy=True)
    sel.batch["x"][0, 0] = -7
    sel.non_tensor_batch["extra"][0]["row"] = 99
    sel.meta_info["m"].append(2)
    assert data.batch["x"][0, 0].item() == 0
    assert data.non_tensor_batch["extra"][0]["row"] == 0
    assert data.meta_info["m"] == [1]


def test_pop_removes_from_self():
    data = make(3, meta={"a": 1, "b": 2})
    popped = data.pop(batch_keys=["y"], non_tensor_batch_keys=["extra"], meta_info_keys=["a"])
    assert list(popped.batch.keys()) == ["y"]
    assert popped.batch["y"].tolist() == [0.0, 1.0, 2.0]
    assert list(popped.non_tensor_batch) == ["extra"]
    assert popped.meta_info == {"a": 1}
    assert list(data.batch.keys()) == ["x"]
    assert list(data.non_tensor_batch) == ["uid"]
    assert data.meta_info == {"b": 2}
    with pytest.raises(KeyError, match="'y'"):
        data.pop(batch_keys=["y"])


def test_rename():
    data = make(2)
    data.rename(["x", "uid"], ["input_ids", "prompt_uid"])
    assert sorted(data.batch.keys()) == ["input_ids", "y"]
    assert data.batch["input_ids"].tolist() == [[0, 1], [10, 11]]
    assert data.non_tensor_batch["prompt_uid"].tolist() == ["u0", "u1"]
    data.rename("y", "z")
    assert sorted(data.batch.keys()) == ["input_ids", "z"]
    with pytest.raises(KeyError):
        data.rename("missing", "other")


def test_union_adds_keys_and_accepts_equal_conflicts():
    a = make(3, meta={"temp": 1.0})
    b = DataProto.from_dict(
        tensors={"x": torch.tensor([[0, 1], [10, 11], [20, 21]]), "z": torch.tensor([7, 8, 9])},
        non_tensors={"uid": ["u0", "u1", "u2"], "score": [0.5, 1.0, 0.0]},
        meta_info={"temp": 1.0, "step": 3},
    )
    out = a.union(b)
    assert out is a
    assert sorted(a.batch.keys()) == ["x", "y", "z"]
    assert a.batch["z"].tolist() == [7, 8, 9]
    assert a.non_tensor_batch["score"].tolist() == [0.5, 1.0, 0.0]
    assert a.meta_info == {"temp": 1.0, "step": 3}


@pytest.mark.parametrize(
    "other_kwargs, key",
    [
        ({"tensors": {"x": torch.tensor([[0, 1], [10, 11], [20, 99]])}}, "'x'"),
        ({"non_tensors": {"uid": ["u0", "uX", "u2"]}}, "'uid'"),
        ({"non_tensors": {"extra": [{"row": 0, "tools": []}, {"row": 1, "tools": ["python"]}, {"row": 2, "tools": ["x"]}]}}, "'extra'"),
        ({"non_tensors": {"uid": ["u0", "u1", "u2"]}, "meta_info": {"temp": 0.7}}, "'temp'"),
    ],
)
def test_union_conflicts_raise_and_leave_self_untouched(other_kwargs, key):
    a = make(3)
    other = DataProto.from_dict(**other_kwargs)
    other.non_tensor_batch["new_key"] = as_object_array([1, 2, 3])
    with pytest.raises(ValueError, match=key):
        a.union(other)
    assert "new_key" not in a.non_tensor_batch
    assert a.meta_info == {"temp": 1.0}


def test_union_row_count_mismatch():
    with pytest.raises(ValueError):
        make(3).union(make(4))


def test_union_helpers():
    t1 = TensorDict({"a": torch.tensor([1.0, float("nan")])}, batch_size=[2])
    t2 = TensorDict({"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([3, 4])}, batch_size=[2])
    out = union_tensor_dict(t1, t2)
    assert out is t1 and out["b"].tolist() == [3, 4]
    with pytest.raises(ValueError, match="'a'"):
        union_tensor_dict(t1, TensorDict({"a": torch.tensor([1.0, 2.0])}, batch_size=[2]))
    with pytest.raises(ValueError):
        union_tensor_dict(t1, TensorDict({}, batch_size=[3]))
    d1 = {"k": as_object_array([[1], [2]])}
    union_numpy_dict(d1, {"k": as_object_array([[1], [2]]), "j": as_object_array(["p", "q"])})
    assert sorted(d1) == ["j", "k"]
    with pytest.raises(ValueError, match="'k'"):
        union_numpy_dict(d1, {"k": as_object_array([[1], [3]])})


# -- splitting and joining ---------------------------------------------------------------------


def test_chunk_then_concat_round_trip():
    data = make(6)
    parts = data.chunk(3)
    assert [rows(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    back = DataProto.concat(parts)
    assert torch.equal(back.batch["x"], data.batch["x"])
    assert torch.equal(back.batch["y"], data.batch["y"])
    assert back.non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()
    assert back.non_tensor_batch["extra"].tolist() == data.non_tensor_batch["extra"].tolist()
    assert back.meta_info == {"temp": 1.0}


def test_chunk_must_divide():
    with pytest.raises(ValueError):
        make(5).chunk(2)


def test_split():
    parts = make(7).split(3)
    assert [rows(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [rows(p) for p in make(4).split(2)] == [[0, 1], [2, 3]]


def test_concat_merges_metrics_into_lists():
    a, b, c = make(2), make(2), make(2)
    a.meta_info = {"temp": 1.0, "metrics": {"actor/pg_loss": 0.5, "actor/lr": [1e-6, 2e-6]}}
    b.meta_info = {"temp": 0.3, "metrics": {"actor/pg_loss": 0.25}}
    c.meta_info = {"other": "c"}
    out = DataProto.concat([a, b, c])
    assert out.meta_info["metrics"] == {"actor/pg_loss": [0.5, 0.25], "actor/lr": [1e-6, 2e-6]}
    assert out.meta_info["temp"] == 1.0  # from the first part
    assert out.meta_info["other"] == "c"  # only the last part had it
    assert len(out) == 6


def test_concat_key_mismatch_is_an_error():
    a, b = make(2), make(2)
    b.pop(non_tensor_batch_keys=["extra"])
    with pytest.raises(ValueError, match="extra"):
        DataProto.concat([a, b])


def test_repeat_interleave_and_tile():
    data = make(3)
    assert rows(data.repeat(2, interleave=True)) == [0, 0, 1, 1, 2, 2]
    assert rows(data.repeat(3, interleave=False)) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert data.repeat(2).meta_info == {"temp": 1.0}


def test_reorder_in_place():
    data = make(4)
    assert data.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert rows(data) == [3, 1, 0, 2]
    data.reorder(np.array([1, 0, 2, 3]))
    assert rows(data) == [1, 3, 0, 2]


def test_pad_and_unpad_to_divisor():
    data = make(5)
    padded, pad = pad_dataproto_to_divisor(data, 4)
    assert pad == 3
    assert rows(padded) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert rows(unpad_dataproto(padded, pad)) == [0, 1, 2, 3, 4]
    # more padding than rows cycles through the rows from the start
    small, pad = pad_dataproto_to_divisor(make(2), 7)
    assert pad == 5
    assert rows(small) == [0, 1, 0, 1, 0, 1, 0]
    same, pad = pad_dataproto_to_divisor(make(4), 2)
    assert pad == 0 and rows(same) == [0, 1, 2, 3]
    assert rows(unpad_dataproto(same, 0)) == [0, 1, 2, 3]


def test_collate_fn_restacks_items():
    data = make(3)
    out = collate_fn([data[2], data[0]])
    assert rows(out) == [2, 0]
    assert out.non_tensor_batch["extra"].shape == (2,)
    assert out.meta_info == {"temp": 1.0}


# -- devices, persistence ----------------------------------------------------------------------


def test_to_device_returns_self():
    data = make(2)
    assert data.to("cpu") is data
    assert data.batch["x"].device.type == "cpu"


def _assert_same(a, b):
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key])
    assert sorted(a.non_tensor_batch) == sorted(b.non_tensor_batch)
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].tolist() == b.non_tensor_batch[key].tolist()
        assert b.non_tensor_batch[key].dtype == a.non_tensor_batch[key].dtype
    assert a.meta_info == b.meta_info


def test_pickle_round_trip():
    data = make(4, meta={"temp": 0.6, "metrics": {"a": [1.0]}})
    back = pickle.loads(pickle.dumps(data))
    _assert_same(data, back)
    assert rows(back) == [0, 1, 2, 3]


def test_pickled_chunk_does_not_carry_parent_storage():
    big = DataProto.from_dict(tensors={"a": torch.zeros(1000, 256)})
    one = big.chunk(1000)[3]
    assert len(pickle.dumps(one)) < 1000 * 256 * 4 // 10
    assert pickle.loads(pickle.dumps(one)).batch["a"].shape == (1, 256)
