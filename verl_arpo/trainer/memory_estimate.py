"""Per-GPU memory of a training job, phase by phase, from the model config and the job config (docs/gpu.md,
"Memory estimate"). Nothing is loaded: the model is built on the meta device to count its parameters.

    python -m verl_arpo.trainer.memory_estimate --script scripts/ARPO_7B_Reasoning_1node.sh --model qwen2.5-7b
    python -m verl_arpo.trainer.memory_estimate --job job.yaml --model /path/to/hf_folder --gpu-gib 80

`--script` runs a launch script with `--cfg job` (its own environment variables apply; placeholder paths
are filled in when ACTOR_MODEL_PATH / SAVE_PATH are unset) and reads the composed config; `--job`
reads a config printed that way.

`--model` is an HF folder or config.json, or a preset of the seed scripts' models (PRESETS: their
public architecture numbers, no download). Phases, each with its own resident set:

  rollout      the engine awake (vLLM reserves gpu_memory_utilization of the GPU) + what the actor keeps
  log_prob     engine asleep; the actor's no-grad forward over log_prob_max_token_len_per_gpu tokens
  update       engine asleep; forward + backward over ppo_max_token_len_per_gpu tokens, then AdamW
  weight_sync  the engine's weights awake + the actor's shard + one gathered parameter
  resume       engine asleep (the worker sleeps it for the load); loading the optimizer state runs
               an AdamW step on dummy gradients: shard + gradients + both moments, 4x the fp32 shard
  critic_update  (GAE) the critic's forward + backward + AdamW beside the actor's resident state

Every phase also counts the CUDA context and NCCL's buffers (`runtime`, ~2.5 GiB a GPU, outside
PyTorch's allocator: 2-3.5 GiB measured on H100/H200) and, under GAE, the critic's resident state
(same architecture as the actor, its own shard and moments). The update counts the root unit's
unsharded gradient (embeddings + lm_head, fp32 until its reduce-scatter at the end of the backward).
With vLLM the table also gives the KV cache's token capacity per GPU: what
gpu_memory_utilization leaves after the engine's weights and its activation reserve, over the KV
bytes of one token (2 x layers x kv_dim x 2 bytes).

The rules are the ones this code base follows: FSDP2 shards fp32 parameters, gradients and both
AdamW moments over the world (param_offload keeps all three on the host, optimizer_offload the
moments between updates); compute is bf16 on CUDA (`dtype_bytes=4` on CPU) with one decoder layer
all-gathered at a time plus the next one prefetched (with `reshard_after_forward=false` every layer,
held through a mini-batch); gradient checkpointing keeps each layer's
input; the logits of the response tokens exist once in the compute dtype, their gradient once, and
the log-prob temporaries are float32 chunks (torch_functional.logprobs_from_logits). Activations
other than those are an estimate (one layer's working set: attention projections and the MLP);
`tests/trainer/test_memory_estimate.py` checks the arithmetic against measured RSS on CPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30

# Public architecture numbers of the seed scripts' models (their config.json), to count parameters offline.
PRESETS: dict[str, dict] = {
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelShape:
    params: int
    layer_params: int       # one decoder layer
    root_params: int        # embeddings, head, final norm (FSDP2's root unit)
    largest_param: int
    hidden: int
    intermediate: int
    kv_dim: int
    q_dim: int
    layers: int
    vocab: int


def model_shape(model: str) -> ModelShape:
    """Count the parameters of `model` (preset, HF folder or config.json) on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model in PRESETS:
        spec = dict(PRESETS[model])
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    else:
        path = Path(model)
        cfg = AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    named = dict(m.named_parameters())
    layer0 = [k for k in named if ".layers.0." in k]
    layer = sum(named[k].numel() for k in layer0)
    total = sum(p.numel() for p in named.values())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelShape(params=total, layer_params=layer, root_params=total - layer * cfg.num_hidden_layers,
                      largest_param=max(p.numel() for p in named.values()), hidden=cfg.hidden_size,
                      intermediate=cfg.intermediate_size, kv_dim=cfg.num_key_value_heads * head_dim,
                      q_dim=cfg.num_attention_heads * head_dim, layers=cfg.num_hidden_layers, vocab=cfg.vocab_size)


@dataclass(frozen=True)
class JobShape:
    world: int
    train_tokens: int           # tokens per GPU of an update micro-batch (ppo_max_token_len_per_gpu, or micro × seq len ÷ S)
    logprob_tokens: int         # tokens per log-prob micro-batch
    response_fraction: float    # share of a micro-batch's tokens that are response tokens (get logits)
    param_offload: bool
    optimizer_offload: bool
    gradient_checkpointing: bool
    engine: str                 # vllm | hf
    gpu_memory_utilization: float
    free_cache_engine: bool
    need_ref: bool
    ref_param_offload: bool
    dtype_bytes: int = 2        # compute dtype: bf16 on CUDA
    ref_bytes: int = 2          # bytes per reference parameter (fsdp_config.model_dtype; null: bf16 on CUDA)
    logprob_chunk: int = 2048
    need_critic: bool = False
    critic_param_offload: bool = False
    critic_optimizer_offload: bool = False
    critic_train_tokens: int = 0   # tokens per GPU of a critic update micro-batch
    reshard_after_forward: bool = True   # false: every unit stays gathered through a mini-batch (and a log-prob pass)
    grad_sync_once: bool = False         # true: every unit's fp32 gradients unsharded until the mini-batch's end
    critic_grad_sync_once: bool = False


def job_shape(job: dict, dtype_bytes: int = 2) -> JobShape:
    """The numbers that decide memory, from a composed job config (`--cfg job` output, as a dict)."""
    from verl_arpo.config import JobConfig

    c = JobConfig.from_mapping(job)
    a, r, d = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout, c.derived
    seq = int(c.data.max_prompt_length) + int(c.data.max_response_length)

    def tokens(b) -> int:  # one micro-batch's tokens (a Batching of JobConfig.derived)
        return int(b.max_token_len) if b.use_dynamic_bsz else int(b.micro_batch or 1) * seq

    # under Ulysses sequence parallelism a micro-batch holds S x the per-GPU budget and each GPU 1/S of it
    train, logprob, need_ref = tokens(d.actor_update) // d.actor_sp, tokens(d.actor_log_prob) // d.actor_sp, d.need_ref
    return JobShape(world=d.world_size, train_tokens=train,
                    logprob_tokens=logprob, response_fraction=float(c.data.max_response_length) / seq,
                    param_offload=bool(a.fsdp_config.param_offload), optimizer_offload=bool(a.fsdp_config.optimizer_offload),
                    gradient_checkpointing=bool(c.actor_rollout_ref.model.enable_gradient_checkpointing),
                    engine=str(r.name), gpu_memory_utilization=float(r.gpu_memory_utilization),
                    free_cache_engine=bool(r.free_cache_engine), need_ref=need_ref,
                    ref_param_offload=bool(c.actor_rollout_ref.ref.fsdp_config.param_offload), dtype_bytes=dtype_bytes,
                    ref_bytes=_ref_bytes(c.actor_rollout_ref.ref.fsdp_config.model_dtype, dtype_bytes),
                    need_critic=d.need_critic, critic_param_offload=bool(c.critic.model.fsdp_config.param_offload),
                    critic_optimizer_offload=bool(c.critic.model.fsdp_config.optimizer_offload),
                    critic_train_tokens=tokens(d.critic_update) // d.critic_sp,
                    reshard_after_forward=bool(a.fsdp_config.reshard_after_forward),
                    grad_sync_once=bool(a.fsdp_config.grad_sync_once),
                    critic_grad_sync_once=bool(c.critic.model.fsdp_config.grad_sync_once))


def _ref_bytes(model_dtype: str | None, dtype_bytes: int) -> int:
    """Bytes per reference parameter, by the workers' own rule (config.resolve_model_dtype): null
    is bf16 on CUDA (dtype_bytes 2), fp32 on the CPU."""
    from verl_arpo.config import resolve_model_dtype

    name = resolve_model_dtype(model_dtype, trained=False, device_type="cuda" if dtype_bytes == 2 else "cpu")
    return 2 if name == "bfloat16" else 4


RUNTIME_BYTES = 2.5 * GIB
"""The CUDA context and NCCL's communicator buffers per GPU, outside PyTorch's allocator (2-3.5 GiB)."""
VLLM_ACTIVATION_BYTES = 2 * GIB
"""What vLLM keeps of its budget for its own forward's activations and sampler (its profiling run)."""


def kv_bytes_per_token(m: ModelShape, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token: 2 x layers x kv_dim x bytes."""
    return 2 * m.layers * m.kv_dim * dtype_bytes


def kv_tokens_per_gpu(m: ModelShape, j: JobShape, gpu_bytes: int) -> int:
    """Tokens of KV cache a vLLM engine holds (tensor parallel 1): its budget
    (gpu_memory_utilization x the GPU) less its bf16 weights and activation reserve."""
    free = j.gpu_memory_utilization * gpu_bytes - 2 * m.params - VLLM_ACTIVATION_BYTES
    return max(0, int(free // kv_bytes_per_token(m)))


def estimate(m: ModelShape, j: JobShape, gpu_bytes: int) -> dict[str, dict[str, float]]:
    """Bytes per GPU, per phase and component (see the module docstring for the rules)."""
    W, b = j.world, j.dtype_bytes
    shard = 0 if j.param_offload else 4 * m.params / W                        # fp32 parameters
    moments = 0 if j.param_offload else 8 * m.params / W                      # AdamW exp_avg, exp_avg_sq
    resident_moments = 0 if j.optimizer_offload else moments
    grads = 0 if j.param_offload else 4 * m.params / W
    # a layer + the prefetched one + root; with reshard_after_forward=false all of them (dp_actor.gather_once)
    gathered = b * ((2 * m.layer_params if j.reshard_after_forward else m.layers * m.layer_params) + m.root_params)
    reduce_buffer = 4 * m.layer_params                                         # one layer's fp32 gradients unsharded
    # grad_sync_once: every unit's fp32 gradients (root included) accumulate unsharded through the mini-batch
    held_grads = 4 * m.params - reduce_buffer - 4 * m.root_params              # beyond that layer and the root's

    def layer_working_set(tokens: int) -> float:                              # one layer's activations
        return b * tokens * (4 * m.hidden + m.q_dim + 2 * m.kv_dim + 3 * m.intermediate)

    def logits(tokens: int, grad: bool) -> float:
        resp = tokens * j.response_fraction
        chunk = 4 * min(j.logprob_chunk, resp) * m.vocab * (2 if grad else 1)
        return b * resp * m.vocab * (2 if grad else 1) + chunk                  # logits (+ their gradient) + chunks

    T = j.train_tokens
    saved = b * T * m.hidden * m.layers if j.gradient_checkpointing else layer_working_set(T) * m.layers
    ref = 0 if not j.need_ref or j.ref_param_offload else j.ref_bytes * m.params / W
    if j.engine == "vllm":
        engine_awake = j.gpu_memory_utilization * gpu_bytes                   # vLLM reserves its fraction
        engine_weights = 2 * m.params                                          # bf16 copy, woken alone for a sync
    else:
        engine_awake = engine_weights = b * m.params                            # HF engine: its own copy (+ KV)
    engine_asleep = 0 if j.free_cache_engine else engine_awake
    runtime = RUNTIME_BYTES if b == 2 else 0                                    # CUDA only (bf16 compute)
    root_grad = 4 * m.root_params                                              # unsharded until the backward ends
    critic_shard = 0 if not j.need_critic or j.critic_param_offload else 4 * m.params / W
    critic_moments = 0 if not j.need_critic or j.critic_param_offload else 8 * m.params / W
    critic_resident = critic_shard + (0 if j.critic_optimizer_offload else critic_moments)
    phases = {
        "rollout": dict(actor_params=shard, adam_moments=resident_moments, ref_params=ref, engine=engine_awake),
        "log_prob": dict(actor_params=shard, adam_moments=resident_moments, ref_params=ref, gathered_units=gathered,
                         activations=layer_working_set(j.logprob_tokens), logits=logits(j.logprob_tokens, grad=False),
                         engine=engine_asleep),
        "update": dict(actor_params=shard, adam_moments=moments, gradients=grads + reduce_buffer, ref_params=ref,
                       gathered_units=gathered, activations=saved + layer_working_set(T),
                       logits=logits(T, grad=True), engine=engine_asleep),
        "weight_sync": dict(actor_params=shard, adam_moments=resident_moments, ref_params=ref,
                            engine=engine_weights, gathered_param=b * m.largest_param),
        "resume": dict(actor_params=shard, adam_moments=moments, gradients=grads, ref_params=ref,
                       engine=engine_asleep),
    }
    phases["update"]["gradients"] += root_grad + (held_grads if j.grad_sync_once else 0)
    if j.need_critic:
        Tc = j.critic_train_tokens or T
        csaved = b * Tc * m.hidden * m.layers if j.gradient_checkpointing else layer_working_set(Tc) * m.layers
        phases["critic_update"] = dict(
            actor_params=shard, adam_moments=resident_moments, ref_params=ref, critic_params=critic_shard,
            critic_moments=critic_moments, critic_gradients=(0 if j.critic_param_offload else 4 * m.params / W)
            + 4 * m.layer_params + (held_grads + 4 * m.root_params if j.critic_grad_sync_once else 0), gathered_units=gathered, activations=csaved + layer_working_set(Tc),
            engine=engine_asleep)
        for name, parts in phases.items():
            if name != "critic_update":
                parts["critic_params"] = critic_resident
    for parts in phases.values():
        parts["runtime"] = runtime
    return {name: {**parts, "total": sum(parts.values())} for name, parts in phases.items()}


def cached_after_update(table: dict) -> float:
    """Bytes the update's transient peak leaves in PyTorch's caching allocator once it is freed: the
    gathered layers, activations, logits and the gradients (set to None after the step): reserved,
    unused, and invisible to vLLM, which allocates outside that cache. The worker empties the cache
    before the sync and before the wake (docs/gpu.md, "Memory around the wake"); without that these
    bytes would sit beside the engine's weights and then its KV cache."""
    u = table["update"]
    return u["gathered_units"] + u["activations"] + u["logits"] + u["gradients"]


def render(m: ModelShape, j: JobShape, table: dict, gpu_bytes: int) -> str:
    comps = sorted({k for parts in table.values() for k in parts if k != "total"})
    lines = [f"model: {m.params / 1e9:.2f} B parameters ({m.layers} layers, vocab {m.vocab}); world {j.world} GPUs; "
             f"engine {j.engine} (gpu_memory_utilization {j.gpu_memory_utilization}); update micro-batch "
             f"{j.train_tokens} tokens, log-prob micro-batch {j.logprob_tokens}; param_offload {j.param_offload}, "
             f"optimizer_offload {j.optimizer_offload}",
             "| GiB per GPU | " + " | ".join(table) + " |", "| --- |" + " ---: |" * len(table)]
    for comp in comps + ["total"]:
        lines.append(f"| {comp} | " + " | ".join(f"{table[p].get(comp, 0) / GIB:.1f}" for p in table) + " |")
    worst = max(table, key=lambda p: table[p]["total"])
    fits = table[worst]["total"] <= gpu_bytes
    lines.append(f"peak: {worst} at {table[worst]['total'] / GIB:.1f} GiB of {gpu_bytes / GIB:.0f} GiB — "
                 f"{'fits' if fits else 'does NOT fit'}")
    if j.engine == "vllm":
        lines.append(f"vLLM KV cache: {kv_tokens_per_gpu(m, j, gpu_bytes):,} tokens per GPU "
                     f"({kv_bytes_per_token(m) / 1024:.0f} KiB a token; gpu_memory_utilization "
                     f"{j.gpu_memory_utilization} of {gpu_bytes / GIB:.0f} GiB, less the weights and "
                     f"{VLLM_ACTIVATION_BYTES / GIB:.0f} GiB of activations)")
        cached = cached_after_update(table)
        for phase in ("weight_sync", "rollout"):
            kept = table[phase]["total"] + cached
            lines.append(f"without emptying the cache before the {'sync' if phase == 'weight_sync' else 'wake'}, "
                         f"{phase} would hold {cached / GIB:.1f} GiB more (the update's freed peak): "
                         f"{kept / GIB:.1f} GiB — {'fits' if kept <= gpu_bytes else 'does NOT fit'}; the worker empties it")
    return "\n".join(lines)


def _compose(script: str) -> str:
    """`bash script --cfg job`; the model and output paths only need to be set, not to exist."""
    import os
    import subprocess
    import sys
    import tempfile

    tmp = tempfile.gettempdir()
    env = {"ACTOR_MODEL_PATH": os.path.join(tmp, "model"), "SAVE_PATH": os.path.join(tmp, "memory_estimate"),
           "PYTHON": sys.executable, **os.environ}
    proc = subprocess.run(["bash", script, "--cfg", "job"], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{script} --cfg job failed:\n{proc.stderr[-2000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--job", help="composed job config: YAML printed by a launch script with --cfg job")
    src.add_argument("--script", help="a launch script (scripts/*.sh): run with --cfg job to compose its config")
    p.add_argument("--model", required=True, help=f"HF folder, config.json, or one of {sorted(PRESETS)}")
    p.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (H100: 80)")
    p.add_argument("--json", default=None, help="also write the table here")
    a = p.parse_args(argv)
    import yaml

    text = _compose(a.script) if a.script else Path(a.job).read_text()
    job = yaml.safe_load("\n".join(ln for ln in text.splitlines() if not ln.startswith("Switched to")))
    if not isinstance(job, dict) or "actor_rollout_ref" not in job:
        raise SystemExit(f"{a.script or a.job}: no composed job config (the output of a launch script run with "
                         "--cfg job, e.g. ACTOR_MODEL_PATH=... SAVE_PATH=... bash scripts/ARPO_7B_Reasoning_1node.sh --cfg job)")
    m, j = model_shape(a.model), job_shape(job)
    gpu = int(a.gpu_gib * GIB)
    table = estimate(m, j, gpu)
    print(render(m, j, table, gpu))
    if a.json:
        Path(a.json).write_text(json.dumps(dict(model=vars(m), job=vars(j), bytes=table), indent=2))
    return table


if __name__ == "__main__":
    main()
