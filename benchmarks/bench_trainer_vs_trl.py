"""Our GRPO trainer vs TRL's GRPOTrainer: same model, prompts, n, response length, update settings.

What runs (each run a fresh subprocess, so memory and start-up are measured per run):
- ours: `run_ppo` with the cpu_tiny preset composed by Hydra, a local Ray cluster, 2 worker
  processes (FSDP2 on gloo, 1 torch thread each: the preset's default), the HF engine (persistent
  KV cache), no tools (plain GRPO, the same work TRL does), no reference model (no KL term);
- TRL: `trl.GRPOTrainer` on CPU (`use_cpu=True`, `use_vllm=False`: HF `generate`), one process,
  `beta=0` (no reference model). The headline compares at equal cores: ours uses every core of the
  machine (its workers split them), so the baseline is TRL with as many torch threads as there are
  cores. TRL on 1 thread runs too and is reported as a detail (per-core efficiency). (On a loaded
  2-core box a multi-threaded run can be far slower: OpenMP threads wait on cores that other jobs
  hold; run this on an idle machine and report the load average.)

Matched settings: P prompts × n generations = one generation batch = one optimizer step (ours:
ppo_mini_batch_size = P; TRL: per_device_train_batch_size = micro, gradient_accumulation_steps =
P·n/micro), response length (max_new_tokens), temperature 1, no top-k/top-p, AdamW lr 1e-5,
weight decay 0.01, constant schedule, grad clip 1.0, fp32 everywhere (TRL's bf16 and gradient
checkpointing defaults are turned off because ours runs fp32 without checkpointing here), the
same reward function (verl_arpo's rule-based scorer, passed to TRL as a reward function).

Metrics over the steps after the first (warm-up) step of each run:
- trained tokens/s = (prompt + response tokens of the batch) / wall time of the step (rollout +
  scoring + log-probs + update + weight sync): end-to-end training throughput;
- rollout tokens/s = generated tokens / generation time;
- peak memory: RSS summed over the run's process tree (incl. Ray's processes for ours), and PSS
  (shared library pages split between processes: fairer for a multi-process trainer).
Ours and TRL runs alternate (ours, TRL, TRL, ours, ...); medians over repetitions. Goal (issue 47): ours ≥ 2×,
with a peak PSS no more than TRL's.

    python benchmarks/bench_trainer_vs_trl.py                 # tiny model, 2 x 4 steps each, ~4 min
    python benchmarks/bench_trainer_vs_trl.py --quick         # 2 x 3 steps each
    python benchmarks/bench_trainer_vs_trl.py --trl_threads 1,0 --reps 3   # + TRL with all threads (slow)
    python benchmarks/bench_trainer_vs_trl.py --smoke         # 1 repetition, 2 steps (tests)
    python benchmarks/bench_trainer_vs_trl.py --model ~/.cache/verl_arpo/models/smollm2-135m-instruct \
        --prompts 2 --n 4 --response_length 64 --reps 2      # a real 135M model (slow: minutes per run)
    python benchmarks/bench_trainer_vs_trl.py --ours_override actor_rollout_ref.model.use_remove_padding=true \
        --ours_override actor_rollout_ref.model.use_prefix_sharing=true   # ours with packing + prefix sharing
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import (PY, RESULTS, grpo_spec, machine_info, median, print_table, rates, run_child,  # noqa: E402
                          run_ours, summary_entry, tail, tmpdir, write_json)
from verl_arpo.utils.cpu_blas import MKL_BRANCH_VAR, mkl_branch_env  # noqa: E402

GOAL = 2.0   # issue 47: >= 2x the trained tokens/s at equal cores, with peak PSS no more than TRL's
PSS_GOAL = 1.0   # TRL's peak PSS / ours


# ------------------------------------------------------------------------------------ TRL child
def _child_trl(spec_path: str, out_path: str, profiler=None) -> None:
    """One TRL run (in this process); `profiler` (a cProfile.Profile) is enabled around train() only."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_arpo.utils.reward_score import default_compute_score

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("trl_threads"):
        torch.set_num_threads(int(spec["trl_threads"]))
    rows = [{"prompt": r["prompt"], "data_source": r["data_source"], "ground_truth": r["reward_model"]["ground_truth"]}
            for r in json.loads(Path(spec["rows_json"]).read_text())]
    P, n, micro = spec["prompts"], spec["n"], spec.get("micro", 4)
    B = P * n

    def reward(completions, data_source, ground_truth, **_):
        out = []
        for c, ds, gt in zip(completions, data_source, ground_truth):
            text = c[0]["content"] if isinstance(c, list) else c
            r = default_compute_score(ds, text, gt)
            out.append(float(r["score"] if isinstance(r, dict) else r))
        return out

    stats = {"gen_s": [], "gen_tokens": [], "prompt_tokens": []}

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *a, **k):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **k)
            stats["gen_s"].append(time.perf_counter() - t0)
            stats["gen_tokens"].append(sum(len(c) for c in completion_ids))
            stats["prompt_tokens"].append(sum(len(p) for p in prompt_ids))
            return completion_ids, logprobs

    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())

    cfg = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, use_vllm=False, bf16=False, fp16=False,
        gradient_checkpointing=False, per_device_train_batch_size=micro, gradient_accumulation_steps=B // micro,
        num_generations=n, max_completion_length=spec["response_length"], max_steps=spec["steps"],
        learning_rate=spec.get("lr", 1e-5), weight_decay=0.01, lr_scheduler_type="constant", max_grad_norm=1.0,
        beta=0.0, num_iterations=1, epsilon=0.2, temperature=1.0, top_p=1.0, top_k=0, loss_type="dapo",
        scale_rewards="group", shuffle_dataset=False, seed=0, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32})
    tok = AutoTokenizer.from_pretrained(spec["model"])
    t0 = time.perf_counter()
    trainer = Timed(model=spec["model"], reward_funcs=reward, args=cfg, train_dataset=Dataset.from_list(rows),
                    processing_class=tok, callbacks=[StepClock()])
    init_s = time.perf_counter() - t0
    if profiler is not None:
        profiler.enable()
    trainer.train()
    if profiler is not None:
        profiler.disable()
    total = time.perf_counter() - t0
    step_s = [b - a for a, b in zip(step_ends, step_ends[1:])]
    steps = [{"step": i + 1, "step_s": step_s[i], "gen_s": stats["gen_s"][i], "gen_tokens": stats["gen_tokens"][i],
              "tokens": stats["gen_tokens"][i] + stats["prompt_tokens"][i],   # one prompt copy per completion
              "update_s": step_s[i] - stats["gen_s"][i]}
             for i in range(min(len(step_s), len(stats["gen_s"])))]
    Path(out_path).write_text(json.dumps({"steps": steps, "init_s": init_s, "total_s": total,
                                          "torch_threads": torch.get_num_threads(),
                                          "prompt_tokens_raw": stats["prompt_tokens"]}))


def run_trl(spec: dict, tmp: Path, tag: str, timeout: float = 900, mkl: str = "same") -> dict:
    """One TRL run in its own subprocess. `mkl`: "same" = the MKL code path our processes get
    (utils/cpu_blas.py: a setting of the machine, not of a trainer), "own" = MKL's own pick (an empty
    MKL_CBWR), else the MKL_CBWR value to run with."""
    d = tmp / f"trl_{tag}"
    d.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out_dir=str(d / "run"))
    (d / "spec.json").write_text(json.dumps(spec))
    env = mkl_branch_env() if mkl == "same" else {MKL_BRANCH_VAR: "" if mkl == "own" else mkl}
    res = run_child([PY, str(Path(__file__)), "--_child", "trl", str(d / "spec.json"), str(d / "out.json")],
                    timeout, log=d / "log.txt", env=env)
    if res["rc"] != 0 or not (d / "out.json").exists():
        raise RuntimeError(f"TRL run {tag} failed (rc={res['rc']}):\n{tail(d / 'log.txt')}")
    return {**json.loads((d / "out.json").read_text()), **res}


def trl_status() -> tuple[bool, str]:
    """(usable, why not) without importing TRL in this process (its import is slow and noisy)."""
    import subprocess

    r = subprocess.run([PY, "-c", "import trl, transformers; from trl import GRPOTrainer, GRPOConfig; "
                        "print(trl.__version__, transformers.__version__)"], capture_output=True, text=True)
    if r.returncode != 0:
        return False, (r.stderr.strip().splitlines() or ["import failed"])[-1]
    return True, "trl " + r.stdout.strip().split()[0]


# ----------------------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: the tiny random Qwen2 built now)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (P)")
    p.add_argument("--n", type=int, default=4, help="generations per prompt")
    p.add_argument("--response_length", type=int, default=64)
    p.add_argument("--micro", type=int, default=4, help="trajectories per forward/backward (both trainers)")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is warm-up)")
    p.add_argument("--reps", type=int, default=2, help="runs of each trainer, interleaved")
    p.add_argument("--workers", default="2",
                   help="our Ray worker processes, or 1p: one worker in the driver's process (trainer.single_process, "
                        "no Ray); a list (1p,2) runs each as a variant, the first is 'ours'")
    p.add_argument("--trl_threads", default=f"{os.cpu_count() or 1},1",
                   help="TRL variants by torch threads (0 = torch default); the one with as many threads as "
                        "cores (the cores ours uses) is the baseline")
    p.add_argument("--trl_mkl", default="same",
                   help="MKL code paths TRL runs with, comma-separated: same (the one ours gets, utils/cpu_blas.py) "
                        "own (MKL's own pick: an empty MKL_CBWR) or another MKL_CBWR value; the baseline is the fastest")
    p.add_argument("--quick", action="store_true", help="2 repetitions of 3 steps")
    p.add_argument("--smoke", action="store_true", help="1 repetition, 2 steps, 32 tokens (tests)")
    p.add_argument("--out", default=str(RESULTS / "trainer_vs_trl.json"))
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (runs' logs)")
    p.add_argument("--ours_override", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override for our runs only, e.g. actor_rollout_ref.model.use_prefix_sharing=true "
                        "(repeatable; recorded in the results and the table's label)")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        return _child_trl(a._child[1], a._child[2])
    if a.quick:
        a.reps, a.steps = min(a.reps, 2), 3
    if a.smoke:
        a.reps, a.steps, a.response_length, a.prompts, a.n, a.trl_threads = 1, 2, 32, 2, 4, "1"

    t_start, load0 = time.time(), os.getloadavg()
    tmp = tmpdir("bench_trl_")
    spec = grpo_spec(tmp, a.model, a.prompts, a.n, a.response_length, a.steps, micro=a.micro)
    spec["extra_overrides"] = list(spec.get("extra_overrides", [])) + list(a.ours_override)
    ours_variants = [w.strip() for w in str(a.workers).split(",")]
    bad = [w for w in ours_variants if not (w.isdigit() and int(w) >= 1) and w != "1p"]
    if bad:
        p.error(f"--workers {a.workers}: each entry is a number of Ray workers >= 1, or 1p (one worker in the "
                f"driver's process); not {bad}")
    ok, why = trl_status()
    variants = [int(x) for x in a.trl_threads.split(",")]   # TRL torch threads; 0 = torch's default
    mkls = [m.strip() for m in a.trl_mkl.split(",")]
    trl_sides = {(f"trl{v}" if m == "same" else f"trl{v}_mkl{m}"): (v, m) for v in variants for m in mkls}
    sides = [f"ours_w{w}" for w in ours_variants] + list(trl_sides)
    runs: dict[str, list] = {s: [] for s in sides}
    errors = []
    for rep in range(a.reps):
        for side in (sides if rep % 2 == 0 else sides[::-1]):   # interleaved: ours, trl1, trl0, trl0, trl1, ours, ...
            if side.startswith("ours"):
                w = side[6:]
                runs[side].append(run_ours(dict(spec, workers=int(w.rstrip("p")), single_process=w.endswith("p")),
                                           tmp, f"{side}_r{rep}"))
            elif ok:
                try:
                    threads, mkl = trl_sides[side]
                    runs[side].append(run_trl(dict(spec, trl_threads=threads), tmp, f"{side}_r{rep}", mkl=mkl))
                except RuntimeError as e:  # say so, don't fake it
                    errors.append(str(e)[-1500:])
                    ok, why = False, "TRL run failed: " + str(e).strip().splitlines()[-1][:300]
            print(f"[rep {rep}] {side} done ({time.time() - t_start:.0f} s)", flush=True)

    def agg(rs_runs):
        if not rs_runs:
            return None
        rs = [rates(r["steps"]) for r in rs_runs]
        return {"train_tok_per_s": median(x["train_tok_per_s"] for x in rs),
                "rollout_tok_per_s": median(x["rollout_tok_per_s"] for x in rs),
                "step_s": median(x["step_s"] for x in rs), "gen_s": median(x["gen_s"] for x in rs),
                "update_s": median(x["update_s"] for x in rs),
                "tokens_per_step": median(x["tokens_per_step"] for x in rs),
                "gen_tokens_per_step": median(x["gen_tokens_per_step"] for x in rs),
                "peak_rss_mib": median(r["peak_rss_mib"] for r in rs_runs),
                "peak_pss_mib": median(r["peak_pss_mib"] for r in rs_runs),
                "run_wall_s": median(r["wall_s"] for r in rs_runs),
                # process start to exit minus the timed steps: imports, Ray, model load, shutdown
                "startup_s": median(r["wall_s"] - sum(s["step_s"] for s in r["steps"]) for r in rs_runs),
                "runs": len(rs_runs), "per_run": rs}

    main_side = sides[0]
    o = agg(runs[main_side])
    others = {s: agg(runs[s]) for s in sides[1:len(ours_variants)]}
    trl = {s: agg(runs[s]) for s in sides[len(ours_variants):] if runs[s]}
    # the baseline runs on as many cores as ours (its workers split the machine's cores): the fastest of
    # those variants (MKL's code paths); without one, the fastest TRL configuration measured
    equal = [s for s in trl if trl_sides[s][0] == (os.cpu_count() or 1)] or list(trl)
    best = max(equal, key=lambda s: trl[s]["train_tok_per_s"]) if equal else None
    t = trl[best] if best else None
    drop = ("per_run",)
    def ours_label(side):
        w = side[6:]
        threads = (runs[side][0].get("threads_per_worker") if runs[side] else None) or 1
        extra = f", {' '.join(o.rsplit('.', 1)[-1] for o in a.ours_override)}" if a.ours_override else ""
        where = ("1 worker in the driver's process, no Ray" if w.endswith("p")
                 else f"{w} Ray worker{'s' if int(w) > 1 else ''}")
        return f"verl_arpo ({where} x {threads} thread{'s' if threads > 1 else ''}{extra})"

    table = [{"trainer": ours_label(main_side), **{k: v for k, v in o.items() if k not in drop}}]
    table += [{"trainer": ours_label(s) + " (variant)", **{k: x for k, x in v.items() if k not in drop}}
              for s, v in others.items()]
    for s, v in trl.items():
        threads = runs[s][0].get("torch_threads")
        label = f"TRL GRPOTrainer (1 proc x {threads} thread{'s' if threads != 1 else ''}" + \
            (", torch default" if trl_sides[s][0] == 0 else "") + \
            (", MKL's own pick" if trl_sides[s][1] == "own" else
             f", MKL_CBWR={trl_sides[s][1]}" if trl_sides[s][1] != "same" else "") + \
            (") <- baseline" if s == best else ")")
        table.append({"trainer": label, **{k: x for k, x in v.items() if k not in drop}})
    if t:
        table.append({"trainer": "ratio ours/baseline (mem, time: baseline/ours)",
                      "train_tok_per_s": o["train_tok_per_s"] / t["train_tok_per_s"],
                      "rollout_tok_per_s": o["rollout_tok_per_s"] / t["rollout_tok_per_s"],
                      "step_s": t["step_s"] / o["step_s"], "gen_s": t["gen_s"] / o["gen_s"],
                      "update_s": t["update_s"] / o["update_s"],
                      "peak_rss_mib": t["peak_rss_mib"] / o["peak_rss_mib"],
                      "peak_pss_mib": t["peak_pss_mib"] / o["peak_pss_mib"],
                      "startup_s": t["startup_s"] / o["startup_s"]})
    print(f"\nmodel={a.model or 'tiny random Qwen2 (h64, 2 layers)'}  P={a.prompts} n={a.n} "
          f"response={a.response_length} micro={a.micro} steps/run={a.steps} (first = warm-up) reps={a.reps}")
    cols = ["trainer", "runs", "train_tok_per_s", "rollout_tok_per_s", "step_s", "gen_s", "update_s",
            "tokens_per_step", "gen_tokens_per_step", "peak_rss_mib", "peak_pss_mib", "startup_s"]
    text = print_table(table, cols)
    print("update_s = step time minus rollout (TRL) / timing_s/update_actor (ours, excl. old-log-prob and sync)")
    if not t:
        print(f"TRL baseline NOT measured: {why}")
    if t:
        summary = [
            summary_entry("trained tokens/s, ours vs TRL GRPOTrainer", o["train_tok_per_s"], t["train_tok_per_s"],
                          o["train_tok_per_s"] / t["train_tok_per_s"], GOAL,
                          ours_config=ours_label(main_side), baseline_config=table[len(ours_variants) + list(trl).index(best)]["trainer"]),
            summary_entry("rollout tokens/s, ours vs TRL GRPOTrainer", o["rollout_tok_per_s"], t["rollout_tok_per_s"],
                          o["rollout_tok_per_s"] / t["rollout_tok_per_s"], GOAL),
            summary_entry("peak RSS MiB incl. children (ratio TRL/ours)", o["peak_rss_mib"], t["peak_rss_mib"],
                          t["peak_rss_mib"] / o["peak_rss_mib"], None),
            summary_entry("peak PSS MiB incl. children (ratio TRL/ours)", o["peak_pss_mib"], t["peak_pss_mib"],
                          t["peak_pss_mib"] / o["peak_pss_mib"], PSS_GOAL),
        ]
    else:
        summary = [summary_entry("trained tokens/s, ours vs TRL GRPOTrainer", o["train_tok_per_s"], None, None, GOAL,
                                 note=f"TRL not measured: {why}")]
    ours_runs = {s: runs[s] for s in sides[:len(ours_variants)]}
    trl_runs = {s: runs[s] for s in sides[len(ours_variants):]}
    write_json(a.out, {"benchmark": "trainer_vs_trl", "args": {k: v for k, v in vars(a).items() if k != "_child"},
                       "spec": {k: v for k, v in spec.items() if k not in ("rows_json",)},
                       "trl_available": bool(t), "trl_status": why, "errors": errors,
                       "ours": o, "ours_variants": others, "trl": trl, "baseline": best, "table": text,
                       "ours_runs": ours_runs, "trl_runs": trl_runs, "summary": summary,
                       "machine": {**machine_info(), "load_avg_start": list(load0), "load_avg_end": list(os.getloadavg())},
                       "seconds": time.time() - t_start})
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
