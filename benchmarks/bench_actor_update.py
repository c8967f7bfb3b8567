"""The actor update against a bare PyTorch training loop, lever by lever (the CPU training step).

Same model, same tokens, same cores: a batch of `--rows` trajectories shaped like the quickstart's
(groups of `--n` rows sharing a prompt of ≈ 160 tokens, responses 40–280), one optimizer step over it.

- ours: `DataParallelPPOActor.update_policy` — the class the FSDP worker runs — on a model built by the
  worker's own `init_sharded_model` + `shard_fsdp2` (one gloo rank), with the worker's precision
  policy (`fsdp_mixed_precision`), token-budget micro-batches, and `--threads` torch threads;
- bare: the loop a user would write: the HF model, AdamW, the same micro-batches (padded), loss =
  −mean(A·log p), bf16 autocast when the precision is bf16.

Each case runs in a fresh subprocess (1 warm-up step, then `--steps` timed, median) and reports
trained tokens/s (real tokens only) and peak RSS. Cases alternate ours/bare.

    python benchmarks/bench_actor_update.py [--model DIR] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _batch(vocab: int, rows: int, n: int = 4, seed: int = 0):
    import torch

    from verl_arpo.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    P, R = 192, 288
    plen = torch.randint(140, 190, (rows,), generator=g)
    rlen = torch.randint(40, R + 1, (rows,), generator=g)
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


def child(spec: dict) -> dict:
    import torch

    torch.set_num_threads(int(spec["threads"]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(spec["model"]).vocab_size
    data = _batch(vocab, int(spec["rows"]))
    tokens = int(data.batch["attention_mask"].sum())
    bf16 = spec["precision"] == "bf16"
    if spec["who"] == "ours":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from verl_arpo.config import ActorConfig, Batching, OptimConfig
        from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor
        from verl_arpo.workers.optim_step import build_adamw
        from verl_arpo.workers.sharded_model import (fsdp_mixed_precision,
            init_sharded_model,
            load_causal_lm,
            shard_fsdp2)

        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        mp = fsdp_mixed_precision({"param_dtype": "bfloat16", "reduce_dtype": "float32"} if bf16 else None, "cpu")
        kw = dict(gradient_checkpointing=bool(spec["checkpointing"]))
        model = init_sharded_model(lambda: load_causal_lm(spec["model"], **kw),
                                   lambda: load_causal_lm(spec["model"], empty=True, **kw),
                                   lambda m: shard_fsdp2(m, mesh, mp_policy=mp), torch.device("cpu"))
        opt = build_adamw(model.parameters(), OptimConfig(lr=1e-6))
        update = Batching(micro_batch=len(data), use_dynamic_bsz=True, max_token_len=int(spec["micro_tokens"]),
                          mini_batch=len(data))   # one worker, one mini-batch of token-budget micro-batches
        actor = DataParallelPPOActor(ActorConfig(grad_clip=1.0), model, opt, update=update,
                                     use_remove_padding=bool(spec["packing"]), use_prefix_sharing=bool(spec["sharing"]),
                                     on_policy=True)  # no old_log_probs: π_old is the update's forward

        def step():
            actor.update_policy(data)
    else:
        from transformers import AutoModelForCausalLM

        from verl_arpo.utils.seqlen_balancing import split_micro_batches
        from verl_arpo.workers.sharded_model import enable_activation_checkpointing

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        if spec["checkpointing"]:
            enable_activation_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        batch = data.batch
        micros, _ = split_micro_batches(batch, True, None, int(spec["micro_tokens"]))
        n_resp = float(batch["response_mask"].sum())

        def step():
            model.train()
            for mb in micros:
                R = mb["responses"].shape[1]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                   position_ids=mb["position_ids"], logits_to_keep=R + 1).logits[:, :-1]
                logp = torch.log_softmax(logits.float(), -1).gather(-1, mb["responses"][..., None])[..., 0]
                loss = -(logp * mb["advantages"] * mb["response_mask"]).sum() / n_resp
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

    times = []
    for i in range(1 + int(spec["steps"])):
        t = time.perf_counter()
        step()
        if i >= 1:
            times.append(time.perf_counter() - t)
    from verl_arpo.workers.host_memory import HOST_MEMORY

    # the process's peak since start: our update resets the kernel's VmHWM at its phase
    # boundaries, HOST_MEMORY's window keeps what each reset saw
    peak = HOST_MEMORY.take_window_peak()
    return dict(tokens=tokens, step_s=statistics.median(times), tok_per_s=tokens / statistics.median(times),
                peak_rss_mib=peak / 2**20)


def run(spec: dict) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        spec = {**spec, "port": s.getsockname()[1]}
    out = subprocess.run([sys.executable, __file__, "child", json.dumps(spec)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(spec["threads"])},
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return {**spec, **json.loads(out.stdout.strip().splitlines()[-1])}


CASES = [  # (label, who, precision, checkpointing, packing, prefix sharing)
    ("fp32, checkpointing", "ours", "fp32", True, False, False),
    ("fp32, checkpointing", "bare", "fp32", True, False, False),
    ("fp32, no checkpointing", "ours", "fp32", False, False, False),
    ("fp32, no checkpointing", "bare", "fp32", False, False, False),
    ("bf16 params (FSDP mixed precision), no checkpointing", "ours", "bf16", False, False, False),
    ("bf16 autocast, no checkpointing", "bare", "bf16", False, False, False),
    ("bf16, no checkpointing, packing", "ours", "bf16", False, True, False),
    ("bf16, no checkpointing, packing + prefix sharing (the quickstart)", "ours", "bf16", False, True, True),
]


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--micro_tokens", type=int, default=1536)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 rows, 1 timed step")
    p.add_argument("--cases", default="all", help="comma-separated case numbers (1-based) or all")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "actor_update.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.steps = 8, 1
    model = a.model
    if model is None:
        from bench_common import smollm2_dir

        model = smollm2_dir()
    cases = CASES if a.cases == "all" else [CASES[int(i) - 1] for i in a.cases.split(",")]
    rows = []
    for label, who, precision, ckpt, packing, sharing in cases:
        r = run(dict(model=model, rows=a.rows, micro_tokens=a.micro_tokens, threads=a.threads, steps=a.steps,
                     who=who, precision=precision, checkpointing=ckpt, packing=packing, sharing=sharing))
        rows.append({**r, "label": label})
        print(f"{who:<5} {label:<55} {r['tok_per_s']:>8.0f} tok/s  step {r['step_s']:.1f} s  "
              f"peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    from bench_common import summary_entry

    summary = []   # each of our rows against the bare loop of the same precision and checkpointing
    for r in rows:
        bare = next((b for b in rows if b["who"] == "bare" and b["precision"] == r["precision"]
                     and b["checkpointing"] == r["checkpointing"]), None)
        if r["who"] == "ours" and bare is not None:
            summary.append(summary_entry(f"trained tok/s, ours / bare loop: {r['label']}", r["tok_per_s"],
                                         bare["tok_per_s"], r["tok_per_s"] / bare["tok_per_s"], 0.8))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(benchmark="actor_update", args=vars(a), rows=rows, summary=summary,
                                           load_avg=list(os.getloadavg())), indent=2))


if __name__ == "__main__":
    main()
