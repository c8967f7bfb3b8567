"""bench_actor_update's FLOP count (its MFU column) against PyTorch's own FLOP counter, and the random
shapes it builds against Qwen2.5's released configs (the numbers a GPU run reports rest on both)."""
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_actor_update import SHAPES, model_flops, peak_tflops  # noqa: E402


@pytest.mark.parametrize("lengths", [[7], [5, 9, 12]])
def test_model_flops_match_the_flop_counter_of_a_plain_forward(tiny_model_dir, lengths):
    """Eager attention computes the full S x S scores (masked after), so the counter sees
    2·2·L·q_dim·S² per row where the causal count is S(S+1)/2; the matmul part must agree exactly."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager", dtype=torch.float32)
    counted = 0
    for s in lengths:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(input_ids=torch.randint(3, config.vocab_size, (1, s)))
        counted += counter.get_total_flops()
    head_dim = config.hidden_size // config.num_attention_heads
    q_dim, L = config.num_attention_heads * head_dim, config.num_hidden_layers
    full_attention = sum(4 * L * q_dim * s * s for s in lengths)
    causal_attention = sum(4 * L * q_dim * s * (s + 1) / 2 for s in lengths)
    assert model_flops(config, lengths, passes=1) == pytest.approx(counted - full_attention + causal_attention)
    assert model_flops(config, lengths, passes=3) == pytest.approx(3 * model_flops(config, lengths, passes=1))
    # logits for the last token of each row only: the counter drops lm_head for the others
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        for s in lengths:
            model(input_ids=torch.randint(3, config.vocab_size, (1, s)), logits_to_keep=1)
    assert model_flops(config, lengths, passes=1, scored=len(lengths)) == pytest.approx(
        counter.get_total_flops() - full_attention + causal_attention)


def test_shapes_are_qwen25s_and_peaks_are_named():
    # parameters of Qwen2.5-0.5B / 1.5B (tied embeddings): 494M and 1.54B, as their model cards say
    def params(c):
        h, L, i, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
        kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
        per_layer = h * h * 2 + h * kv * 2 + (h + kv + kv) + 3 * h * i + 2 * h  # q,o,k,v weights, qkv bias, mlp, norms
        return L * per_layer + V * h + h
    assert params(SHAPES["qwen2.5-0.5b"]) / 1e6 == pytest.approx(494, abs=1)
    assert params(SHAPES["qwen2.5-1.5b"]) / 1e9 == pytest.approx(1.54, abs=0.01)
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("cpu") is None
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H20") == 148.0 and peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0


def test_gpu_bench_script_runs_on_the_cpu_and_every_path_scores_alike(tmp_path):
    """scripts/gpu_bench.sh, as a GPU lease runs it, on the host at the tiny shape: the JSON it writes
    holds one row per case, and every attention path (padded, packed, prefix-shared; fp32 and bf16
    parameters) gives the bare loop's mean log-probability and first gradient norm."""
    import json
    import os
    import subprocess

    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(tmp_path), "--skip-check"],
                       env={**os.environ, "GPU_BENCH_DEVICE": "cpu"}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "actor_update_tiny.json").read_text())
    rows = {(row["who"], row["label"]): row for row in data["rows"]}
    assert len(rows) == 4 and (tmp_path / "actor_update_tiny.log").is_file()
    bare = rows[("bare", "fp32, no checkpointing")]
    for row in rows.values():
        assert row["mean_log_prob"] == pytest.approx(bare["mean_log_prob"], rel=1e-3), row["label"]
        assert row["grad_norm"] == pytest.approx(bare["grad_norm"], rel=1e-2), row["label"]
        assert row["tok_per_s"] > 0 and row["log_prob_tok_per_s"] > 0 and row["mfu"] is None  # no peak on a CPU
    assert {e["metric"].split(":")[0] for e in data["summary"]} == {"trained tok/s, ours / bare loop",
                                                                    "log-prob tok/s, ours / bare loop"}


def test_gpu_bench_script_reports_a_failed_step_and_keeps_the_cases_it_measured(tmp_path):
    """A lease that runs out of time must not look like a success: with every case past its time
    limit the bench records each one as failed in its JSON (written as it goes) and exits non-zero,
    and the script exits 1 naming the step. Before the fix, `cmd | tee | grep || true` read the exit
    status of `true` and the script exited 0 whatever happened."""
    import json
    import os
    import subprocess

    env = {**os.environ, "GPU_BENCH_DEVICE": "cpu", "GPU_BENCH_CASE_TIMEOUT": "0.01"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(tmp_path), "--skip-check"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "== actor_update_tiny: exit 1" in r.stdout
    data = json.loads((tmp_path / "actor_update_tiny.json").read_text())
    assert data["rows"] == [] and len(data["failed"]) == 4
    assert all("timed out" in f["error"] for f in data["failed"])
