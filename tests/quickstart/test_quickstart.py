"""The quickstart pipeline end to end (tiny model, smoke budget): every stage runs the real entry
points (model prep, main_sft, main_ppo, convert_verl_to_hf, main_eval) and the summary is complete."""
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = {"questions": 6, "response_length": 64}   # verl_arpo.quickstart.SMOKE, written out


@pytest.mark.slow
def test_quickstart_tiny_smoke(tmp_path):
    out = tmp_path / "qs"
    env = {**os.environ, "VERL_ARPO_CACHE": str(tmp_path / "cache")}  # an empty evaluation cache
    # --smoke's RL shape is 3 prompts a step, one of each task type (data.stratify_by in
    # configs/quickstart.yaml); Hydra overrides on the command line reach the RL stage and win over it
    overrides = ["actor_rollout_ref.rollout.n=4"]
    r = subprocess.run([sys.executable, "-m", "verl_arpo.quickstart", "--tiny", "--smoke", "--out", str(out), *overrides],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for step in (1, 2):
        rows = [json.loads(line) for line in open(out / "rl" / "rollout" / f"rollout_{step}.jsonl")]
        prompts = {row["uid"]: row["data_source"] for row in rows}
        assert len(rows) == 3 * 4 and sorted(Counter(prompts.values()).values()) == [1, 1, 1]
        assert max(sum(n for _, n in row["response_mask"]) for row in rows) <= SMOKE["response_length"]
    s = json.loads((out / "summary.json").read_text())
    assert s["test"]["n"] == SMOKE["questions"]
    for tag in ("base", "sft", "rl"):
        lo, hi = s["test"][tag]["ci95"]
        assert 0.0 <= lo <= s["test"][tag]["acc"] <= hi <= 1.0
        assert tag in s["tool_calls_per_question"]
    assert set(s["wall_s"]) >= {"prepare", "sft", "rl", "eval", "total"}
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (Path(s["hf_dir"]) / "config.json").exists()
    assert len(s["reward_curve"]) == s["rl_steps"]
    assert s["eval_from_cache"] == []
    # stdout is a file here: every stage says when it starts and ends, how long it took, where its log is
    for stage in ("eval_base", "sft", "eval_sft", "rl", "merge", "eval_rl"):
        assert f"{stage}: started (log: {out / 'logs' / stage}.log)" in r.stdout, (stage, r.stdout[-2000:])
        assert re.search(rf"{stage}: finished in \d+ s", r.stdout), stage
    # before each stage: what it and the rest should take at this machine's pace so far
    stages = re.findall(r"\] [\d:]+ ([a-z ]+): ~[\d.]+ min expected; ~\d+ min left in all", r.stdout)
    assert stages == ["eval base", "sft", "eval sft", "rl", "merge", "eval rl"], r.stdout[-3000:]
    # a re-run reuses every finished stage (nothing is rewritten) and still reports what each stage cost;
    # the base evaluation, whose report is gone, comes from the cache without running the model again
    base_report = json.loads((out / "eval_base.json").read_text())
    (out / "eval_base.json").unlink()
    stamps = {f: (out / f).stat().st_mtime_ns for f in ("logs/sft.log", "logs/rl.log", "logs/eval_rl.log",
                                                         "logs/eval_base.log", "rl/latest_checkpointed_iteration.txt")}
    r2 = subprocess.run([sys.executable, "-m", "verl_arpo.quickstart", "--tiny", "--smoke", "--out", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert {f: (out / f).stat().st_mtime_ns for f in stamps} == stamps
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["eval_from_cache"] == ["base"] and "(cached)" in r2.stdout
    assert "eval_base: reused from the cache" in r2.stdout and "sft: reused (its outputs exist" in r2.stdout
    assert json.loads((out / "eval_base.json").read_text()) == base_report
    assert {k: s2["wall_s"][k] for k in ("sft", "rl")} == {k: s["wall_s"][k] for k in ("sft", "rl")}
    assert s2["wall_s"]["sft"] > 0 and s2["wall_s"]["rl"] > 0
    # other SFT steps than the model in --out was trained with: SFT and every later stage run again
    r3 = subprocess.run([sys.executable, "-m", "verl_arpo.quickstart", "--tiny", "--smoke", "--sft_steps", "1",
                         "--out", str(out), *overrides], cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r3.returncode == 0, r3.stdout[-3000:] + r3.stderr[-3000:]
    assert "was not trained with {'steps': 1" in r3.stdout
    for stage in ("sft", "eval_sft", "rl", "eval_rl"):
        assert f"{stage}: started" in r3.stdout, stage
    assert json.loads((out / "sft_model" / "verl_arpo_sft.json").read_text())["steps"] == 1


def test_an_override_that_is_not_key_value_is_refused(tmp_path, capsys):
    from verl_arpo.quickstart import main

    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "data.train_batch_size", "6"])
    assert exit_.value.code == 2
    assert "'data.train_batch_size' is not a Hydra override: write KEY=VALUE" in capsys.readouterr().err


def test_time_left_scales_the_expected_seconds_by_the_pace_so_far():
    from verl_arpo.quickstart import time_left

    expected = {"eval base": 100, "sft": 200, "rl": 400}
    assert time_left(expected, {}, ["eval base", "sft", "rl"]) == 700   # nothing ran: as expected
    # eval base took 150 s of an expected 100: the rest at 1.5x
    assert time_left(expected, {"eval base": 150.0}, ["sft", "rl"]) == 1.5 * 600
    assert time_left(expected, {"eval base": 50.0, "sft": 250.0}, ["rl", "summary"]) == 400


def test_eval_cache_key_follows_every_input(tmp_path, monkeypatch):
    """The base evaluation is reused only while its inputs hash the same: any weight byte, the data,
    an argument or the package's code changes the key."""
    from verl_arpo import quickstart
    from verl_arpo.quickstart import eval_cache_key

    code = tmp_path / "checkout"
    (code / "verl_arpo").mkdir(parents=True)
    (code / "configs").mkdir()
    (code / "verl_arpo" / "engine.py").write_text("TEMPERATURE = 1.0\n")
    (code / "configs" / "quickstart.yaml").write_text("n: 4\n")
    monkeypatch.setattr(quickstart, "PACKAGE", code / "verl_arpo")        # the code and the configs,
    monkeypatch.setattr(quickstart, "config_dir", lambda: str(code / "configs"))   # wherever installed
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    data = tmp_path / "test.parquet"
    data.write_bytes(b"rows")
    args = ["--dtype", "bfloat16"]
    key = eval_cache_key(model, data, args)
    assert key == eval_cache_key(model, data, list(args))  # deterministic
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[1000] ^= 1
    (model / "model.safetensors").write_bytes(bytes(weights))
    assert eval_cache_key(model, data, args) != key
    key = eval_cache_key(model, data, args)
    data.write_bytes(b"rowz")
    assert eval_cache_key(model, data, args) != key
    key = eval_cache_key(model, data, args)
    assert eval_cache_key(model, data, ["--dtype", "float32"]) != key
    key = eval_cache_key(model, data, args)
    (code / "verl_arpo" / "engine.py").write_text("TEMPERATURE = 0.5\n")
    assert eval_cache_key(model, data, args) != key
    key = eval_cache_key(model, data, args)
    (code / "configs" / "quickstart.yaml").write_text("n: 8\n")
    assert eval_cache_key(model, data, args) != key


def test_an_sft_model_is_reused_only_for_the_arguments_it_was_trained_with(tmp_path):
    """The quickstart and the comparison reuse `<out>/sft_model` only when its record says it was
    trained with the steps, epochs and precision asked for now (a changed default retrains it)."""
    from verl_arpo.quickstart import SFT_RECORD, sft_model_matches, sft_record

    d, asked = tmp_path / "sft_model", sft_record(24, 1, "fp32")
    assert not sft_model_matches(d, asked)                      # nothing there
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert not sft_model_matches(d, asked)                      # no record: older, or killed before it
    (d / SFT_RECORD).write_text(json.dumps(sft_record(12, 1, "fp32")))
    assert not sft_model_matches(d, asked)                      # trained with other steps
    (d / SFT_RECORD).write_text(json.dumps(asked))
    assert sft_model_matches(d, asked)
    assert not sft_model_matches(d, sft_record(24, 1, "bf16")) and not sft_model_matches(d, sft_record(24, 2, "fp32"))
    (d / "config.json").unlink()
    assert not sft_model_matches(d, asked)                      # a record without the model


def test_the_base_model_answers_the_first_60_questions_and_the_claim_all():
    """[issue 47] the base evaluation is context (what SFT bought); RL − SFT, the claim, uses every question."""
    from verl_arpo.quickstart import BASE_EVAL_QUESTIONS, eval_args, eval_limit

    assert BASE_EVAL_QUESTIONS == 60
    assert eval_limit("base", None) == 60 and eval_limit("base", 30) == 30 and eval_limit("base", 400) == 60
    assert eval_limit("sft", None) is None and eval_limit("rl", None) is None and eval_limit("rl", 30) == 30
    args = eval_args(eval_limit("base", None))
    assert args[args.index("--limit") + 1] == "60" and "--limit" not in eval_args(eval_limit("sft", None))


def test_a_stage_starts_with_how_its_threads_wait_chosen_then(tmp_path, monkeypatch, capsys):
    """run_logged gives each stage our wait choice, made as it starts (utils/threads.py), and keeps a
    wait variable the user exported."""
    from verl_arpo.quickstart import STAGE_ENV, run_logged
    from verl_arpo.utils.threads import CHOSEN_BY_US, CPU_WAIT_VARS

    for key in (*CPU_WAIT_VARS, CHOSEN_BY_US):
        monkeypatch.delenv(key, raising=False)
    show = [sys.executable, "-c", "import os; print(sorted((k, v) for k, v in os.environ.items() "
            "if k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'KMP_BLOCKTIME', 'VERL_ARPO_CPU_WAIT')))"]
    run_logged(show, tmp_path / "a.log", STAGE_ENV)
    seen = (tmp_path / "a.log").read_text().splitlines()[-1]
    said = capsys.readouterr().out
    assert (seen, "spin while they wait" in said) in (
        ("[('GOMP_SPINCOUNT', '3000'), ('VERL_ARPO_CPU_WAIT', 'auto')]", True),
        ("[('OMP_WAIT_POLICY', 'PASSIVE'), ('VERL_ARPO_CPU_WAIT', 'auto')]", False)), (seen, said)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    run_logged(show, tmp_path / "b.log", STAGE_ENV)
    assert (tmp_path / "b.log").read_text().splitlines()[-1] == "[('OMP_WAIT_POLICY', 'ACTIVE')]"
    assert "while they wait" not in capsys.readouterr().out      # the user's choice: nothing said


def test_a_stage_gets_mkls_avx2_path_on_a_cpu_that_is_not_intels(tmp_path, monkeypatch, capsys):
    """run_logged gives a stage MKL_CBWR=AVX2 where /proc/cpuinfo names a vendor other than Intel with AVX2
    and FMA (utils/cpu_blas.py), nothing on an Intel CPU, and the user's value wherever one is set."""
    from verl_arpo.quickstart import STAGE_ENV, run_logged
    from verl_arpo.utils import cpu_info

    monkeypatch.delenv("MKL_CBWR", raising=False)
    show = [sys.executable, "-c", "import os; print(repr(os.environ.get('MKL_CBWR')))"]
    seen = {}
    for vendor, user in (("AuthenticAMD", None), ("GenuineIntel", None), ("AuthenticAMD", "AUTO")):
        info = tmp_path / f"cpuinfo_{vendor}"
        info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: sse2 avx fma avx2\n")
        monkeypatch.setattr(cpu_info, "CPUINFO", info)
        if user:
            monkeypatch.setenv("MKL_CBWR", user)
        log = tmp_path / f"{vendor}_{user}.log"
        run_logged(show, log, STAGE_ENV)
        seen[vendor, user] = (log.read_text().splitlines()[-1], "MKL_CBWR=" in capsys.readouterr().out)
    assert seen == {("AuthenticAMD", None): ("'AVX2'", True), ("GenuineIntel", None): ("None", False),
                    ("AuthenticAMD", "AUTO"): ("'AUTO'", True)}


FAULTS_AFTER_FREES = """
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):   # a 64 MiB block, touched, then freed: as a decode cache's buffers come and go
    block = libc.malloc(64 << 20)
    libc.memset(block, 1, 64 << 20)
    libc.free(block)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_an_evaluation_keeps_the_memory_it_frees_instead_of_faulting_it_in_again():
    """KEEP_FREED_MEMORY_ENV: glibc's malloc serves the second to sixth 64 MiB blocks from the first one's
    pages, so the process faults in about one block's pages instead of six."""
    from verl_arpo.quickstart import KEEP_FREED_MEMORY_ENV

    def faults(extra: dict) -> int:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        r = subprocess.run([sys.executable, "-c", FAULTS_AFTER_FREES], env={**env, **extra}, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return int(r.stdout.split()[-1])

    pages = (64 << 20) // 4096
    base, keep = faults({}), faults(KEEP_FREED_MEMORY_ENV)
    assert base >= 5 * pages, base                  # each block mapped fresh and faulted in again
    assert pages * 0.9 <= keep <= 1.5 * pages, keep  # the first block's pages, then reused


class _StageRan(Exception):
    pass


def _stage_commands(tmp_path, monkeypatch, *stages) -> list[tuple[list[str], dict]]:
    """(command, environment) of each stage call (a Quickstart method and its argument), as run_logged
    receives them; each call stops at run_logged."""
    from rich.progress import Progress

    import verl_arpo.quickstart as qs

    seen = []

    def record(cmd, log, env=None, append=False, cwd=None):
        seen.append((cmd, env))
        raise _StageRan

    monkeypatch.setattr(qs, "run_logged", record)
    with Progress() as bar:
        run = qs.Quickstart(qs.parse_args(["--tiny", "--smoke", "--out", str(tmp_path / "qs")]), bar,
                            bar.add_task("stages", total=len(stages)))
        for method, *args in stages:
            with pytest.raises(_StageRan):
                getattr(run, method)(*args)
    return seen


def test_the_quickstart_evaluates_with_freed_memory_kept(tmp_path, monkeypatch):
    """Quickstart.evaluate runs main_eval with STAGE_ENV and KEEP_FREED_MEMORY_ENV."""
    import verl_arpo.quickstart as qs

    [(cmd, env)] = _stage_commands(tmp_path, monkeypatch, ("evaluate", "sft", tmp_path / "model"))
    assert "verl_arpo.trainer.main_eval" in cmd
    assert env == {**qs.STAGE_ENV, **qs.KEEP_FREED_MEMORY_ENV}


def test_the_quickstart_trains_sft_with_freed_memory_kept(tmp_path, monkeypatch):
    """Quickstart.sft runs main_sft with STAGE_ENV and KEEP_FREED_MEMORY_ENV (1.15x a bf16 step, the same
    losses: docs/performance.md); the RL stage keeps glibc's mapping of large blocks."""
    import verl_arpo.quickstart as qs

    (sft_cmd, sft_env), (rl_cmd, rl_env) = _stage_commands(tmp_path, monkeypatch, ("sft", tmp_path / "base"),
                                                           ("rl", tmp_path / "sft_model"))
    assert "verl_arpo.trainer.main_sft" in sft_cmd and sft_env == {**qs.STAGE_ENV, **qs.KEEP_FREED_MEMORY_ENV}
    assert "verl_arpo.trainer.main_ppo" in rl_cmd and rl_env == qs.STAGE_ENV
