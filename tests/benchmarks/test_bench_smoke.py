"""Benchmarks: each script runs at its smallest size and writes JSON that summarize.py understands.

Fast: the summary format from stored results, the process-tree memory sampler, run_all.sh syntax.
Slow (`--slow`): every benchmark script end to end with its --smoke / --quick flag into tmp_path
(30 s to 2 min each on a busy 2-core machine: Ray start-up, worker start-up, TRL import).
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

ENTRY_KEYS = {"metric", "ours", "baseline", "ratio", "goal"}


def _run(args, timeout=900):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", BENCH_THREADS="1")
    r = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        err = r.stderr[r.stderr.rfind("Traceback (most recent call last)"):][:6000] or r.stderr[-3000:]
        pytest.fail(f"{args[0]} exited {r.returncode}:\n{err}\n--- stdout:\n{r.stdout[-2000:]}")
    return r.stdout


def _check_entries(entries):
    assert entries, "no summary entries"
    for e in entries:
        assert ENTRY_KEYS <= set(e), e
        assert isinstance(e["metric"], str)
        if e["ratio"] is not None:
            assert e["ratio"] >= 0 and e["ratio"] == e["ratio"]   # not negative, not NaN (0 when a count is 0)


def _summarize(results_dir: Path) -> dict:
    _run([BENCH / "summarize.py", "--results", results_dir, "--no_readme", "--load_start", "1.0 1.0 1.0",
          "--command", "pytest"])
    return json.loads((results_dir / "summary.json").read_text())


# ------------------------------------------------------------------------------------------ fast
def test_summary_format_from_stored_results(tmp_path):
    """The three older scripts' JSON (as stored in benchmarks/results) adapts to the summary format."""
    stored = [p for p in (BENCH / "results").glob("*.json") if p.name != "summary.json"]
    if not stored:
        pytest.skip("no stored results")
    for p in stored:
        shutil.copy(p, tmp_path / p.name)
    s = _summarize(tmp_path)
    assert {"nproc", "cpu_model", "load_avg_start", "load_avg_end", "torch", "transformers"} <= set(s["machine"])
    assert s["machine"]["load_avg_start"] == [1.0, 1.0, 1.0]
    for name, head in s["benchmarks"].items():
        assert ENTRY_KEYS <= set(head), name
        _check_entries(s["details"][name])
    assert (tmp_path / "summary.md").read_text().count("|") > 10
    # each row says when its file was measured: its own record, else (here, uncommitted copies) the file's day
    assert s["measured"].keys() == s["benchmarks"].keys()
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", d) for d in s["measured"].values()), s["measured"]
    with_time = {p.stem: json.loads(p.read_text()).get("machine", {}).get("time", "")[:10] for p in stored}
    assert all(s["measured"][n] == d for n, d in with_time.items() if d and n in s["measured"])


def test_a_stored_result_without_a_date_is_dated_by_its_commit():
    import summarize

    undated = [p for p in (BENCH / "results").glob("*.json")
               if p.name != "summary.json" and not (json.loads(p.read_text()).get("machine") or {}).get("time")]
    if not undated or not (ROOT / ".git").exists():
        pytest.skip("no undated stored result in a git checkout")
    p = undated[0]
    day = subprocess.run(["git", "log", "-1", "--format=%cs", "--", str(p.relative_to(ROOT))], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    assert day and summarize.measured_on(p.stem, p.parent) == day


def test_tree_memory_counts_children():
    """The sampler sums the RSS of a process's descendants: a child holding ~200 MB shows up."""
    from bench_common import run_child

    code = "import time; b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    res = run_child([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"],
                    timeout=60)
    assert res["rc"] == 0
    assert res["peak_rss_mib"] > 200, res
    assert res["peak_pss_mib"] > 150, res


def test_run_all_runs_every_benchmark():
    """Every bench_*.py of benchmarks/ is run by run_all.sh (issue 50): a benchmark nobody reruns is a
    number nobody can check."""
    script = (BENCH / "run_all.sh").read_text()
    run_lines = [line for line in script.splitlines() if line.startswith("run ")]
    missing = sorted(p.name for p in BENCH.glob("bench_*.py")
                     if p.name != "bench_common.py" and not any(f"benchmarks/{p.name}" in line for line in run_lines))
    assert missing == []


def test_results_are_named_after_their_benchmark():
    """benchmarks/results/ naming (README there): `<benchmark>[_<variant>].json`, the benchmark being a
    bench_*.py without its prefix (or summary / profile_step); GPU runs in gpu_check/ as
    `<device>_<date>[<letter>]_<what>.<ext>`. Experiments keep their stores in experiments/results/."""
    names = {p.stem[len("bench_"):] for p in BENCH.glob("bench_*.py") if p.stem != "bench_common"}
    names |= {"summary", "profile_step"}
    top = [p for p in (BENCH / "results").iterdir() if p.is_file()]
    assert top and [p.name for p in top if not any(p.stem == n or p.stem.startswith(n + "_") for n in names)] == []
    gpu = [p.name for p in (BENCH / "results" / "gpu_check").iterdir()]
    assert [n for n in gpu if not re.fullmatch(r"[a-z0-9]+_\d{4}-\d{2}-\d{2}[a-z]?(_[\w.-]+)?\.(json|log|txt)", n)] == []
    assert sorted(p.name for p in (BENCH / "results").iterdir() if p.is_dir()) == ["gpu_check"]


def test_run_all_script_parses():
    r = subprocess.run(["bash", "-n", str(BENCH / "run_all.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", str(BENCH / "run_all.sh"), "--bogus"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--quick" in r.stderr


# ------------------------------------------------------------------------------------------ slow
SMOKES = {
    "trainer_vs_trl": ["bench_trainer_vs_trl.py", "--smoke", "--workers", "1p,2",
                       "--ours_override", "actor_rollout_ref.model.use_remove_padding=true",
                       "--ours_override", "actor_rollout_ref.model.use_prefix_sharing=true"],
    "on_policy_skip": ["bench_on_policy_skip.py", "--reps", "1", "--steps", "2", "--response_length", "32"],
    "scaling": ["bench_scaling.py", "--smoke"],
    "cpu_efficiency": ["bench_cpu_efficiency.py", "--smoke"],
    "branching": ["bench_branching.py", "--data", ROOT / "rl_datasets" / "test.parquet", "--prompts", "2", "--n", "4",
                  "--initial_rollouts", "2", "--seeds", "1", "--response_length", "48"],
    "rollout_engine": ["bench_rollout_engine.py", "--quick", "--no-vllm"],
    "tools": ["bench_tools.py", "--quick"],
    "engine_levers": ["bench_engine_levers.py", "--quick"],
    "async_rollout_hf": ["bench_async_rollout.py", "--quick"],
    "actor_update": ["bench_actor_update.py", "--quick", "--cases", "6,7,8"],
    "sequence_parallel": ["bench_sequence_parallel.py", "--quick"],
    "decode_kernels": ["bench_decode_kernels.py", "--quick"],
    "eval_workers": ["bench_eval_workers.py", "--quick"],
    "update_ranks": ["bench_update_ranks.py", "--quick"],
    "sft_step": ["bench_sft_step.py", "--quick"],
    "precision": ["bench_precision.py", "--quick"],
    "mkl_branch": ["bench_mkl_branch.py", "--quick"],
    "arm_cost": ["bench_arm_cost.py", "--quick", "--baseline", "HEAD"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMOKES))
def test_benchmark_smoke_writes_valid_json(name, tmp_path):
    script, *args = SMOKES[name]
    out = tmp_path / f"{name}.json"
    t0 = time.time()
    _run([BENCH / script, *args, "--out", out], timeout=900)
    data = json.loads(out.read_text())
    if "summary" in data:
        _check_entries(data["summary"])
    s = _summarize(tmp_path)
    assert name in s["benchmarks"], s
    _check_entries(s["details"][name])
    print(f"{name}: {time.time() - t0:.0f} s")
    if name == "trainer_vs_trl":
        # both trainers ran the same work: tokens per step within 10 % of each other
        assert data["trl_available"], data["trl_status"]
        ours, trl = data["ours"], data["trl"][data["baseline"]]
        assert abs(ours["tokens_per_step"] - trl["tokens_per_step"]) <= 0.1 * ours["tokens_per_step"]
        # 'ours' is the first layout (one worker in the driver's process), the 2 Ray workers a variant
        assert [r["single_process"] for r in data["ours_runs"]["ours_w1p"]] == [True]
        assert [r["single_process"] for r in data["ours_runs"]["ours_w2"]] == [False]
        assert "no Ray" in data["summary"][0]["ours_config"] and set(data["ours_variants"]) == {"ours_w2"}
    if name == "arm_cost":
        # --baseline HEAD: both arms run this code from one SFT model, so they compute the same run
        base, ours = (next(r for r in data["rows"] if r["arm"] == arm) for arm in ("baseline", "this checkout"))
        assert data["revs"]["baseline"] == data["revs"]["this checkout"]
        for key in ("eval_tokens", "accuracy_rl", "eval_questions"):
            assert base[key] == ours[key], key
        assert base["rl"]["steps"] == ours["rl"]["steps"] == 2
        assert base["rl"]["generated_tokens"] == ours["rl"]["generated_tokens"] > 0


@pytest.mark.slow
def test_train_attention_benchmark_runs_every_case_on_the_same_micro_batches(tmp_path):
    """On the CPU the cuDNN guard is a no-op, so both kernel cases of each layout run the same code:
    identical losses, and each case timed every micro-batch twice (new shapes, then seen ones)."""
    out = tmp_path / "train_attention.json"
    _run([BENCH / "bench_train_attention.py", "--quick", "--device", "cpu", "--out", out], timeout=900)
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"padded/default", "padded/ours", "packed/default", "packed/ours"}
    for layout in ("padded", "packed"):
        base, ours = data["runs"][f"{layout}/default"], data["runs"][f"{layout}/ours"]
        assert base["losses"] == ours["losses"] and base["tokens"] == ours["tokens"]
        assert len(base["pass1_ms"]) == len(base["pass2_ms"]) == len(base["losses"]) == 3
        assert all(k.startswith("aten::_") for k in base["kernels"]) and base["kernels"]
    # packing changes the layout, not the numbers: the same per-token objective
    for a, b in zip(data["runs"]["padded/ours"]["losses"], data["runs"]["packed/ours"]["losses"]):
        assert a == pytest.approx(b, rel=1e-4)
    assert len(data["table"]) == 4
