"""MKL's AVX2 code path against MKL's own pick, on the quickstart's SFT and evaluation commands in fp32.

On an x86 CPU that is not Intel's, MKL runs fp32 products on a generic code path; `MKL_CBWR=AVX2` runs its
AVX2 kernels instead, and every process we start gets it there (verl_arpo/utils/cpu_blas.py;
docs/performance.md, "MKL's code path on CPUs that are not Intel's"). This benchmark checks that choice on
the machine it runs on, with bench_precision.py's stage runners: each stage in a fresh process with the
environment the quickstart gives it, once with `MKL_CBWR=AVX2` and once with `MKL_CBWR=` (empty: MKL's own
pick; `AUTO` would turn on MKL's reproducible mode instead), alternated over `--reps` repetitions, in fp32
(bf16 products do not go through MKL).

- **SFT**: the median seconds of a step after the first, and the first and last losses (the two paths round
  differently, so the losses may differ in their last digits).
- **Evaluation**: tokens/s of the generation on the first `--questions` test questions (speed only).
- **Error**: each path's fp32 products on SmolLM2's own weights (q_proj, up_proj and down_proj of the first
  and the middle layer, and the embedding used as the output head) at 1, 3, 7, 16 and 200 rows, against a
  float64 reference: the relative RMS error of each shape and the largest, computed in a fresh process for
  each path on the same inputs, and the shapes where the two paths' errors differ (their numbers differ).

Ratio = the speed of the path this machine's processes get (AVX2 on a CPU that is not Intel's, MKL's own
on an Intel CPU) / the other's: > 1 means the default picked the faster one.

    python benchmarks/bench_mkl_branch.py [--reps 2] [--sft_steps 5] [--questions 150] [--quick]
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import ROOT, machine_info, print_table, write_json  # noqa: E402
from bench_precision import run_arms, stage_parser, summarize_arms  # noqa: E402

from verl_arpo.utils.cpu_blas import MKL_BRANCH, MKL_BRANCH_VAR, MKL_OWN, mkl_branch_env  # noqa: E402

PATHS = (MKL_BRANCH, MKL_OWN)


def label(path: str) -> str:
    return f"MKL_CBWR={path}" if path else "MKL's own pick"

_ERROR = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file
torch.manual_seed(0)
weights = {}
for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    weights.update(load_file(str(f)))
names = []
for kind in ("q_proj.weight", "up_proj.weight", "down_proj.weight", "embed_tokens.weight"):
    of_kind = sorted(n for n in weights if n.endswith(kind))
    names += sorted({of_kind[0], of_kind[len(of_kind) // 2]}) if of_kind else []
per_shape = {}
for name in names:
    w = weights[name].float()
    for rows in (1, 3, 7, 16, 200):
        x = torch.randn(rows, w.shape[1])
        ref = x.double() @ w.double().t()
        err = torch.nn.functional.linear(x, w).double() - ref
        per_shape[f"{name}:{rows}"] = float(err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
print(json.dumps({"rel_rms_error": max(per_shape.values()), "per_shape": per_shape}))
"""


def product_error(model: str, path: str) -> dict:
    """The largest relative RMS error of fp32 products against float64 with MKL_CBWR=`path` (a fresh process)."""
    import os

    env = {**os.environ, MKL_BRANCH_VAR: path}   # threads as the stages get them (torch: one per core)
    out = subprocess.run([sys.executable, "-c", _ERROR, model], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(rows: list[dict], pick: str) -> list[dict]:
    """Per stage, the path this machine's processes get (`pick`) against the other: ratio = its speed / the
    other's, so > 1 means the default picked the faster one (bench_precision.summarize_arms)."""
    return summarize_arms(rows, pick, PATHS, "path", lambda unit, mine, other: (
        f"{unit}, fp32, {label(mine)} = the default here (ratio: its speed / {label(other)}'s)"))


def product_errors(model: str) -> dict:
    """Both paths' product errors, and the shapes where they differ (the same inputs: each process seeds torch
    with 0)."""
    errors = {path: product_error(model, path) for path in PATHS}
    errors["shapes_that_differ"] = sorted(k for k, v in errors[PATHS[0]]["per_shape"].items()
                                          if v != errors[PATHS[1]]["per_shape"][k])
    return errors


def main(argv: list[str] | None = None) -> dict:
    a = stage_parser(__doc__, ROOT / "benchmarks" / "results" / "mkl_branch.json").parse_args(argv)
    ran = run_arms(a, PATHS, "path", lambda path: ("fp32", {MKL_BRANCH_VAR: path}), label, before=product_errors)
    rows, errors = ran["rows"], ran["before"]
    pick = mkl_branch_env({}).get(MKL_BRANCH_VAR, MKL_OWN)
    pick = pick if pick in PATHS else MKL_OWN
    summary = summarize(rows, pick)
    print_table([{"metric": s["metric"], "default": f"{s['ours']:.3g}", "the other": f"{s['baseline']:.3g}",
                  "ratio": f"{s['ratio']:.2f}"} for s in summary]
                + [{"metric": f"fp32 product error vs float64 (rel. RMS, worst shape), {label(path)}",
                    "default": f"{errors[path]['rel_rms_error']:.2e}", "the other": "", "ratio": ""} for path in PATHS],
                ["metric", "default", "the other", "ratio"], f"MKL's code paths on this CPU (default: {label(pick)})")
    print(f"shapes whose products differ between the paths: {errors['shapes_that_differ'] or 'none'}")
    payload = dict(benchmark="mkl_branch", args={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                   default=pick, model=ran["model"], eval_model=ran["eval_model"], errors=errors,
                   machine=machine_info(), rows=rows, summary=summary)
    write_json(a.out, payload)
    return payload


if __name__ == "__main__":
    main()
