"""The evaluation in worker processes (`main_eval --workers N`) against one process (the baseline),
measured in the same run: wall time, the process tree's peak memory, and what the answers lost.

For each model, repetitions alternate baseline and lever, each a fresh `main_eval` process tree on the
same questions, greedy, 150 questions a call (the quickstart's evaluation). Both arms run the same
calls; the lever runs them in N processes of cores/N threads each (docs/performance.md, "The evaluation
in two processes"). A worker's thread count changes the matmuls' blocking and so can change a greedy
answer: the report counts the answers that differ and gives each model's accuracy under both arms, with
the paired difference lever − baseline over questions and its 95% interval (normal, paired).

    python benchmarks/bench_eval_workers.py --model outputs/levers/sft_model --model <rl hf dir> --reps 1
    python benchmarks/bench_eval_workers.py --quick        # the tiny model, a few questions (a smoke run)

Default data: the fresh validation split (rl_datasets/valid_fresh.parquet) with its corpus, so nothing
here reads the test split.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import PY, RESULTS, ROOT, machine_info, print_table, run_child, summary_entry, tail, write_json  # noqa: E402

VALID = ROOT / "rl_datasets" / "valid_fresh.parquet"
FRESH_CORPUS = "search_cache/local_corpus_fresh.jsonl"


def tools_yaml(tmp: Path) -> Path:
    """The bundled tools with the search over the fresh corpus (the validation split's world)."""
    import yaml

    tools = yaml.safe_load((ROOT / "configs" / "tools" / "python_search_local.yaml").read_text())
    tools["tools"]["tool_instances"]["search"]["params"]["corpus_path"] = FRESH_CORPUS
    path = tmp / "tools_valid.yaml"
    path.write_text(yaml.safe_dump(tools))
    return path


def paired_difference(base: list[float], lever: list[float]) -> dict:
    """mean of d_i = lever_i − base_i over questions, with mean ± 1.96·sd(d)/√n."""
    d = [b - a for a, b in zip(base, lever)]
    mean = sum(d) / len(d)
    sd = statistics.stdev(d) if len(d) > 1 else 0.0
    half = 1.96 * sd / math.sqrt(len(d))
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": len(d)}


def answers(report: dict) -> list[dict]:
    """Each question's first sample, as generated (text, tool calls, finish)."""
    keep = ("text", "num_tool_calls", "tool_tags", "finish_reason", "response_tokens")
    return [{k: q["samples"][0][k] for k in keep} for q in report["samples"]]


def run_arm(model: str, data: Path, tools: Path, args, workers: int, out: Path, log: Path) -> dict:
    cmd = [PY, "-m", "verl_arpo.trainer.main_eval", "--model", model, "--data", str(data), "--tools", str(tools),
           "--k", "1", "--max_response_length", str(args.response_length), "--dtype", args.dtype,
           "--batch_size", str(args.batch_size), "--max_batch_size", str(args.batch_size),
           "--limit", str(args.limit), "--workers", str(workers), "--out", str(out)]
    r = run_child(cmd, timeout=3600, log=log)
    if r["rc"] != 0:
        raise SystemExit(f"main_eval --workers {workers} failed ({r['rc']}):\n{tail(log)}")
    report = json.loads(out.read_text())
    return {"wall_s": r["wall_s"], "generation_s": report["generation_seconds"], "peak_rss_mib": r["peak_rss_mib"],
            "peak_pss_mib": r["peak_pss_mib"], "accuracy": report["overall"]["pass@1"],
            "correct": [float(q["samples"][0]["correct"]) for q in report["samples"]], "answers": answers(report)}


def compare(model: str, runs: dict[str, list[dict]], workers: int) -> dict:
    base, lever = runs["baseline"], runs["lever"]
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "generation_s", "peak_rss_mib", "peak_pss_mib")}
           for arm, rs in runs.items()}
    same = sum(a == b for a, b in zip(base[0]["answers"], lever[0]["answers"]))
    return {"model": model, "workers": workers, "median": med,
            "wall_ratio": med["baseline"]["wall_s"] / med["lever"]["wall_s"],
            "generation_ratio": med["baseline"]["generation_s"] / med["lever"]["generation_s"],
            "pss_ratio": med["lever"]["peak_pss_mib"] / med["baseline"]["peak_pss_mib"],
            "answers_identical": same, "questions": len(base[0]["answers"]),
            "repeatable": {arm: all(r["answers"] == rs[0]["answers"] for r in rs) for arm, rs in runs.items()},
            "accuracy": {arm: rs[0]["accuracy"] for arm, rs in runs.items()},
            "lever_minus_baseline": paired_difference(base[0]["correct"], lever[0]["correct"])}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=None, help="HF model folder (repeatable)")
    p.add_argument("--data", default=str(VALID))
    p.add_argument("--limit", type=int, default=600)
    p.add_argument("--batch_size", type=int, default=150, help="questions a generation call (--batch_size, --max_batch_size)")
    p.add_argument("--response_length", type=int, default=288)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="the tiny model, 4 questions in calls of 2, 24 tokens")
    p.add_argument("--out", default=str(RESULTS / "eval_workers.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_eval_workers_") as tmp:
        tmp = Path(tmp)
        if args.quick:
            from bench_common import tiny_model

            args.model, args.limit, args.batch_size, args.response_length, args.dtype = (
                [tiny_model(tmp)], 4, 2, 24, "float32")
        if not args.model:
            p.error("--model: give an HF model folder (e.g. outputs/levers/sft_model), or --quick")
        tools = tools_yaml(tmp)
        results, rows = [], []
        for model in args.model:
            runs = {"baseline": [], "lever": []}
            for rep in range(args.reps):
                for arm, w in (("baseline", 1), ("lever", args.workers)):
                    tag = f"{Path(model).name}_{arm}_{rep}"
                    runs[arm].append(run_arm(model, Path(args.data), tools, args, w, tmp / f"{tag}.json", tmp / f"{tag}.log"))
                    print(f"{tag}: {runs[arm][-1]['wall_s']:.1f} s, accuracy {runs[arm][-1]['accuracy']:.3f}", flush=True)
            c = compare(model, runs, args.workers)
            results.append(c)
            d = c["lever_minus_baseline"]
            rows.append({"model": Path(model).name, "wall base s": c["median"]["baseline"]["wall_s"],
                         "wall lever s": c["median"]["lever"]["wall_s"], "ratio": c["wall_ratio"],
                         "PSS base MiB": c["median"]["baseline"]["peak_pss_mib"], "PSS lever MiB": c["median"]["lever"]["peak_pss_mib"],
                         "same answers": f"{c['answers_identical']}/{c['questions']}",
                         "acc base": c["accuracy"]["baseline"], "acc lever": c["accuracy"]["lever"],
                         "lever - base": f"{d['mean']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"})
    table = print_table(rows, list(rows[0]), f"main_eval --workers {args.workers} against one process, {args.reps} rep(s)")
    summary = [summary_entry(f"evaluation wall, {args.workers} worker processes vs 1 ({Path(c['model']).name})",
                             c["median"]["lever"]["wall_s"], c["median"]["baseline"]["wall_s"], c["wall_ratio"], None,
                             unit="s (ratio: baseline / lever)", pss_ratio=c["pss_ratio"],
                             answers_identical=f"{c['answers_identical']}/{c['questions']}")
               for c in results]
    payload = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items()}, "results": results,
               "table": table, "summary": summary}
    for c in results:   # the answers themselves stay out of the stored JSON
        c.pop("answers", None)
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
