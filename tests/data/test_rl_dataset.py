"""RLHFDataset: both schemas, repairs, malformed rows, overlong filtering, truncation, collate."""
import logging
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.utils.dataset import RLHFDataset, collate_fn
from verl_arpo.config import DataConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = FIXTURES / "reference_format.parquet"
sys.path.insert(0, str(FIXTURES))
import make_reference_fixture as ref  # noqa: E402

QUESTION = "What is the capital of France?"


@pytest.fixture
def tok(tiny_tokenizer):
    return tiny_tokenizer


def write(path, columns, schema=None):
    pq.write_table(pa.table(columns, schema=schema), path)
    return str(path)


def full_ids(tok, messages):
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def flat_file(tmp_path, name="flat.parquet", n=3):
    return write(tmp_path / name, {
        "prompt": [QUESTION, "What is 6 * 7?", "Who wrote Moby-Dick?"][:n],
        "answer": ["Paris", "42", "Herman Melville"][:n],
        "data_source": ["bamboogle", "math", "hotpotqa"][:n],
        "tools": [["search"], ["python"], ["search", "python"]][:n],
    })


def test_fixture_generator_reproduces_the_committed_file():
    assert ref.build_table().to_pylist() == pq.read_table(REFERENCE).to_pylist()
    assert ref.SYSTEM_PROMPT.count("\x08oxed") == ref.SYSTEM_PROMPT_DEFECTS == 3


def test_reference_schema_and_backspace_repair(tok):
    ds = RLHFDataset(str(REFERENCE), tok, DataConfig(max_prompt_length=1024))
    n = len(ref.ROWS)
    assert len(ds) == n
    assert ds.stats == {"rows_read": n, "rows_skipped": 0, "overlong_dropped": 0,
                        "backspace_repairs": n * 3, "rows": n}
    for i, (source, ability, question, answer) in enumerate(ref.ROWS):
        item = ds[i]
        system, user = item["raw_prompt"]
        assert system["role"] == "system" and "\x08" not in system["content"]
        assert system["content"].count("\\boxed{") == 3
        assert user == {"role": "user", "content": question}
        assert item["data_source"] == source and item["ability"] == ability
        assert item["reward_model"] == {"ground_truth": answer, "style": "rule"}
        assert item["ground_truth"] == answer
        assert item["extra_info"]["index"] == i and item["index"] == i
        text = tok.decode(item["raw_prompt_ids"])
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert "\\boxed{answer here}" in text


def test_left_padding_masks_and_positions(tok):
    path = REFERENCE
    ds = RLHFDataset(str(path), tok, DataConfig(max_prompt_length=1024))
    item = ds[0]
    ids = full_ids(tok, item["raw_prompt"])
    n = len(ids)
    assert item["input_ids"].shape == (1024,)
    assert item["input_ids"][-n:].tolist() == ids
    assert set(item["input_ids"][:-n].tolist()) == {tok.pad_token_id}
    assert item["attention_mask"].tolist() == [0] * (1024 - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (1024 - n) + list(range(n))


def test_flat_schema_is_normalised(tok, tmp_path):
    ds = RLHFDataset(flat_file(tmp_path), tok, DataConfig(max_prompt_length=64))
    item = ds[0]
    assert item["raw_prompt"] == [{"role": "user", "content": QUESTION}]
    assert item["reward_model"] == {"ground_truth": "Paris", "style": "rule"}
    assert item["data_source"] == "bamboogle"
    assert item["extra_info"]["tools"] == ["search"]
    assert ds[2]["extra_info"]["tools"] == ["search", "python"]
    assert [ds[i]["index"] for i in range(3)] == [0, 1, 2]


def test_column_gives_every_kept_row_and_names_a_missing_one(tok, tmp_path):
    ds = RLHFDataset(flat_file(tmp_path), tok, DataConfig(max_prompt_length=64))
    assert ds.column("data_source") == [ds[i]["data_source"] for i in range(len(ds))]
    with pytest.raises(ValueError, match=r"data.stratify_by='source'.*3 rows.*data_source"):
        ds.column("source", "data.stratify_by")


def test_system_prompt_override_and_its_repair(tok, tmp_path):
    cfg = DataConfig(max_prompt_length=128, system_prompt_override="Answer in \x08oxed{}.")
    ds = RLHFDataset(flat_file(tmp_path), tok, cfg)
    assert ds[0]["raw_prompt"][0] == {"role": "system", "content": "Answer in \\boxed{}."}
    assert ds.stats["backspace_repairs"] == 3  # one per row
    ds = RLHFDataset(str(REFERENCE), tok, DataConfig(max_prompt_length=1024, system_prompt_override="S"))
    assert ds[0]["raw_prompt"][0] == {"role": "system", "content": "S"}
    assert len(ds[0]["raw_prompt"]) == 2 and ds.stats["backspace_repairs"] == 0


def test_multi_file_list(tok, tmp_path):
    files = [str(REFERENCE), flat_file(tmp_path)]
    ds = RLHFDataset(files, tok, DataConfig(max_prompt_length=1024))
    assert len(ds) == len(ref.ROWS) + 3
    assert ds.stats["rows_read"] == len(ref.ROWS) + 3
    assert ds[len(ref.ROWS)]["raw_prompt"] == [{"role": "user", "content": QUESTION}]
    # index: extra_info.index when present, else the position in the dataset
    assert ds[len(ref.ROWS)]["index"] == len(ref.ROWS)
    assert ds[len(ref.ROWS) - 1]["data_source"] == ref.ROWS[-1][0]


def test_list_ground_truths(tok, tmp_path):
    path = write(tmp_path / "lists.parquet", {
        "prompt": [QUESTION], "answer": [["Paris", "City of Light"]], "data_source": ["hotpotqa"]})
    item = RLHFDataset(path, tok, DataConfig(max_prompt_length=64))[0]
    assert item["ground_truth"] == ["Paris", "City of Light"]


def test_malformed_rows_are_skipped_counted_and_named(tok, tmp_path, caplog):
    path = write(tmp_path / "bad.parquet", {
        "prompt": [QUESTION, None, "", "   ", "Fine question?", "Another?", "Third?"],
        "answer": ["Paris", "x", "x", "x", None, "1", "2"],
        "data_source": ["nq", "nq", "nq", "nq", "nq", None, "nq"],
    })
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=64))
    assert len(ds) == 2
    assert ds.stats["rows_read"] == 7 and ds.stats["rows_skipped"] == 5
    fields = {(row, field) for _, row, field, _ in ds.skipped}
    assert fields == {(1, "prompt"), (2, "prompt"), (3, "prompt"),
                      (4, "reward_model.ground_truth"), (5, "data_source")}
    assert f"{path} row 1: field 'prompt' missing" in caplog.text
    assert f"{path} row 5: field 'data_source'" in caplog.text


def test_malformed_messages_and_non_utf8(tok, tmp_path, caplog):
    message = pa.struct([("content", pa.string()), ("role", pa.string())])
    msgs = pa.array([
        [{"content": QUESTION, "role": "user"}],
        [{"content": None, "role": "user"}],
        [],
        [{"content": "", "role": "system"}, {"content": " ", "role": "user"}],
    ], type=pa.list_(message))
    path = write(tmp_path / "msgs.parquet", {
        "prompt": msgs, "data_source": ["nq"] * 4,
        "reward_model": [{"ground_truth": "Paris", "style": "rule"}] * 4})
    ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=64))
    assert len(ds) == 1
    assert [(r, f) for _, r, f, _ in ds.skipped] == [(1, "prompt[0].content"), (2, "prompt"), (3, "prompt")]

    binary = pa.array([QUESTION.encode(), b"\xff\xfe broken", "Caf\u00e9?".encode()], type=pa.binary())
    path = write(tmp_path / "binary.parquet", {
        "prompt": binary, "answer": ["Paris", "x", "y"], "data_source": ["nq"] * 3})
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=64))
    assert len(ds) == 2 and ds[1]["raw_prompt"][0]["content"] == "Caf\u00e9?"
    assert ds.skipped[0][1:3] == (1, "prompt") and "UTF-8" in ds.skipped[0][3]
    assert f"{path} row 1" in caplog.text


def test_wrong_prompt_type_and_zero_rows_raise_naming_the_file(tok, tmp_path):
    path = write(tmp_path / "ints.parquet", {"prompt": [1, 2], "answer": ["a", "b"], "data_source": ["nq"] * 2})
    with pytest.raises(ValueError, match="ints.parquet") as err:
        RLHFDataset(path, tok, DataConfig(max_prompt_length=64))
    assert "2 malformed" in str(err.value)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLHFDataset(str(tmp_path / "missing.parquet"), tok, DataConfig())
    with pytest.raises(ValueError, match="truncation"):
        RLHFDataset(flat_file(tmp_path), tok, DataConfig(truncation="middle"))


def _mixed_length_file(tmp_path):
    # short prompts (a few dozen tokens with the template) and very long ones (thousands of chars)
    prompts = ["Hi?", "word " * 400, "What is 6 * 7?", "number " * 300, "Ok?"]
    return write(tmp_path / "mixed.parquet", {
        "prompt": prompts, "answer": ["a"] * 5, "data_source": ["nq"] * 5})


def test_filter_overlong_prompts(tok, tmp_path, caplog):
    path = _mixed_length_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=64, filter_overlong_prompts=True))
    assert len(ds) == 3 and ds.stats["overlong_dropped"] == 2 and ds.stats["rows"] == 3
    assert [ds[i]["raw_prompt"][0]["content"] for i in range(3)] == ["Hi?", "What is 6 * 7?", "Ok?"]
    assert "dropped 2 of 5" in caplog.text and "max_prompt_length=64" in caplog.text
    with pytest.raises(ValueError, match="longer than max_prompt_length=4"):
        RLHFDataset(path, tok, DataConfig(max_prompt_length=4, filter_overlong_prompts=True))


def test_truncation_modes(tok, tmp_path):
    path = _mixed_length_file(tmp_path)
    long_messages = [{"role": "user", "content": "word " * 400}]
    ids = full_ids(tok, long_messages)
    assert len(ids) > 64
    ds = RLHFDataset(path, tok, DataConfig(max_prompt_length=64, truncation="error", filter_overlong_prompts=False))
    assert len(ds) == 5  # no filtering: the error comes when the item is built
    with pytest.raises(ValueError, match=r"mixed.parquet row 1 has \d+ tokens > max_prompt_length=64"):
        ds[1]
    keep = dict(max_prompt_length=64, filter_overlong_prompts=False)   # the YAML's default filters them out
    left = RLHFDataset(path, tok, DataConfig(truncation="left", **keep))[1]
    right = RLHFDataset(path, tok, DataConfig(truncation="right", **keep))[1]
    assert left["input_ids"].tolist() == ids[-64:] and left["attention_mask"].sum() == 64
    assert right["input_ids"].tolist() == ids[:64]
    assert tok.decode(left["input_ids"]).endswith("<|im_start|>assistant\n")
    assert tok.decode(right["input_ids"]).startswith("<|im_start|>user\n")
    assert left["position_ids"].tolist() == list(range(64))


def test_collate_fn_feeds_dataproto(tok, tmp_path):
    ds = RLHFDataset([str(REFERENCE), flat_file(tmp_path)], tok, DataConfig(max_prompt_length=512))
    batch = collate_fn([ds[i] for i in (0, 3, 7)])
    assert batch["input_ids"].shape == (3, 512) and batch["input_ids"].dtype == torch.long
    for key in ("raw_prompt", "raw_prompt_ids", "reward_model", "ground_truth", "data_source",
                "index", "extra_info"):
        assert batch[key].dtype == object and batch[key].shape == (3,), key
    data = DataProto.from_single_dict(batch)
    assert len(data) == 3
    assert list(data.non_tensor_batch["data_source"]) == ["aime24", "hotpotqa", "math"]
    assert data.non_tensor_batch["reward_model"][2] == {"ground_truth": "42", "style": "rule"}
    assert isinstance(data.non_tensor_batch["raw_prompt"][1], list)
    assert np.array_equal(data.batch["attention_mask"].sum(-1).numpy(),
                          [len(ds[i]["raw_prompt_ids"]) for i in (0, 3, 7)])


def test_works_with_a_torch_dataloader(tok, tmp_path):
    loader = torch.utils.data.DataLoader(RLHFDataset(flat_file(tmp_path), tok, DataConfig(max_prompt_length=32)),
                                         batch_size=2, collate_fn=collate_fn)
    sizes = [len(batch["data_source"]) for batch in loader]
    assert sizes == [2, 1]
