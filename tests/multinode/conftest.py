"""Fixtures of the two-host tests: the namespaces + Ray cluster (module scope, torn down even when a
test fails), the toy data, and merging a checkpoint to Hugging Face format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from netns_cluster import RAY_ENV, TwoHosts, skip_reason

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hosts():
    """Namespaces A and B with a Ray head in A and a worker node in B (2 CPUs each)."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = TwoHosts()
    try:
        cluster.create_network()
    except Exception as exc:  # e.g. a container without CAP_SYS_ADMIN / netns support
        cluster.teardown()
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        cluster.start_ray("a")
        cluster.start_ray("b")
        cluster.wait_for_nodes()
    except BaseException:
        cluster.teardown()
        raise
    yield cluster
    cluster.teardown()


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    """The same toy rows as tests/trainer/test_e2e.py."""
    d = tmp_path_factory.mktemp("toy_data")
    rows = [{"data_source": "arpo_toy_math", "prompt": [{"role": "user", "content": "What is 12 * 34?"}],
             "ability": "math", "reward_model": {"ground_truth": "408", "style": "rule"},
             "extra_info": {"index": i, "split": "train"}} for i in range(6)]
    pd.DataFrame(rows).to_parquet(d / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(d / "valid.parquet")
    return d


@pytest.fixture(scope="module")
def merge(tmp_path_factory):
    """merge(checkpoint_dir) -> HF folder, via merge_ckpt/convert_verl_to_hf.py (a host process)."""
    root = HERE.parents[1]

    def _merge(step_dir: Path) -> Path:
        out = tmp_path_factory.mktemp("hf")
        r = subprocess.run([sys.executable, str(root / "merge_ckpt" / "convert_verl_to_hf.py"), "--verl_checkpoint",
                            str(step_dir), "--output_dir", str(out), "--model_type", "qwen2"],
                           capture_output=True, text=True, timeout=300, env={**os.environ, **RAY_ENV})
        assert r.returncode == 0, r.stderr[-3000:]
        return out

    return _merge
