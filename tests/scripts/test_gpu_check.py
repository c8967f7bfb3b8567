"""scripts/gpu_check.sh on the host (GPU_CHECK_DEVICE=cpu): the same checks a GPU user runs, so the
script itself is tested on every CI run; its table on a real H100 is in docs/gpu.md."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, model_dir, engines, variants="base"):
    out = tmp_path / "table.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "BRIGHTDATA_"))}
    env.update(PYTHON=sys.executable, GPU_CHECK_DEVICE="cpu", GPU_CHECK_ENGINES=engines, GPU_CHECK_VARIANTS=variants,
               GPU_CHECK_OUT=str(out), GPU_CHECK_WORK=str(tmp_path / "work"), RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(model_dir)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    rows = json.loads(out.read_text()) if out.exists() else []
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert "| check | result | detail |" in proc.stdout
    return {r["check"]: r for r in rows}


def test_gpu_check_passes_on_the_host_with_the_hf_engine(tiny_model_dir, tmp_path):
    rows = _run(tmp_path, tiny_model_dir, "hf")
    assert [k for k in rows] == ["env", "engine:hf", "sync_memory:hf", "throughput:hf", "train:hf"]
    assert all(r["status"] == "PASS" for r in rows.values()), rows
    assert rows["sync_memory:hf"]["growth"] <= rows["sync_memory:hf"]["largest_param"] + 16 * 2**20
    assert "mismatch/log_prob_abs_diff" in rows["train:hf"]["metrics"]
    # [issue 31, item 5] the A/B: every setting measured, ratios to the defaults of the same run
    tput = rows["throughput:hf"]
    assert set(tput["tokens_per_s"]["eager"]) == {f"seeds={a},logprobs={b}" for a in (True, False) for b in (True, False)}
    assert all(v > 0 for v in tput["tokens_per_s"]["eager"].values())
    base = tput["tokens_per_s"]["eager"]["seeds=True,logprobs=True"]
    assert tput["ratios"]["no seeds"] == pytest.approx(tput["tokens_per_s"]["eager"]["seeds=False,logprobs=True"] / base)
    # each timed call's own numbers, from which the rate is the best of two
    for key, calls in tput["runs"]["eager"].items():
        assert len(calls) == 2 and all(0 < c["tokens"] <= 32 * 128 and c["forward_calls"] > 0 for c in calls)
        assert max(c["tokens"] / c["seconds"] for c in calls) == pytest.approx(tput["tokens_per_s"]["eager"][key])
        # the decode loop feeds every unfinished row once per call: at least the longest output's calls
        assert all(c["forward_calls"] * 32 >= c["tokens"] for c in calls)


@pytest.mark.slow
def test_gpu_check_training_variants_on_the_host(tiny_model_dir, tmp_path):
    rows = _run(tmp_path, tiny_model_dir, "hf", "offload,gae_lora_packed,sp2")
    assert {"train:hf+offload", "train:hf+gae_lora_packed", "train:hf+sp2"} <= set(rows)
    assert all(r["status"] == "PASS" for r in rows.values()), rows
    for variant in ("gae_lora_packed", "sp2"):
        assert "critic/vf_loss" in rows[f"train:hf+{variant}"]["metrics"]


@pytest.mark.vllm
def test_gpu_check_passes_on_the_host_with_vllm(tmp_path):
    pytest.importorskip("vllm")
    from verl_arpo.utils.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", seed=0, hidden_size=128, intermediate_size=256)  # head_dim 32
    rows = _run(tmp_path, model_dir, "vllm", "base,async")
    assert [k for k in rows] == ["env", "engine:vllm", "sync_memory:vllm", "throughput:vllm", "train:vllm",
                                 "train:vllm+async"]
    assert all(r["status"] == "PASS" for r in rows.values()), rows


def test_device_memory_per_phase_is_printed_for_each_step():
    """[issue 31, item 2] On a GPU the train rows say the device memory at entry and exit of each phase
    of both steps (the workers log perf/gpu_memory_{entry,exit}_gb/<phase> on CUDA only)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    steps = [{"step": s, **{f"perf/gpu_memory_{k}_gb/{p}": v + (0.5 if k == "exit" else 0) + s
                            for p, v in (("rollout", 10.0), ("update", 20.0)) for k in ("entry", "exit")}}
             for s in (1, 2)]
    assert gc.phase_memory(steps) == ("device GiB per phase step 1: rollout 11.0→11.5, update 21.0→21.5; "
                                      "step 2: rollout 12.0→12.5, update 22.0→22.5")
    assert gc.phase_memory([{"step": 1, "perf/cpu_memory_peak_gb": 3.0}]) == ""  # the host: nothing to say
