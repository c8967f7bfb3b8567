"""Training forward + backward through `response_forward` (cuDNN attention off on CUDA) against
PyTorch's default SDPA kernel choice (cuDNN on Hopper in bf16). Without activation checkpointing
(off by default), so the backward runs the kernels its forward chose.

Why: on an H200 the rollout's decoding spent 67% of its CPU time planning cuDNN attention, one plan
per new shape (docs/gpu.md, "Verify on your GPU"); the HF engine now decodes with cuDNN's kernel
off. Training micro-batches change shape too (every micro-batch has its own lengths): the actor's,
critic's and SFT's forwards run under the same guard (`verl_arpo.utils.device.without_cudnn_attention`),
and this measures what that buys. The baseline is the same function with the guard replaced by a
no-op (what PyTorch picks by itself).

Workload: `response_forward` (the function the actor and critic run per micro-batch) on a random
Qwen2 model (default: gpu_check's 0.25 GB one, 4 layers, hidden 1024), `--micro` micro-batches of
`--rows` rows whose prompt and response lengths are drawn afresh for each micro-batch, then a
backward of the summed log-probabilities of the response tokens. Pass 1 meets every shape for the
first time; pass 2 repeats the same micro-batches (shapes seen before). Cases, each in a fresh
subprocess (so no case inherits another's plans): padded and packed layouts × PyTorch's default
kernels and ours. On the CPU the guard is a no-op (the two cases must then give the same losses).

Reports median ms per micro-batch for each pass, the ratio default / ours in the same run,
which attention kernels the profiler saw, the largest loss difference between the kernel choices
and peak device (or process) memory.

    python benchmarks/bench_train_attention.py [--device cuda] [--quick]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))   # runs from a checkout without installing the package (a GPU node)

CASES = [("padded", "default"), ("padded", "ours"), ("packed", "default"), ("packed", "ours")]


def _micro_batches(vocab: int, n_micro: int, rows: int, max_prompt: int, max_response: int, seed: int):
    """Left-padded prompts + right-padded responses, as the rollout hands them to the actor."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        P = int(torch.randint(max_prompt // 2, max_prompt + 1, (1,), generator=g))
        R = int(torch.randint(max_response // 4, max_response + 1, (1,), generator=g))
        plen = torch.randint(P // 2, P + 1, (rows,), generator=g)
        rlen = torch.randint(max(1, R // 4), R + 1, (rows,), generator=g)
        ids = torch.randint(10, vocab, (rows, P + R), generator=g)
        attn = torch.zeros(rows, P + R, dtype=torch.long)
        for i in range(rows):
            attn[i, P - plen[i]:P + rlen[i]] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out.append(dict(input_ids=ids, attention_mask=attn, position_ids=pos, responses=ids[:, P:]))
    return out


def child(spec: dict) -> dict:
    import contextlib
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from verl_arpo.workers import training_core
    from verl_arpo.workers.training_core import response_forward

    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype, attn_implementation="sdpa").to(device)
    model.train()
    micros = _micro_batches(model.config.vocab_size, spec["micro"], spec["rows"], spec["max_prompt"],
                            spec["max_response"], spec["seed"])
    packed = spec["layout"] == "packed"
    if spec["kernels"] == "default":   # the baseline: PyTorch's own kernel choice
        training_core.without_cudnn_attention = lambda device: contextlib.nullcontext()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(m) -> float:
        m = {k: v.to(device) for k, v in m.items()}
        R = m["responses"].shape[1]
        out = response_forward(model, m, R, use_remove_padding=packed)
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        labels = out.labels(m["responses"])
        picked = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        loss = -out.to_slots(picked).sum() / out.keep.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss)

    warm = _micro_batches(model.config.vocab_size, 1, 1, 8, 8, seed=12345)[0]
    step(warm)   # kernels and allocator, on a shape no timed micro-batch has
    kernels: set[str] = set()
    with torch.profiler.profile() as prof:   # which attention kernel runs (one extra micro-batch)
        step(_micro_batches(model.config.vocab_size, 1, spec["rows"], spec["max_prompt"], spec["max_response"],
                            seed=999)[0])
    for ev in prof.key_averages():
        if "attention" in ev.key.lower() and ev.key.startswith("aten::_"):
            kernels.add(ev.key)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    passes, losses = [], []
    for _ in range(2):
        times = []
        for m in micros:
            sync()
            t0 = time.perf_counter()
            losses.append(step(m))
            sync()
            times.append(time.perf_counter() - t0)
        passes.append(times)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return dict(pass1_ms=[t * 1e3 for t in passes[0]], pass2_ms=[t * 1e3 for t in passes[1]],
                losses=losses[:len(micros)], kernels=sorted(kernels), peak_mib=peak,
                tokens=[int(m["attention_mask"].sum()) for m in micros])


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(Path(sys.argv[2]).read_text()))))
        return
    from bench_common import machine_info, print_table, run_case, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--model", default=None, help="HF folder (default: a random Qwen2 written by gpu_check's builder)")
    p.add_argument("--micro", type=int, default=12)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--max_prompt", type=int, default=512)
    p.add_argument("--max_response", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 micro-batches of 2 short rows")
    p.add_argument("--out", default=None, help="default: benchmarks/results/gpu_check/train_attention_DEVICE.json")
    a = p.parse_args(argv)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.out = a.out or str(ROOT / "benchmarks" / "results" / "gpu_check" / f"train_attention_{device}.json")
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model
        if model is None:
            from verl_arpo.utils.tiny_model import make_tiny_model

            if a.quick:
                model = make_tiny_model(Path(tmp) / "model", seed=0)
            else:
                model = make_tiny_model(Path(tmp) / "model", seed=0, hidden_size=1024, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=2, intermediate_size=4096)
        if a.quick:
            a.micro, a.rows, a.max_prompt, a.max_response = 3, 2, 24, 32
        results = {}
        for layout, kernels in CASES:
            spec = dict(model=str(model), device=device, layout=layout, kernels=kernels, micro=a.micro,
                        rows=a.rows, max_prompt=a.max_prompt, max_response=a.max_response, seed=a.seed)
            results[f"{layout}/{kernels}"] = run_case(__file__, spec)
    table = []
    for layout in ("padded", "packed"):
        base, off = results[f"{layout}/default"], results[f"{layout}/ours"]
        diff = max(abs(x - y) for x, y in zip(base["losses"], off["losses"]))
        for kernels, r in (("PyTorch default", base), ("ours (cuDNN off)", off)):
            p1, p2 = statistics.median(r["pass1_ms"]), statistics.median(r["pass2_ms"])
            table.append({"layout": layout, "kernels": kernels, "new shapes ms": p1, "seen shapes ms": p2,
                          "default / this (new)": statistics.median(base["pass1_ms"]) / p1,
                          "attention ops": ",".join(k.replace("aten::_", "") for k in r["kernels"]),
                          "max |Δ loss|": diff, "peak MiB": r["peak_mib"]})
    print_table(table, list(table[0]), title=f"training forward + backward per micro-batch on {device}: "
                f"{a.micro} micro-batches x {a.rows} rows, prompt <= {a.max_prompt}, response <= {a.max_response}")
    write_json(a.out, dict(benchmark="train_attention", device=device, args={**vars(a), "model": a.model},
                           machine=machine_info(), table=table, runs=results))


if __name__ == "__main__":
    main()
