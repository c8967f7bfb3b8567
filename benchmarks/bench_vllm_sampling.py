"""What the branch rule's statistics cost vLLM (docs/gpu.md, "Rollout statistics"): tokens/s of one batch of
rounds with top-k log-probs at every position (the baseline, as before), only in the first
`entropy_window` positions (a round is then two calls), and none; and per-request seeds on/off.

vLLM computes, serialises and detokenizes the top-k of every position it is asked for; the branch
rule reads `entropy_window` (20) of them per round. Interleaved repetitions, medians, same process.

    python benchmarks/bench_vllm_sampling.py [--requests 32] [--tokens 200] [--window 20] [--reps 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--model", default=None, help="HF folder (default: the tiny model, hidden 128)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_sampling.json"))
    a = p.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm is not installed (bash scripts/test.sh --setup-only --vllm): nothing to measure")
        return
    from transformers import AutoTokenizer

    from verl_arpo.utils.tiny_model import make_tiny_model
    from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
    from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine

    model = a.model or make_tiny_model(tempfile.mkdtemp(prefix="bench_vllm_"), seed=0, hidden_size=128,
                                       intermediate_size=256)
    tok = AutoTokenizer.from_pretrained(model)
    eng = VLLMEngine(model, tok, dtype="float32", max_model_len=1024, seed=0, full_entropy_max_vocab=0)
    prompt = tok.encode("Who founded the town of Veltmoor?")
    base = SamplingParams(temperature=1.0, logprobs_topk=a.topk, full_entropy=False)
    cases = {
        "top-k every position (baseline)": (base, True),
        f"top-k in the first {a.window}": (dataclasses.replace(base, stats_window=a.window), True),
        "no statistics": (dataclasses.replace(base, logprobs_topk=0), True),
        f"top-k in the first {a.window}, no request seeds": (dataclasses.replace(base, stats_window=a.window), False),
    }

    def run(sp, seeded):
        reqs = [GenRequest(f"r{i}", list(prompt), a.tokens, [], sp, seed=i if seeded else None)
                for i in range(a.requests)]
        t = time.perf_counter()
        outs = eng.generate(reqs)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)

    run(base, True)  # warm-up
    rates = {k: [] for k in cases}
    for _ in range(a.reps):
        for k, (sp, seeded) in cases.items():
            rates[k].append(run(sp, seeded))
    med = {k: statistics.median(v) for k, v in rates.items()}
    ref = med["top-k every position (baseline)"]
    print(f"vLLM sampling statistics: {a.requests} requests x {a.tokens} tokens, top-k {a.topk}")
    print(f"{'case':<48}{'tokens/s':>10}{'x baseline':>12}")
    for k, v in med.items():
        print(f"{k:<48}{v:>10.0f}{v / ref:>12.2f}")
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_common import summary_entry

    win = f"top-k in the first {a.window}"
    summary = [summary_entry(f"vLLM-CPU rollout tok/s, top-k only in the entropy window ({a.window}) vs at every position",
                             med[win], ref, med[win] / ref, None),
               summary_entry("vLLM-CPU rollout tok/s, no per-request seeds vs seeds (window on)",
                             med[f"{win}, no request seeds"], med[win], med[f"{win}, no request seeds"] / med[win], None)]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(dict(benchmark="vllm_sampling", args=vars(a), tokens_per_s=med,
                                           ratio={k: v / ref for k, v in med.items()}, summary=summary), indent=2))


if __name__ == "__main__":
    main()
