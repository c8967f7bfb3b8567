"""verl_arpo.trainer.memory_estimate: parameter counts against transformers, and the update phase's
arithmetic against measured host memory of a real FSDP2 update on CPU (fp32: dtype_bytes=4).

The measured run: one gloo rank, a 4-layer model of ~234 MiB (wide MLP, so parameters dominate as
they do in a 7B), init through the workers' own init_sharded_model, then one PPO update with
gradient checkpointing over a micro-batch of known size. Peak RSS growth (VmHWM reset before the
init) must land within 25% of the estimate's update-phase total (no engine, no reference model).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


from verl_arpo.trainer import memory_estimate as me

ROOT = Path(__file__).resolve().parents[2]


def test_presets_count_the_published_sizes():
    seven, fourteen = me.model_shape("qwen2.5-7b"), me.model_shape("qwen3-14b")
    assert 7.6e9 < seven.params < 7.7e9  # Qwen2.5-7B: 7.61 B
    assert 14.7e9 < fourteen.params < 14.8e9  # Qwen3-14B: 14.8 B
    assert seven.root_params == 2 * 152064 * 3584 + 3584  # untied embedding + head + final norm


def test_model_shape_of_a_folder_matches_its_parameters(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    shape = me.model_shape(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params == sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n)


def test_offload_moves_the_state_off_the_gpu():
    m = me.model_shape("qwen2.5-7b")
    base = dict(world=8, train_tokens=8192, logprob_tokens=16384, response_fraction=0.7, param_offload=False,
                optimizer_offload=False, gradient_checkpointing=True, engine="vllm", gpu_memory_utilization=0.6,
                free_cache_engine=True, need_ref=False, ref_param_offload=True)
    plain = me.estimate(m, me.JobShape(**base), 80 * me.GIB)
    opt = me.estimate(m, me.JobShape(**{**base, "optimizer_offload": True}), 80 * me.GIB)
    full = me.estimate(m, me.JobShape(**{**base, "param_offload": True}), 80 * me.GIB)
    assert plain["rollout"]["adam_moments"] == 8 * m.params / 8 and opt["rollout"]["adam_moments"] == 0
    assert opt["update"]["adam_moments"] == plain["update"]["adam_moments"]  # back on the GPU for the step
    assert full["update"]["actor_params"] == full["update"]["adam_moments"] == 0
    assert plain["rollout"]["engine"] == 0.6 * 80 * me.GIB
    # reshard_after_forward=false: every layer stays gathered (bf16) in the log-prob pass and the update
    held = me.estimate(m, me.JobShape(**{**base, "reshard_after_forward": False}), 80 * me.GIB)
    for phase in ("log_prob", "update"):
        assert plain[phase]["gathered_units"] == 2 * (2 * m.layer_params + m.root_params)
        assert held[phase]["gathered_units"] == 2 * (m.layers * m.layer_params + m.root_params)
    # grad_sync_once: the whole model's fp32 gradients unsharded (beside the sharded ones) in the update only
    once = me.estimate(m, me.JobShape(**{**base, "grad_sync_once": True, "need_critic": True,
                                         "critic_grad_sync_once": True}), 80 * me.GIB)
    assert once["update"]["gradients"] == 4 * m.params / 8 + 4 * m.params
    assert once["critic_update"]["critic_gradients"] == 4 * m.params / 8 + 4 * m.params
    assert plain["update"]["gradients"] == 4 * m.params / 8 + 4 * m.layer_params + 4 * m.root_params
    assert once["resume"]["gradients"] == plain["resume"]["gradients"]


_MEASURE = r'''
import json, os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
torch.set_num_threads(2)
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
dist.init_process_group("gloo", rank=0, world_size=1)
import transformers, peft  # noqa: F401  imports are not the job's memory
from verl_arpo.protocol import DataProto
from verl_arpo.config import OptimConfig
from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
from verl_arpo.workers.host_memory import HOST_MEMORY
from verl_arpo.workers.optim_step import build_adamw
from verl_arpo.workers.sharded_model import init_sharded_model, load_causal_lm, shard_fsdp2
model_dir, B, P, R = sys.argv[1], 4, 64, 192
HOST_MEMORY.take_window_peak()   # a fresh window: the update resets VmHWM at its phase boundaries, the window does not lose them
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
mesh = init_device_mesh("cpu", (1,))
kw = dict(gradient_checkpointing=True)
model = init_sharded_model(lambda: load_causal_lm(model_dir, **kw), lambda: load_causal_lm(model_dir, empty=True, **kw),
                           lambda m: shard_fsdp2(m, mesh), torch.device("cpu"))
opt = build_adamw(model.parameters(), OptimConfig(lr=1e-4))
g = torch.Generator().manual_seed(0)
ids = torch.randint(3, model.config.vocab_size, (B, P + R), generator=g)
attn = torch.ones(B, P + R, dtype=torch.long)
data = DataProto.from_dict(tensors=dict(input_ids=ids, attention_mask=attn, position_ids=torch.arange(P + R).expand(B, -1).clone(),
    responses=ids[:, P:], response_mask=torch.ones(B, R), advantages=torch.randn(B, R, generator=g),
    old_log_probs=-torch.rand(B, R, generator=g)))
from verl_arpo.config import Batching
actor = DataParallelPPOActor(None, model, opt, update=Batching(micro_batch=B, use_dynamic_bsz=False, max_token_len=B * (P + R),
                                                               mini_batch=B))
actor.update_policy(data)
peak = HOST_MEMORY.take_window_peak()
print(json.dumps(dict(growth=peak - before, tokens=B * (P + R), response_fraction=R / (P + R))))
dist.destroy_process_group()
'''


def test_update_estimate_matches_measured_memory_on_cpu(tmp_path):
    from verl_arpo.utils.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", seed=0, hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
                                num_key_value_heads=2, intermediate_size=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", _MEASURE, model_dir, "x", str(port)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    shape = me.model_shape(model_dir)
    job = me.JobShape(world=1, train_tokens=got["tokens"], logprob_tokens=got["tokens"],
                      response_fraction=got["response_fraction"], param_offload=False, optimizer_offload=False,
                      gradient_checkpointing=True, engine="hf", gpu_memory_utilization=0.0, free_cache_engine=True,
                      need_ref=False, ref_param_offload=True, dtype_bytes=4)
    update = me.estimate(shape, job, 0)["update"]
    predicted = update["total"] - update["engine"]
    print(f"\nestimated {predicted / 2**20:.0f} MiB, measured {got['growth'] / 2**20:.0f} MiB "
          f"(parameters {4 * shape.params / 2**20:.0f} MiB fp32)")
    assert 0.75 * predicted <= got["growth"] <= 1.25 * predicted


def test_reference_in_bf16_and_the_updates_cached_peak():
    """[issue 31, items 2 and 4] The reference counts 2 bytes a parameter (bf16 on the GPU, as loaded
    now), 4 when set to float32; the update's freed peak is what PyTorch's cache would keep beside vLLM
    without the emptying before the wake, and the 14B script does not fit without it."""
    m = me.model_shape("qwen3-14b")
    base = dict(world=8, train_tokens=16384, logprob_tokens=32768, response_fraction=0.75, param_offload=False,
                optimizer_offload=False, gradient_checkpointing=True, engine="vllm", gpu_memory_utilization=0.6,
                free_cache_engine=True, need_ref=True, ref_param_offload=False)
    bf16 = me.estimate(m, me.JobShape(**base), 80 * me.GIB)
    fp32 = me.estimate(m, me.JobShape(**{**base, "ref_bytes": 4}), 80 * me.GIB)
    assert bf16["update"]["ref_params"] == 2 * m.params / 8 and fp32["update"]["ref_params"] == 4 * m.params / 8
    assert me._ref_bytes(None, 2) == 2 and me._ref_bytes(None, 4) == 4 and me._ref_bytes("float32", 2) == 4
    u = bf16["update"]
    cached = me.cached_after_update(bf16)
    assert cached == u["gathered_units"] + u["activations"] + u["logits"] + u["gradients"] > 0
    assert bf16["rollout"]["total"] <= 80 * me.GIB < bf16["rollout"]["total"] + cached
    text = me.render(m, me.JobShape(**base), bf16, 80 * me.GIB)
    assert "without emptying the cache before the wake" in text and "does NOT fit; the worker empties it" in text


def test_resume_critic_runtime_and_the_kv_capacity():
    """[issue 48] The terms the estimate lacked: a resume phase (engine asleep; the optimizer load's
    dummy step needs gradients and moments beside the shard: 4x the fp32 shard), the critic's state
    under GAE, CUDA/NCCL's own memory, the root unit's unsharded gradient, and vLLM's KV tokens."""
    m = me.model_shape("qwen3-14b")
    base = dict(world=8, train_tokens=16384, logprob_tokens=32768, response_fraction=0.75, param_offload=False,
                optimizer_offload=False, gradient_checkpointing=True, engine="vllm", gpu_memory_utilization=0.6,
                free_cache_engine=True, need_ref=False, ref_param_offload=True)
    gpu = 80 * me.GIB
    t = me.estimate(m, me.JobShape(**base), gpu)
    r = t["resume"]
    assert r["engine"] == 0 and r["actor_params"] + r["gradients"] + r["adam_moments"] == 16 * m.params / 8
    assert all(p["runtime"] == 2.5 * me.GIB for p in t.values())
    assert t["update"]["gradients"] == 4 * m.params / 8 + 4 * m.layer_params + 4 * m.root_params
    assert "critic_update" not in t
    gae = me.estimate(m, me.JobShape(**base, need_critic=True, critic_train_tokens=8192), gpu)
    assert gae["rollout"]["critic_params"] == 12 * m.params / 8                 # shard + moments, on the GPU
    c = gae["critic_update"]
    assert c["critic_params"] == 4 * m.params / 8 and c["critic_moments"] == 8 * m.params / 8
    assert gae["rollout"]["total"] - t["rollout"]["total"] == 12 * m.params / 8
    # KV: (0.6 x 80 GiB - bf16 weights - 2 GiB) / (2 x 40 layers x 1024 x 2 bytes) at Qwen3-14B
    kv = me.kv_tokens_per_gpu(m, me.JobShape(**base), gpu)
    assert me.kv_bytes_per_token(m) == 2 * 40 * 8 * 128 * 2
    assert kv == int((0.6 * gpu - 2 * m.params - 2 * me.GIB) // (2 * 40 * 1024 * 2))
    more = me.kv_tokens_per_gpu(m, me.JobShape(**{**base, "gpu_memory_utilization": 0.75}), gpu)
    assert more > 1.6 * kv   # the 14B scripts' 0.75 (the optimizer offloaded to make room): 121k -> 200k tokens
    assert f"{kv:,} tokens per GPU" in me.render(m, me.JobShape(**base), t, gpu)


def test_the_14b_script_fits_at_its_new_defaults():
    """The 14B script's own config (optimizer offload, 0.75): every phase fits an 80 GiB GPU."""
    table = me.main(["--script", str(ROOT / "scripts" / "ARPO_14B_DeepSearch_1node.sh"), "--model", "qwen3-14b"])
    assert max(p["total"] for p in table.values()) <= 80 * me.GIB, {k: v["total"] / me.GIB for k, v in table.items()}
