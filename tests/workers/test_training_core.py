"""The shared training mechanics (verl_arpo/workers/training_core.py) against plain references:
the learning-rate schedule, the guarded optimizer step, and SFT using the very same pieces."""
import logging
import math

import pytest
import torch
from omegaconf import OmegaConf

from verl_arpo.config import ConfigError, FSDPConfig, OptimConfig, from_mapping
from verl_arpo.workers.optim_step import build_adamw, build_lr_scheduler, clip_grad_and_step
from verl_arpo.workers.sharded_model import attn_implementation, fsdp_mixed_precision


def reference_factor(step, total, warmup, style, floor):
    """The schedule written out: linear warmup to 1 over `warmup` steps, then constant or cosine."""
    if step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.parametrize("style", ["constant", "cosine"])
@pytest.mark.parametrize("warmup_steps,ratio", [(-1, 0.2), (3, 0.0), (-1, 0.0)])
def test_lr_schedule_matches_the_formula(style, warmup_steps, ratio):
    total, floor, lr = 10, 0.1, 0.5
    param = torch.nn.Parameter(torch.zeros(1))
    opt = build_adamw([param], OptimConfig(lr=lr))
    sched = build_lr_scheduler(opt, OptimConfig(lr=lr, lr_warmup_steps=warmup_steps, lr_warmup_steps_ratio=ratio,
                                                warmup_style=style, min_lr_ratio=floor), total)
    warmup = warmup_steps if warmup_steps >= 0 else int(ratio * total)
    for step in range(total + 2):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr * reference_factor(step, total, warmup, style, floor))
        opt.step()
        sched.step()


def test_sft_reads_its_keys_into_the_same_schedule():
    from verl_arpo.trainer.main_sft import load_config, optim_config

    cfg = load_config(["model.partial_pretrain=/m", "optim.lr=0.01", "optim.warmup_steps_ratio=0.25", "optim.lr_scheduler=cosine",
                       "optim.min_lr_ratio=0.2", "optim.weight_decay=0.0"])
    oc = optim_config(cfg.optim)
    assert (oc.lr, oc.lr_warmup_steps_ratio, oc.warmup_style, oc.min_lr_ratio, oc.weight_decay) == (0.01, 0.25, "cosine",
                                                                                                   0.2, 0.0)
    assert oc.betas == tuple(OmegaConf.to_container(cfg.optim.betas))


def test_guarded_step_clips_and_skips_non_finite(caplog):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    layer(torch.randn(4, 3)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    before = [p.detach().clone() for p in layer.parameters()]
    assert clip_grad_and_step(layer, opt, 0.5, "test") == pytest.approx(norm, rel=1e-5)
    for p, b, g in zip(layer.parameters(), before, grads):  # SGD with lr 1: p = b − g·(0.5 / norm)
        torch.testing.assert_close(p.detach(), b - g * (0.5 / norm), rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in layer.parameters())
    layer(torch.randn(4, 3)).sum().backward()
    layer.weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in layer.parameters()]
    with caplog.at_level(logging.WARNING, logger="verl_arpo"):
        assert math.isnan(clip_grad_and_step(layer, opt, 1.0, "test"))
    assert "skipping this optimizer step" in caplog.text
    for p, b in zip(layer.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_precision_and_attention_defaults():
    assert fsdp_mixed_precision(None, "cpu") is None  # fp32 on CPU unless asked
    mp = fsdp_mixed_precision(None, "cuda")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    # the typed section (verl's dtype names too): built from the YAML's mapping, checked key by key
    section = from_mapping(FSDPConfig, {"mixed_precision": {"param_dtype": "fp16"}}, "actor_rollout_ref.actor.fsdp_config")
    mp = fsdp_mixed_precision(section.mixed_precision, "cpu")
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.float16, torch.float32)
    assert from_mapping(FSDPConfig, {"mixed_precision": None}, "f").mixed_precision is None
    with pytest.raises(ConfigError) as bad:
        from_mapping(FSDPConfig, {"mixed_precision": {"param_dtype": "float8", "buffer_dtype": "float32"}},
                     "actor_rollout_ref.actor.fsdp_config")
    assert [key for key, _ in bad.value.problems] == ["actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype",
                                                      "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"]
    assert "'float8'" in str(bad.value) and "accepts ['param_dtype', 'reduce_dtype']" in str(bad.value)
    assert attn_implementation("eager") == "eager"
    assert attn_implementation(None) == ("sdpa" if not torch.cuda.is_available() else attn_implementation(None))


def test_dense_packing_on_cuda_warns_once(tiny_model_dir, caplog):
    """sdpa packing on CUDA costs N² attention: one loud warning; flash attention or the host: none."""
    import logging

    from transformers import AutoModelForCausalLM

    from verl_arpo.workers import training_core as tc

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    tc._warned.discard("dense_packing")
    with caplog.at_level(logging.WARNING, logger=tc.__name__):
        tc.warn_if_dense_packing(model, torch.device("cpu"))
        assert not caplog.records
        tc.warn_if_dense_packing(model, torch.device("cuda", 0))
        tc.warn_if_dense_packing(model, torch.device("cuda", 0))
    assert len(caplog.records) == 1 and "flash-attn" in caplog.records[0].getMessage()
    caplog.clear()
    tc._warned.discard("dense_packing")
    model.config._attn_implementation = "flash_attention_2"
    with caplog.at_level(logging.WARNING, logger=tc.__name__):
        tc.warn_if_dense_packing(model, torch.device("cuda", 0))
    assert not caplog.records


_FRAGMENT = r'''
import torch
from verl_arpo.workers.host_memory import release_host_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(30 * 2**20 // 4); del big          # freeing a mapped 30 MB block raises malloc's mmap threshold
blocks = [torch.ones(4 * 2**20 // 4) for _ in range(100)]   # 400 MB of 4 MB tensors, now from the heap
keep = blocks[-1]
del blocks                                         # freed, but below a live block: not returned by itself
before = rss()
release_host_memory()
print(before, rss())
'''


def test_release_host_memory_returns_freed_heap():
    """400 MB of freed 4 MB tensors stay resident under glibc until trimmed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert before - after > 300 * 2**20, (before, after)


_PEAK = r'''
import torch
from verl_arpo.workers.host_memory import memory_metrics
cpu = torch.device("cpu")
memory_metrics(cpu)                       # start a fresh window
x = torch.ones(512 * 2**20 // 4)          # 512 MiB, touched
del x                                     # a large block: freed straight back (mmap)
first = memory_metrics(cpu)
second = memory_metrics(cpu)              # nothing big since the last call
print(first["perf/cpu_memory_peak_gb"], first["perf/cpu_memory_used_gb"], second["perf/cpu_memory_peak_gb"])
'''


def test_host_memory_peak_is_per_window_and_reduced_by_max():
    """perf/cpu_memory_peak_gb sees a 512 MiB block that is already freed, and the next call's window
    no longer does; across ranks the peak is the largest, not the mean."""
    import subprocess
    import sys

    from verl_arpo.trainer.ppo.ray_trainer import reduce_metrics

    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    peak, used, next_peak = map(float, out.stdout.split())
    assert peak - used > 0.45, (peak, used)   # the freed block is in the peak, not in the current RSS
    assert next_peak - used < 0.1, (next_peak, used)
    got = reduce_metrics({"perf/cpu_memory_peak_gb": [2.0, 3.5], "perf/cpu_memory_used_gb": [2.0, 3.0]})
    assert got == {"perf/cpu_memory_peak_gb": 3.5, "perf/cpu_memory_used_gb": 2.5}


_PHASES = r'''
import json
import torch
from verl_arpo.workers.host_memory import HOST_MEMORY, memory_metrics
cpu = torch.device("cpu")
memory_metrics(cpu)                           # a fresh window
with HOST_MEMORY.phase("update"):
    a = torch.ones(256 * 2**20 // 4); del a   # 256 MiB in the outer phase only
    for _ in range(2):                        # a phase entered twice: largest peak, first entry
        with HOST_MEMORY.phase("update/backward"):
            b = torch.ones(512 * 2**20 // 4); del b
    c = torch.ones(128 * 2**20 // 4); del c
with HOST_MEMORY.phase("weight_sync"):
    pass
m = memory_metrics(cpu)
print(json.dumps(m))
print(json.dumps(memory_metrics(cpu)))       # nothing closed since: no phase keys
'''


def test_host_memory_phases_nest_and_keep_the_window_peak():
    """Each phase's peak − entry is what it allocated (512 MiB inside update/backward; the 256 MiB of
    the outer phase before it does not count there), the outer phase sees its own and its inner
    phases' allocations, and the per-phase resets do not hide anything from the window peak."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PHASES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = (json.loads(line) for line in out.stdout.split("\n")[:2])
    gib = 1 / 1024

    def grew(phase):
        return first[f"perf/cpu_memory_peak_gb/{phase}"] - first[f"perf/cpu_memory_entry_gb/{phase}"]

    assert 500 * gib < grew("update/backward") < 560 * gib, first
    assert 500 * gib < grew("update") < 560 * gib, first      # the largest of 256, 512, 128 MiB
    assert grew("weight_sync") < 40 * gib, first
    assert first["perf/cpu_memory_peak_gb"] >= first["perf/cpu_memory_peak_gb/update/backward"]
    assert first["perf/cpu_memory_peak_gb"] - first["perf/cpu_memory_used_gb"] > 450 * gib
    assert not any(k.count("/") > 1 or "entry" in k for k in second), second
