"""CPU efficiency of our actor update: achieved training FLOP/s as a fraction of the machine's
measured matmul peak, and against a plain PyTorch training loop on the same model and tokens.

- Peak: `torch.mm` of square fp32 and bf16 matrices on 1 thread, best of a few calls, measured
  before, between and after the training runs (median taken); the peak of k single-threaded
  workers is k × that. (The all-core matmul is printed too; on a loaded 2-core box its threads
  wait on cores other jobs hold, so it understates the machine.)
- Ours: `run_ppo` (cpu_tiny preset, 1 worker by default (`--workers 2` for data parallel), FSDP2 on
  gloo, fp32, plain GRPO), achieved FLOP/s =
  6 · params · trained tokens / `timing_s/update_actor` (the update phase only: forward, backward,
  optimizer; the old-log-prob forward and the rollout are not counted). Tokens are the real
  (unpadded) prompt + response tokens; work spent on padding counts against us.
- Plain loop (the baseline a user would write): one process, 1 torch thread (like each of our
  workers; `--plain_threads`), the same HF
  model, the same number of sequences of the same lengths, micro-batches of the same size, AdamW,
  one optimizer step; FLOP/s counted the same way.

Params: unique parameters (a tied embedding counted once: the LM head's matmul). The model is a
random Qwen2 large enough that matmuls dominate (hidden 384, 4 layers by default; `--model` for a
real one). Higher is better for every ratio.

    python benchmarks/bench_cpu_efficiency.py [--quick | --smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (PY, RESULTS, count_params, machine_info, max_prompt_tokens, median, print_table,  # noqa: E402
                          prompt_rows, run_child, run_ours, steady, summary_entry, tail, tiny_model, tmpdir,
                          write_json, write_parquet)


def matmul_peak(dtype: str, threads: int, n: int = 1024, calls: int = 5) -> float:
    """Best FLOP/s of n×n @ n×n in `dtype` with `threads` torch threads (this process)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    torch.mm(a, b)   # warm-up
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return 2 * n**3 / best


def peaks(n: int) -> dict[str, float]:
    cores = os.cpu_count() or 1
    return {"fp32_1t": matmul_peak("float32", 1, n), "bf16_1t": matmul_peak("bfloat16", 1, n),
            "fp32_all": matmul_peak("float32", cores, n), "bf16_all": matmul_peak("bfloat16", cores, n)}


# ---------------------------------------------------------------------------- plain loop (child)
def _child_plain(spec_path: str, out_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("plain_threads"):
        torch.set_num_threads(int(spec["plain_threads"]))
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    rows = json.loads(Path(spec["rows_json"]).read_text())
    seqs = []
    g = torch.Generator().manual_seed(0)
    for r in rows[:spec["prompts"]]:
        ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for _ in range(spec["n"]):
            resp = torch.randint(3, len(tok), (spec["response_length"],), generator=g).tolist()
            seqs.append(ids + resp)
    times, tokens = [], sum(map(len, seqs))
    micro = spec.get("micro", 4)
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i in range(0, len(seqs), micro):
            batch = seqs[i:i + micro]
            width = max(map(len, batch))
            ids = torch.tensor([[tok.pad_token_id] * (width - len(s)) + s for s in batch])
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in batch])
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum() * (len(batch) / len(seqs))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    Path(out_path).write_text(json.dumps({"update_s": times, "tokens": tokens, "threads": torch.get_num_threads()}))


def run_plain(spec: dict, tmp: Path, tag: str) -> dict:
    d = tmp / f"plain_{tag}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.json").write_text(json.dumps(spec))
    res = run_child([PY, str(Path(__file__)), "--_child", "plain", str(d / "spec.json"), str(d / "out.json")], 1800,
                    log=d / "log.txt")
    if res["rc"] != 0:
        raise RuntimeError(f"plain loop failed:\n{tail(d / 'log.txt')}")
    return json.loads((d / "out.json").read_text())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: random Qwen2 hidden 384, 4 layers)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response_length", type=int, default=32)
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2, help="runs of ours and of the plain loop, interleaved")
    p.add_argument("--matmul_n", type=int, default=1024)
    p.add_argument("--plain_threads", type=int, default=1, help="torch threads of the plain loop (0 = default)")
    p.add_argument("--workers", type=int, default=1,
                   help="our Ray workers (1 thread each). Default 1: the same one core as the plain loop, so the "
                        "comparison is the framework's overhead, not how a loaded machine shares its cores")
    p.add_argument("--quick", action="store_true", help="1 repetition")
    p.add_argument("--smoke", action="store_true", help="small model, 1 repetition, 2 steps (tests)")
    p.add_argument("--out", default=str(RESULTS / "cpu_efficiency.json"))
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        return _child_plain(a._child[1], a._child[2])
    if a.quick:
        a.reps = 1
    if a.smoke:
        a.reps, a.steps, a.hidden, a.layers, a.response_length, a.matmul_n = 1, 2, 128, 2, 16, 512
    t_start, load0 = time.time(), os.getloadavg()
    tmp = tmpdir("bench_cpu_eff_")
    model = a.model or tiny_model(tmp, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                  num_attention_heads=max(2, a.hidden // 64), num_key_value_heads=max(1, a.hidden // 128),
                                  intermediate_size=a.hidden * 3)
    n_params = count_params(model)
    rows = prompt_rows(a.prompts * a.steps)
    data = write_parquet(rows, tmp / "train.parquet")
    (tmp / "rows.json").write_text(json.dumps(rows))
    spec = {"model": model, "data": str(data), "rows_json": str(tmp / "rows.json"), "prompts": a.prompts, "n": a.n,
            "response_length": a.response_length, "max_prompt_length": max_prompt_tokens(model, rows),
            "steps": a.steps, "micro": 4, "workers": a.workers, "plain_threads": a.plain_threads}
    peak_runs, ours_flops, plain_flops, ours_runs, plain_runs = [peaks(a.matmul_n)], [], [], [], []
    for rep in range(a.reps):
        for side in (("ours", "plain") if rep % 2 == 0 else ("plain", "ours")):
            if side == "ours":
                r = run_ours(spec, tmp, f"r{rep}")
                s = steady(r["steps"])
                ours_runs.append(r)
                ours_flops.append(6 * n_params * sum(x["tokens"] for x in s) / sum(x["update_s"] for x in s))
            else:
                r = run_plain(spec, tmp, f"r{rep}")
                plain_runs.append(r)
                ups = r["update_s"][1:] or r["update_s"]
                plain_flops.append(6 * n_params * r["tokens"] / statistics.median(ups))
            peak_runs.append(peaks(a.matmul_n))
    pk = {k: median(x[k] for x in peak_runs) for k in peak_runs[0]}
    ours, plain = median(ours_flops), median(plain_flops)
    W, T = spec["workers"], plain_runs[0]["threads"]
    # the peak a trainer could reach with k single-threaded cores: k × the 1-thread matmul peak
    # (the all-core matmul is also shown; on a loaded box its threads wait on busy cores)
    ours_fp32, ours_bf16 = W * pk["fp32_1t"], W * pk["bf16_1t"]
    plain_fp32, plain_bf16 = T * pk["fp32_1t"], T * pk["bf16_1t"]
    G = 1e9
    nc = os.cpu_count()
    rows_t = [{"what": "matmul peak fp32, 1 thread", "GFLOP_s": pk["fp32_1t"] / G},
              {"what": "matmul peak bf16, 1 thread", "GFLOP_s": pk["bf16_1t"] / G},
              {"what": f"matmul fp32, {nc} threads (for reference)", "GFLOP_s": pk["fp32_all"] / G},
              {"what": f"matmul bf16, {nc} threads (for reference)", "GFLOP_s": pk["bf16_all"] / G},
              {"what": f"ours: actor update ({W} worker{'s' if W > 1 else ''} x 1 thread, fp32)", "GFLOP_s": ours / G,
               "peak_fp32_GFLOP_s": ours_fp32 / G, "of_fp32_peak": ours / ours_fp32, "of_bf16_peak": ours / ours_bf16},
              {"what": f"plain PyTorch loop (1 proc x {T} thread{'s' if T > 1 else ''}, fp32)", "GFLOP_s": plain / G,
               "peak_fp32_GFLOP_s": plain_fp32 / G, "of_fp32_peak": plain / plain_fp32,
               "of_bf16_peak": plain / plain_bf16}]
    eff_ratio = (ours / ours_fp32) / (plain / plain_fp32)
    tokens = steady(ours_runs[0]["steps"])[0]["tokens"]
    print(f"\nmodel: {a.model or f'random Qwen2 h{a.hidden} {a.layers}L'}, {n_params / 1e6:.2f}M params; "
          f"{a.prompts}x{a.n} sequences, ~{tokens:.0f} tokens/step; {a.reps} rep(s); peaks measured {len(peak_runs)}x")
    text = print_table(rows_t, ["what", "GFLOP_s", "peak_fp32_GFLOP_s", "of_fp32_peak", "of_bf16_peak"])
    print(f"fraction of peak, ours / plain loop (per core): {eff_ratio:.2f}")
    summary = [
        summary_entry(f"actor-update FLOP/s / fp32 matmul peak ({W} core{'s' if W > 1 else ''} x 1-thread peak)", ours / G, ours_fp32 / G,
                      ours / ours_fp32, 0.3),
        summary_entry(f"actor-update FLOP/s / bf16 matmul peak ({W} core{'s' if W > 1 else ''} x 1-thread peak)", ours / G, ours_bf16 / G,
                      ours / ours_bf16, None),
        summary_entry("fraction of fp32 peak per core, ours / plain PyTorch training loop", ours / ours_fp32,
                      plain / plain_fp32, eff_ratio, 0.8),
    ]
    write_json(a.out, {"benchmark": "cpu_efficiency", "args": {k: v for k, v in vars(a).items() if k != "_child"},
                       "params": n_params, "peaks_flops": pk, "peak_runs": peak_runs, "ours_flops": ours_flops,
                       "plain_flops": plain_flops, "rows": rows_t, "table": text, "summary": summary,
                       "ours_runs": ours_runs, "plain_runs": plain_runs,
                       "machine": {**machine_info(), "load_avg_start": list(load0), "load_avg_end": list(os.getloadavg())},
                       "seconds": time.time() - t_start})
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
