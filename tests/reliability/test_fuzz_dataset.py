"""Fuzzing RLHFDataset with generated parquet files: missing / extra / wrongly typed fields, empty
prompts, bytes that are not UTF-8 (in binary *and* string columns), huge rows, several files.

Every row is generated from a label that says whether it is good and, if not, which field is bad;
the property is that exactly the good rows are kept, every bad row is skipped and counted with its
file, row number and field, and a set with no good row raises ValueError naming the file(s).
Extends tests/data/test_rl_dataset.py (hand-written malformed rows).
"""
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from rel_helpers import fuzz

from verl_arpo.utils.dataset import RLHFDataset, collate_fn
from verl_arpo.config import DataConfig

MESSAGE = pa.struct([("content", pa.string()), ("role", pa.string())])
HUGE = "word " * 40_000  # 200k characters, ~40k tokens: truncated (left) to max_prompt_length
MAX_LEN = 48


def _bad_utf8_strings(values: list) -> pa.Array:
    """A *string* column whose cells are raw bytes (bytes cells may be invalid UTF-8; None = null)."""
    data, offsets, valid = b"", [0], []
    for v in values:
        valid.append(v is not None)
        data += v or b""
        offsets.append(len(data))
    validity = pa.array(valid, pa.bool_()).buffers()[1] if not all(valid) else None
    return pa.Array.from_buffers(pa.string(), len(values), [validity, pa.array(offsets, pa.int32()).buffers()[1],
                                                             pa.py_buffer(data)], null_count=valid.count(False))


# prompt column kinds -> {row label: (value, bad field or None)}
PROMPTS = {
    "str": {"ok": ("What is 6 * 7?", None), "huge": (HUGE, None), "none": (None, "prompt"), "empty": ("", "prompt"),
            "blank": ("  \n\t", "prompt"), "backspace": ("Put it in \x08oxed{}", None)},
    "binary": {"ok": ("Café?".encode(), None), "bad": (b"\xff\xfe broken", "prompt"), "none": (None, "prompt"),
               "empty": (b"", "prompt")},
    "raw_string": {"ok": ("Café?".encode(), None), "bad": (b"ok \xc3\x28", "prompt"), "none": (None, "prompt")},
    "messages": {"ok": ([{"content": "Hi?", "role": "user"}], None),
                 "system": ([{"content": "sys", "role": "system"}, {"content": "Hi?", "role": "user"}], None),
                 "empty_list": ([], "prompt"), "none": (None, "prompt"),
                 "content_none": ([{"content": None, "role": "user"}], "prompt[0].content"),
                 "role_none": ([{"content": "Hi?", "role": None}], "prompt[0].role"),
                 "all_blank": ([{"content": " ", "role": "user"}], "prompt")},
    "int": {"int": (7, "prompt"), "none": (None, "prompt")},
    "absent": {"absent": (None, "prompt")},
}
GROUND_TRUTHS = {
    "answer": {"ok": ("42", None), "none": (None, "reward_model.ground_truth"),
               "empty": ("", "reward_model.ground_truth")},
    "answer_list": {"ok": (["Paris", "City of Light"], None), "empty": ([], "reward_model.ground_truth"),
                    "none": (None, "reward_model.ground_truth")},
    "answer_int": {"ok": (42, None), "none": (None, "reward_model.ground_truth")},
    "reward_model": {"ok": ({"ground_truth": "42", "style": "rule"}, None),
                     "gt_none": ({"ground_truth": None, "style": "rule"}, "reward_model.ground_truth"),
                     "none": (None, "reward_model.ground_truth")},
    "absent": {"absent": (None, "reward_model.ground_truth")},
}
SOURCES = {
    "str": {"ok": ("hotpotqa", None), "none": (None, "data_source"), "empty": ("", "data_source"),
            "blank": ("   ", "data_source")},
    "int": {"int": (3, "data_source"), "none": (None, "data_source")},
    "binary": {"ok": (b"nq", None), "bad": (b"\xff", "data_source")},
    "absent": {"absent": (None, "data_source")},
}


@st.composite
def parquet_file(draw, path):
    n = draw(st.integers(1, 8))
    # mostly column kinds that can hold good rows, and mostly good cells: files with some good rows
    p_kind = draw(st.sampled_from(sorted(PROMPTS) + ["str", "messages", "binary"]))
    g_kind = draw(st.sampled_from(sorted(GROUND_TRUTHS) + ["answer", "reward_model", "answer_list"]))
    s_kind = draw(st.sampled_from(sorted(SOURCES) + ["str", "str"]))

    def label(table):
        labels = sorted(table)
        return draw(st.sampled_from(labels + ["ok"] * 3 * len(labels) if "ok" in table else labels))

    rows = [(label(PROMPTS[p_kind]), label(GROUND_TRUTHS[g_kind]), label(SOURCES[s_kind])) for _ in range(n)]
    columns = {}
    if p_kind != "absent":
        values = [PROMPTS[p_kind][p][0] for p, _, _ in rows]
        columns["prompt"] = {"str": lambda: pa.array(values, pa.string()),
                             "binary": lambda: pa.array(values, pa.binary()),
                             "raw_string": lambda: _bad_utf8_strings(values),
                             "messages": lambda: pa.array(values, pa.list_(MESSAGE)),
                             "int": lambda: pa.array(values, pa.int64())}[p_kind]()
    if g_kind != "absent":
        name = "reward_model" if g_kind == "reward_model" else "answer"
        columns[name] = [GROUND_TRUTHS[g_kind][g][0] for _, g, _ in rows]
    if s_kind != "absent":
        values = [SOURCES[s_kind][s][0] for _, _, s in rows]
        columns["data_source"] = pa.array(values, pa.binary()) if s_kind == "binary" else values
    # extra columns of any type, and an extra_info that is a struct, a string or absent
    for j, kind in enumerate(draw(st.lists(st.sampled_from(["int", "float", "str", "list", "bad_str"]), max_size=3))):
        columns[f"extra_{j}"] = {"int": [1] * n, "float": [float("nan")] * n, "str": ["x"] * n, "list": [[1, 2]] * n,
                                 "bad_str": _bad_utf8_strings([b"\xff" if k == 0 else b"fine" for k in range(n)])}[kind]
    info = draw(st.sampled_from(["struct", "str", "absent"]))
    if info != "absent":
        columns["extra_info"] = [{"index": k, "split": "train"} for k in range(n)] if info == "struct" else ["note"] * n
    if not columns:
        columns["unrelated"] = [0] * n
    pq.write_table(pa.table(columns), path)
    bad_extra = any(isinstance(c, pa.Array) and c.type == pa.string() and k.startswith("extra_")
                    for k, c in columns.items())
    expected = []  # per row: None (kept) or the bad field
    for k, (p, g, s) in enumerate(rows):
        field = PROMPTS[p_kind][p][1] or GROUND_TRUTHS[g_kind][g][1] or SOURCES[s_kind][s][1]
        # an undecodable cell skips its row, named after the first such column (prompt comes first)
        if p_kind == "raw_string" and p == "bad":
            field = "prompt"
        elif bad_extra and k == 0:
            field = "extra_"
        expected.append(field)
    event(f"prompt column: {p_kind}")
    return expected


@fuzz(60)
@given(data=st.data(), n_files=st.integers(1, 3))
def test_bad_rows_are_skipped_counted_and_named(rel_tok, tmp_path_factory, data, n_files):
    d = tmp_path_factory.mktemp("ds")
    paths = [str(d / f"part{i}.parquet") for i in range(n_files)]
    expected = {p: data.draw(parquet_file(p), label=p) for p in paths}
    good = sum(f is None for exp in expected.values() for f in exp)
    total = sum(len(exp) for exp in expected.values())
    logs = _capture_warnings()
    try:
        ds = RLHFDataset(paths, rel_tok, DataConfig(max_prompt_length=MAX_LEN, truncation="left"))
    except ValueError as exc:
        event("no good row: ValueError")
        assert good == 0, exc
        assert all(p in str(exc) for p in paths) and f"{total} read" in str(exc)
        return
    finally:
        logging.getLogger("verl_arpo.utils.dataset.rl_dataset").removeHandler(logs)
    assert good > 0
    event("kept all rows" if good == total else "kept some rows")
    assert ds.stats["rows_read"] == total and ds.stats["rows_skipped"] == total - good == len(ds.skipped)
    assert len(ds) == good
    got = {(path, row): field for path, row, field, _ in ds.skipped}
    want = {(path, row): field for path, exp in expected.items() for row, field in enumerate(exp) if field is not None}
    assert got.keys() == want.keys()
    for key, field in want.items():
        assert got[key].startswith(field), (key, got[key], field)
        if key[1] < 20:  # the first 20 per file are logged with file, row and field
            assert f"{key[0]} row {key[1]}: field {got[key]!r}" in logs.text
    items = [ds[i] for i in range(len(ds))]
    for item in items:
        L = int(item["attention_mask"].sum())
        assert item["input_ids"].shape == (MAX_LEN,) and L == len(item["raw_prompt_ids"]) <= MAX_LEN
        assert "\x08" not in item["raw_prompt"][-1]["content"]
    batch = collate_fn(items)
    assert batch["input_ids"].shape == (good, MAX_LEN) and batch["input_ids"].dtype == torch.long


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @property
    def text(self):
        return "\n".join(self.lines)


def _capture_warnings():
    handler = _Capture()
    logger = logging.getLogger("verl_arpo.utils.dataset.rl_dataset")
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    return handler


@pytest.mark.parametrize("content", [b"", b"PAR1", b"PAR1" + b"\x00" * 100 + b"PAR1", b"not a parquet file at all"])
def test_corrupt_files_raise_value_error_naming_the_file(rel_tok, tmp_path, content):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="corrupt.parquet"):
        RLHFDataset(str(path), rel_tok, DataConfig(max_prompt_length=MAX_LEN))


def test_truncated_file_raises_naming_the_file(rel_tok, tmp_path):
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"prompt": ["q"] * 100, "answer": ["a"] * 100, "data_source": ["nq"] * 100}), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy interrupted half way
    with pytest.raises(ValueError, match="cut.parquet"):
        RLHFDataset(str(path), rel_tok, DataConfig(max_prompt_length=MAX_LEN))


def test_invalid_utf8_in_a_string_column_skips_only_that_row(rel_tok, tmp_path):
    path = str(tmp_path / "mixed.parquet")
    prompt = _bad_utf8_strings([b"good one?", b"bad \xff\xfe", "Caf\u00e9?".encode(), None])
    pq.write_table(pa.table({"prompt": prompt, "answer": ["a", "b", "c", "d"], "data_source": ["nq"] * 4}), path)
    ds = RLHFDataset(path, rel_tok, DataConfig(max_prompt_length=MAX_LEN))
    assert [ds[i]["raw_prompt"][0]["content"] for i in range(len(ds))] == ["good one?", "Caf\u00e9?"]
    assert [(r, f) for _, r, f, _ in ds.skipped] == [(1, "prompt"), (3, "prompt")]
    assert "UTF-8" in ds.skipped[0][3]
