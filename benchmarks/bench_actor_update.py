"""The actor update and the log-prob pass against a bare PyTorch loop, lever by lever, on the CPU or a GPU.

Same model, same tokens, same device: a batch of `--rows` trajectories (groups of 4 rows sharing a
prompt of 140–190 tokens, responses 40–`--response_max`), one optimizer step over it, then one
log-prob pass over it.

- ours: `DataParallelPPOActor.update_policy` and `.compute_log_prob` — the class the FSDP worker
  runs — on a model built by the worker's own `init_sharded_model` + `shard_fsdp2` (one rank: gloo
  on the CPU, `cpu:gloo,cuda:nccl` on a GPU), with the worker's precision policy
  (`fsdp_mixed_precision`), token-budget micro-batches, and `--threads` torch threads on the CPU;
- bare: the loop a user would write: the HF model in fp32, AdamW (fused on CUDA), the same
  micro-batches padded, loss = −mean(A·log p), bf16 autocast when the precision is bf16; its
  log-prob pass is a no-grad forward and a log-softmax.

The model: `--model DIR`, or `--shape qwen2.5-0.5b | qwen2.5-1.5b | tiny` — a random-weight model of
that shape written once to a temporary folder (nothing downloads weights). On CUDA every case is bf16
(ours: FSDP2 mixed precision; bare: autocast) without activation checkpointing, and the cases are the
attention paths: padded sdpa, packed sdpa (transformers' dense N × N block mask), packed
flex_attention (block-sparse), and packed + prefix sharing under sdpa and flex_attention.

Each case runs in a fresh subprocess (1 warm-up step, then `--steps` timed, median) and reports
trained tokens/s (real tokens only), model TFLOP/s and MFU (`model_flops`: the rows' own work,
whatever a path skips or repeats; MFU where the device's bf16 peak is known), and peak memory (CUDA:
`max_memory_allocated`; CPU: peak RSS), for the update and, in its own columns, the log-prob pass.
Beside the speed, each case records the log-prob pass's mean over the response tokens and the first
update's gradient norm, both at the same initial weights: every path must agree on them (to bf16
rounding), which checks a kernel the CPU cannot run (FlexAttention's backward) where it runs.

    python benchmarks/bench_actor_update.py [--model DIR | --shape NAME] [--device cuda] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))   # runs from a checkout without installing the package (a GPU node)

SHAPES = {  # Qwen2.5's shapes (config.json of the released models); tiny for the CPU smoke
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=128),
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.0, "H20": 148.0,
                    "A100": 312.0, "L40S": 362.0, "A10": 125.0}
"""Dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity; H100/H200 are the SXM parts),
matched against the device name, the longest name first ("H100 PCIe" before "H100", "H200" before "H20")."""

CPU_CASES = [  # label, who, precision, checkpointing, packing, prefix sharing, attention
    ("fp32, checkpointing", "ours", "fp32", True, False, False, "sdpa"),
    ("fp32, checkpointing", "bare", "fp32", True, False, False, "sdpa"),
    ("fp32, no checkpointing", "ours", "fp32", False, False, False, "sdpa"),
    ("fp32, no checkpointing", "bare", "fp32", False, False, False, "sdpa"),
    ("bf16 params (FSDP mixed precision), no checkpointing", "ours", "bf16", False, False, False, "sdpa"),
    ("bf16 autocast, no checkpointing", "bare", "bf16", False, False, False, "sdpa"),
    ("bf16, no checkpointing, packing", "ours", "bf16", False, True, False, "sdpa"),
    ("bf16, no checkpointing, packing + prefix sharing (the quickstart)", "ours", "bf16", False, True, True, "sdpa"),
]
CUDA_CASES = [
    ("bf16, padded, sdpa", "bare", "bf16", False, False, False, "sdpa"),
    ("bf16, padded, sdpa", "ours", "bf16", False, False, False, "sdpa"),
    ("bf16, packed, sdpa (dense block mask)", "ours", "bf16", False, True, False, "sdpa"),
    ("bf16, packed, flex_attention", "ours", "bf16", False, True, False, "flex_attention"),
    ("bf16, packed + prefix sharing, sdpa", "ours", "bf16", False, True, True, "sdpa"),
    ("bf16, packed + prefix sharing, flex_attention", "ours", "bf16", False, True, True, "flex_attention"),
]


def _batch(vocab: int, rows: int, response_max: int = 288, n: int = 4, seed: int = 0):
    import torch

    from verl_arpo.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    P, R = 192, response_max
    plen = torch.randint(140, 190, (rows,), generator=g)
    rlen = torch.randint(min(40, R), R + 1, (rows,), generator=g)
    ids = torch.randint(10, vocab, (rows, P + R), generator=g)
    for i in range(rows):  # rows of a group share their prompt, as the rollout's n samples do
        plen[i], ids[i, :P] = plen[i - i % n], ids[i - i % n, :P]
    attn = torch.zeros(rows, P + R, dtype=torch.long)
    for i in range(rows):
        attn[i, P - plen[i]:P + rlen[i]] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    mask = attn[:, P:].float()
    adv = torch.randn(rows, 1, generator=g).expand(rows, R) * mask
    return DataProto.from_dict(tensors=dict(input_ids=ids, attention_mask=attn, position_ids=pos, responses=ids[:, P:],
                                            response_mask=mask, advantages=adv.contiguous()))


def model_flops(config, row_lengths, passes: int, scored: int | None = None) -> float:
    """FLOPs of `passes` × (forward) over the rows, counted per row as a plain loop does them:
    2 · (attention and MLP projection parameters) per token, 2 · lm_head parameters per scored token
    (`scored`: the positions whose logits are computed, default every token), plus causal attention
    2 · 2 · L · (heads · head_dim) · S(S+1)/2 per row of S tokens (QKᵀ and PV). A training step is
    passes = 3 (forward + backward), a log-prob pass 1."""
    h, L, inter, V = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_dim, kv_dim = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    body = L * (h * q_dim * 2 + h * kv_dim * 2 + 3 * h * inter)
    tokens = sum(row_lengths)
    scored = tokens if scored is None else scored
    attention = sum(2 * 2 * L * q_dim * s * (s + 1) / 2 for s in row_lengths)
    return passes * (2 * body * tokens + 2 * h * V * scored + attention)


def peak_tflops(device_name: str) -> float | None:
    return next((PEAK_BF16_TFLOPS[k] for k in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True) if k in device_name),
                None)


def child(spec: dict) -> dict:
    import torch

    cuda = spec["device"] == "cuda"
    if not cuda:
        torch.set_num_threads(int(spec["threads"]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    from transformers import AutoConfig

    from verl_arpo.config import Batching

    config = AutoConfig.from_pretrained(spec["model"])
    data = _batch(config.vocab_size, int(spec["rows"]), int(spec["response_max"]))
    row_lengths = data.batch["attention_mask"].sum(-1).tolist()
    scored = int(data.batch["response_mask"].sum())   # the logits both sides compute (logits_to_keep)
    tokens = int(sum(row_lengths))
    bf16 = spec["precision"] == "bf16"
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(0)
    budget = int(spec["micro_tokens"])
    if spec["who"] == "ours":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from verl_arpo.config import ActorConfig, MixedPrecisionConfig, OptimConfig
        from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
        from verl_arpo.workers.optim_step import build_adamw
        from verl_arpo.workers.sharded_model import (fsdp_mixed_precision, init_sharded_model, load_causal_lm,
                                                     shard_fsdp2)

        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        mp = fsdp_mixed_precision(MixedPrecisionConfig(param_dtype="bfloat16", reduce_dtype="float32") if bf16 else None,
                                  device.type)
        kw = dict(gradient_checkpointing=bool(spec["checkpointing"]), attn=spec["attn"])
        model = init_sharded_model(lambda: load_causal_lm(spec["model"], **kw),
                                   lambda: load_causal_lm(spec["model"], empty=True, **kw),
                                   lambda m: shard_fsdp2(m, mesh, mp_policy=mp), device)
        opt = build_adamw(model.parameters(), OptimConfig(lr=1e-6))
        update = Batching(micro_batch=len(data), use_dynamic_bsz=True, max_token_len=budget,
                          mini_batch=len(data))   # one worker, one mini-batch of token-budget micro-batches
        actor = DataParallelPPOActor(ActorConfig(grad_clip=1.0), model, opt, update=update, device=device,
                                     use_remove_padding=bool(spec["packing"]), use_prefix_sharing=bool(spec["sharing"]),
                                     on_policy=True)  # no old_log_probs: π_old is the update's forward
        scoring = Batching(micro_batch=len(data), use_dynamic_bsz=True, max_token_len=budget)

        def step():
            return actor.update_policy(data)["actor/grad_norm"][-1]

        def log_prob_pass():
            return actor.compute_log_prob(data, scoring, calculate_entropy=True)[0]
    else:
        from transformers import AutoModelForCausalLM

        from verl_arpo.utils.seqlen_balancing import split_micro_batches
        from verl_arpo.workers.sharded_model import enable_activation_checkpointing

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                     attn_implementation=spec["attn"]).to(device)
        if spec["checkpointing"]:
            enable_activation_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
        micros = [{k: v.to(device) for k, v in mb.items()}
                  for mb in split_micro_batches(data.batch, True, None, budget)[0]]
        n_resp = float(data.batch["response_mask"].sum())

        def forward_log_probs(mb):
            R = mb["responses"].shape[1]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                               position_ids=mb["position_ids"], logits_to_keep=R + 1).logits[:, :-1]
            return torch.log_softmax(logits.float(), -1).gather(-1, mb["responses"][..., None])[..., 0]

        def step():
            model.train()
            for mb in micros:
                loss = -(forward_log_probs(mb) * mb["advantages"] * mb["response_mask"]).sum() / n_resp
                loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(norm)

        def log_prob_pass():
            model.eval()
            with torch.no_grad():
                return sum((forward_log_probs(mb) * mb["response_mask"]).sum().item() for mb in micros)

    def timed(fn, reps: int) -> tuple[float, float, object]:
        """Median seconds of `reps` calls after one warm-up, the peak memory (bytes) of the timed calls,
        and what the first call returned (before any update of the timed ones)."""
        first = fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
        else:
            from verl_arpo.workers.host_memory import HOST_MEMORY

            # the process's peak since start: our update resets the kernel's VmHWM at its phase
            # boundaries, HOST_MEMORY's window keeps what each reset saw
            peak = HOST_MEMORY.take_window_peak()
        return statistics.median(times), peak, first

    # correctness beside speed: the first step's gradient norm and the log-prob pass's mean over the
    # response tokens agree across paths (to bf16 rounding) when every attention path scores the same
    log_prob_s, log_prob_peak, log_probs = timed(log_prob_pass, int(spec["steps"]))
    step_s, peak, grad_norm = timed(step, int(spec["steps"]))
    if torch.is_tensor(log_probs):
        log_probs = float((log_probs * data.batch["response_mask"]).sum())
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak_tf = peak_tflops(name) if cuda else None
    out = dict(tokens=tokens, device_name=name, grad_norm=float(grad_norm),
               mean_log_prob=log_probs / float(data.batch["response_mask"].sum()), step_s=step_s, tok_per_s=tokens / step_s, peak_mib=peak / 2**20,
               log_prob_s=log_prob_s, log_prob_tok_per_s=tokens / log_prob_s, log_prob_peak_mib=log_prob_peak / 2**20)
    for key, seconds, passes in (("", step_s, 3), ("log_prob_", log_prob_s, 1)):
        tflops = model_flops(config, row_lengths, passes, scored=scored) / seconds / 1e12
        out[f"{key}tflops"] = tflops
        out[f"{key}mfu"] = tflops / peak_tf if peak_tf else None
    return out


def run(spec: dict) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec = {**spec, "port": s.getsockname()[1]}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if spec["device"] == "cpu":
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    out = subprocess.run([sys.executable, __file__, "child", json.dumps(spec)], capture_output=True, text=True,
                         env=env, timeout=spec.get("timeout", 3600))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return {**spec, **json.loads(out.stdout.strip().splitlines()[-1])}


def shape_model(shape: str, folder: Path) -> str:
    """A random-weight model of `shape` (SHAPES) written to `folder`: the speed of a shape needs no weights."""
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(folder, seed=0, max_position_embeddings=32768, **SHAPES[shape])


def summarize(rows: list[dict]) -> list[dict]:
    """Each of our rows against the bare loop of the same precision and checkpointing: the update and the
    log-prob pass, tokens/s and peak memory."""
    from bench_common import summary_entry

    out = []
    for r in rows:
        bare = next((b for b in rows if b["who"] == "bare" and b["precision"] == r["precision"]
                     and b["checkpointing"] == r["checkpointing"]), None)
        if r["who"] != "ours" or bare is None:
            continue
        out.append(summary_entry(f"trained tok/s, ours / bare loop: {r['label']}", r["tok_per_s"], bare["tok_per_s"],
                                 r["tok_per_s"] / bare["tok_per_s"], 1.0 if r["device"] == "cuda" else 0.8,
                                 peak_mib=r["peak_mib"], bare_peak_mib=bare["peak_mib"], mfu=r["mfu"]))
        out.append(summary_entry(f"log-prob tok/s, ours / bare loop: {r['label']}", r["log_prob_tok_per_s"],
                                 bare["log_prob_tok_per_s"], r["log_prob_tok_per_s"] / bare["log_prob_tok_per_s"],
                                 1.0 if r["device"] == "cuda" else 0.8, peak_mib=r["log_prob_peak_mib"],
                                 bare_peak_mib=bare["log_prob_peak_mib"]))
    return out


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="random weights of this shape instead of --model")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rows", type=int, default=None, help="trajectories (default 32 on the CPU, 64 on CUDA)")
    p.add_argument("--response_max", type=int, default=None, help="longest response (default 288 CPU, 1024 CUDA)")
    p.add_argument("--micro_tokens", type=int, default=None, help="token budget of a micro-batch (1536 CPU, 16384 CUDA)")
    p.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 rows, 1 timed step")
    p.add_argument("--cases", default="all", help="comma-separated case numbers (1-based) or all")
    p.add_argument("--out", default=None, help="default benchmarks/results/actor_update[_<device>][_<shape>].json")
    p.add_argument("--case_timeout", type=float, default=3600,
                   help="seconds per case (its own process); a case past it is recorded as failed and the rest run")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    a.rows = a.rows or (64 if cuda else 32)
    a.response_max = a.response_max or (1024 if cuda else 288)
    a.micro_tokens = a.micro_tokens or (16384 if cuda else 1536)
    if a.quick:
        a.rows, a.steps = 8, 1
    if a.model and a.shape:
        p.error("--model and --shape: give one")
    all_cases = CUDA_CASES if cuda else CPU_CASES
    cases = all_cases if a.cases == "all" else [all_cases[int(i) - 1] for i in a.cases.split(",")]
    variant = "".join(f"_{v}" for v in (a.device if cuda else None, a.shape) if v)
    out_path = Path(a.out or ROOT / "benchmarks" / "results" / f"actor_update{variant}.json")
    with tempfile.TemporaryDirectory() as tmp:
        if a.shape:
            model = shape_model(a.shape, Path(tmp) / a.shape)
        elif a.model:
            model = a.model
        else:
            from bench_common import smollm2_dir

            model = smollm2_dir()
        from bench_common import machine_info

        rows, failed = [], []

        def save() -> None:   # after every case: a lease that ends mid-run keeps the cases it measured
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(dict(benchmark="actor_update", args=vars(a), machine=machine_info(),
                                                rows=rows, failed=failed, summary=summarize(rows),
                                                load_avg=list(os.getloadavg())), indent=2))

        for label, who, precision, ckpt, packing, sharing, attn in cases:
            try:
                r = run(dict(model=model, device=a.device, rows=a.rows, response_max=a.response_max,
                             micro_tokens=a.micro_tokens, threads=a.threads, steps=a.steps, who=who,
                             precision=precision, checkpointing=ckpt, packing=packing, sharing=sharing, attn=attn,
                             timeout=a.case_timeout))
            except (RuntimeError, subprocess.TimeoutExpired) as e:   # one path failing (memory, a kernel) is a result
                why = f"timed out after {a.case_timeout:.0f} s" if isinstance(e, subprocess.TimeoutExpired) else str(e)
                failed.append({"who": who, "label": label, "error": why[-3000:]})
                print(f"{who:<5} {label:<58} FAILED: {why.strip().splitlines()[-1] if why.strip() else why}", flush=True)
                save()
                continue
            rows.append({**r, "label": label, "model": a.shape or model})
            mfu = f"  MFU {r['mfu']:.1%}" if r["mfu"] is not None else f"  {r['tflops'] * 1e3:.1f} GFLOP/s"
            print(f"{who:<5} {label:<58} update {r['tok_per_s']:>8.0f} tok/s{mfu}  peak {r['peak_mib']:.0f} MiB | "
                  f"log-prob {r['log_prob_tok_per_s']:>8.0f} tok/s  peak {r['log_prob_peak_mib']:.0f} MiB | "
                  f"mean log p {r['mean_log_prob']:.4f}, grad norm {r['grad_norm']:.4g}", flush=True)
            save()
    print(f"wrote {out_path}")
    if failed:
        sys.exit(f"{len(failed)} of {len(cases)} cases failed: {', '.join(f['label'] for f in failed)}")


if __name__ == "__main__":
    main()
