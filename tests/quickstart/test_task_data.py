"""The bundled task (rl_datasets/): schema, counts, entity-disjoint splits, rewards of the scripted
solutions, and byte-for-byte regeneration (slow)."""
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from verl_arpo.trainer.sft_data import SYSTEM_PROMPT, read_records
from verl_arpo.utils.reward_score import default_compute_score

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "rl_datasets"
COUNTS = {"train": 200, "valid": 20, "test": 200}


def _rows(split):
    return pq.read_table(DATA / f"{split}.parquet").to_pylist()


def test_splits_schema_and_counts():
    for split, per_kind in COUNTS.items():
        rows = _rows(split)
        assert Counter(r["extra_info"]["kind"] for r in rows) == {"math": per_kind, "search": per_kind, "multi": per_kind}
        for i, r in enumerate(rows):
            assert r["data_source"] == f"arpo_toy_{r['extra_info']['kind']}"
            assert [m["role"] for m in r["prompt"]] == ["system", "user"] and r["prompt"][0]["content"] == SYSTEM_PROMPT
            assert r["reward_model"]["style"] == "rule" and r["reward_model"]["ground_truth"]
            assert r["extra_info"]["split"] == split and r["extra_info"]["index"] == i


def test_splits_do_not_share_entities_or_questions():
    ents = {s: {r["extra_info"]["entity"] for r in _rows(s) if r["extra_info"]["entity"]} for s in COUNTS}
    qs = {s: {r["extra_info"]["question"] for r in _rows(s)} for s in COUNTS}
    for a, b in [("train", "valid"), ("train", "test"), ("valid", "test")]:
        assert not ents[a] & ents[b] and not qs[a] & qs[b]


def test_rl_dataset_loads_bundled_parquet(tiny_tokenizer):
    from verl_arpo.config import DataConfig
    from verl_arpo.utils.dataset.rl_dataset import RLHFDataset

    ds = RLHFDataset(str(DATA / "valid.parquet"), tiny_tokenizer, DataConfig(max_prompt_length=512))
    assert len(ds) == 60 and ds.stats["rows_skipped"] == 0
    item = ds[0]
    assert item["data_source"].startswith("arpo_toy_") and item["extra_info"]["kind"] in ("math", "search", "multi")


def test_scripted_solutions_get_full_marks_and_wrong_answers_do_not():
    train = _rows("train")
    recs = read_records(DATA / "sft_train.jsonl")
    assert len(recs) == len(train) == 600
    for row, rec in zip(train, recs):
        assert rec["conversations"][0]["value"] == row["extra_info"]["question"] and rec["system"] == SYSTEM_PROMPT
        traj, gt = rec["conversations"][1]["value"], row["reward_model"]["ground_truth"]
        kind = row["extra_info"]["kind"]
        assert traj.count("<result>") == {"math": 1, "search": 1, "multi": 2}[kind]
        res = default_compute_score(row["data_source"], traj, gt, row["extra_info"])
        assert res["score"] == 1.0, (res, traj)  # qa_f1 (lookups, two-step) pays no tool bonus
    # a wrong boxed answer scores 0, a missing <think> fails the format gate
    row, traj = train[0], recs[0]["conversations"][1]["value"]
    wrong = traj.replace(f"\\boxed{{{row['reward_model']['ground_truth']}}}", "\\boxed{Nowhere 12345}")
    assert default_compute_score(row["data_source"], wrong, row["reward_model"]["ground_truth"])["score"] <= 0.1
    multi = next((r, c) for r, c in zip(train, recs) if r["extra_info"]["kind"] == "multi")
    bad = multi[1]["conversations"][1]["value"].replace("<think>", "").replace("</think>", "")
    assert default_compute_score(multi[0]["data_source"], bad, multi[0]["reward_model"]["ground_truth"])["score"] == -1.0


def test_fact_answers_come_from_the_corpus():
    spec = importlib.util.spec_from_file_location("make_corpus", ROOT / "search_cache" / "make_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    values = {(f["entity"], str(f["value"])) for f in mod.fictional_facts()}
    for row in _rows("test"):
        if row["extra_info"]["kind"] == "search":
            assert (row["extra_info"]["entity"], row["reward_model"]["ground_truth"]) in values


@pytest.mark.slow
def test_make_task_is_deterministic(tmp_path):
    proc = subprocess.run([sys.executable, str(DATA / "make_task.py"), "--seed", "0", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("train.parquet", "valid.parquet", "test.parquet", "sft_train.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name
    stats = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    assert stats["train"] == {"math": 200, "multi": 200, "search": 200}
