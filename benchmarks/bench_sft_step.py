"""The SFT step without the padding mask, against the step with it measured in the same run.

The quickstart's SFT (issue 47: ~23% of its time) trains right-padded micro-batches (`main_sft.collate`).
Under a causal model the pads come after every real position, so the causal mask alone hides them:
without the padding mask SDPA runs its causal kernel, which skips the blocks above the diagonal
(docs/performance.md, "SFT attention without a padding mask": checked at 4 seeds, worse, not taken).
Cases, each in its own fresh process, alternated over `--reps` repetitions:

- `padding mask` (the baseline): `main_sft.run_sft` as it is;
- `causal only`: the same with no attention mask given to the model;
- `causal only, micro-batches of N` (`--micro2 N`, optional): the same with other micro-batches.

Workload: `main_sft.run_sft` itself on the quickstart's data (`rl_datasets/sft_train.jsonl`), model
(SmolLM2-135M-Instruct; `--quick`: the random tiny model), batch 16, micro-batches of 4, 640 tokens,
bf16 autocast where the CPU computes bf16 natively (else fp32; `--precision`), `--steps` steps of which
the first is warm-up. Reports the median step seconds, the ratio baseline / case, the process's peak
RSS, the first step's loss (the forward is the same bit for bit, so it must be equal) and the last
step's loss.

    python benchmarks/bench_sft_step.py [--steps 5] [--reps 2] [--micro2 8] [--quick]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))


def child(spec_path: str) -> None:
    """One case: run_sft for spec["steps"] steps; prints its JSON as the last line."""
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from verl_arpo.trainer import main_sft

    if not spec["mask"]:   # the lever: no attention mask for the right-padded micro-batches main_sft builds
        with_mask = main_sft.token_nll_sum
        main_sft.token_nll_sum = lambda model, batch: with_mask(model, {**batch, "attention_mask": None})
    overrides = [f"model.partial_pretrain={spec['model']}", f"data.train_files={spec['data']}",
                 f"trainer.default_local_dir={spec['out']}", "optim.lr=1e-4", "data.train_batch_size=16",
                 f"data.micro_batch_size_per_gpu={spec['micro']}", "data.max_length=640", "data.truncation=right",
                 f"trainer.total_training_steps={spec['steps']}", "trainer.device=cpu",
                 *(["model.autocast_dtype=bfloat16"] if spec["precision"] == "bf16" else [])]
    history = main_sft.run_sft(main_sft.load_config(overrides))["history"]
    steps = [h for h in history if "loss" in h]
    print(json.dumps({"step_s": statistics.median(h["seconds"] for h in steps[1:]) if len(steps) > 1 else steps[0]["seconds"],
                      "times": [h["seconds"] for h in steps], "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def summarize(rows: list[dict]) -> list[dict]:
    """Each case against `padding mask` (step seconds; the ratio > 1 is faster)."""
    from bench_common import summary_entry

    base = [r for r in rows if r["label"] == "padding mask"]
    if not base:
        return []
    b = statistics.median(r["step_s"] for r in base)
    out = []
    for label in dict.fromkeys(r["label"] for r in rows if r["label"] != "padding mask"):
        mine = [r for r in rows if r["label"] == label]
        s = statistics.median(r["step_s"] for r in mine)
        out.append(summary_entry(f"SFT step s, {label} (ratio: padding mask / it)", s, b, b / s, 1.0,
                                 peak_mib=max(r["peak_rss_mib"] for r in mine),
                                 bare_peak_mib=max(r["peak_rss_mib"] for r in base),
                                 first_loss_equal=all(r["first_loss"] == base[0]["first_loss"] for r in mine
                                                      if r["micro"] == base[0]["micro"])))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct, prepared offline)")
    p.add_argument("--steps", type=int, default=5, help="SFT steps a case (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every case, alternated")
    p.add_argument("--micro2", type=int, default=None, help="also the causal case with micro-batches of this size")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the quickstart's SFT: all cores)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 steps, 1 repetition")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sft_step.json")
    a = p.parse_args(argv)
    from bench_common import machine_info, run_case, smollm2_dir, tiny_model, write_json

    from verl_arpo.quickstart import resolve_precision

    if a.quick:
        a.steps, a.reps = 2, 1
    precision = resolve_precision(a.precision)
    cases = [("padding mask", True, 4), ("causal only", False, 4)]
    cases += [(f"causal only, micro-batches of {a.micro2}", False, a.micro2)] if a.micro2 else []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or (tiny_model(Path(tmp)) if a.quick else smollm2_dir())
        for rep in range(a.reps):
            for label, mask, micro in cases:
                spec = dict(model=model, data=str(ROOT / "rl_datasets" / "sft_train.jsonl"), out=str(Path(tmp) / "out"),
                            mask=mask, micro=micro, steps=a.steps, threads=a.threads, precision=precision)
                r = {"label": label, "rep": rep, "micro": micro, **run_case(__file__, spec)}
                print(f"{label} rep {rep}: {r['step_s']:.2f} s a step, peak {r['peak_rss_mib']:.0f} MiB, "
                      f"losses {r['first_loss']:.6f} → {r['last_loss']:.6f}", flush=True)
                rows.append(r)
    payload = dict(benchmark="sft_step", args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                   precision=precision, machine=machine_info(), rows=rows, summary=summarize(rows))
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        child(sys.argv[2])
    else:
        main()
