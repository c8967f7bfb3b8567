"""experiments/check_lever.py: the lever's report against differences and t-intervals computed by
hand, its verdicts, the refusals (a store's settings, bad arguments), and (slow) a whole check on the
tiny model that resumes without training again."""
import json
import math
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import check_lever as cl  # noqa: E402

QUESTIONS = [f"q{i}" for i in range(4)]


def _eval(correct):
    return {"questions": QUESTIONS, "correct": [float(c) for c in correct]}


def _run(correct, rl_s=100.0, step_s=7.0, calls=0.5):
    return {"eval": _eval(correct), "wall_s": {"rl": rl_s, "eval": 20.0}, "load_avg_start": [0.1, 0.2, 0.3],
            "train": {"mean": {"step_s": step_s, "executed_tool_calls_per_traj": calls}}}


def test_the_lever_against_the_baseline_by_hand():
    sft = _eval([0, 0, 1, 0])
    base = {50: _run([1, 0, 1, 0], rl_s=100), 51: _run([1, 1, 1, 0], rl_s=120), 52: _run([0, 0, 1, 1], rl_s=110)}
    lever = {50: _run([1, 1, 1, 0], rl_s=80), 51: _run([1, 1, 1, 0], rl_s=90), 52: _run([1, 0, 1, 1], rl_s=100),
             53: _run([1, 1, 1, 1])}   # pair 53: the baseline has not run it, so it is left out
    rep = cl.lever_report(sft, base, lever, "x", ["a=b"])
    assert rep["pairs"] == [50, 51, 52] and rep["n_questions"] == 4 and rep["sft_accuracy"] == 0.25
    d = [0.25, 0.0, 0.25]                 # per pair: lever − baseline, by hand
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = 4.303 * sd / math.sqrt(3)      # t_{0.975, 2}
    assert rep["lever_minus_baseline"]["t_over_pairs"] == pytest.approx([mean, mean - half, mean + half])
    gains = [0.5 - 0.25, 0.75 - 0.25, 0.5 - 0.25]
    assert rep["gain_over_sft"]["baseline"]["t_over_pairs"][0] == pytest.approx(sum(gains) / 3)
    assert [r["baseline"] for r in rep["per_pair"]] == [0.5, 0.75, 0.5]
    assert rep["per_pair"][1]["rl_s"] == [120, 90]
    assert rep["rl_seconds_ratio"] == pytest.approx(110 / 90)   # medians
    assert rep["verdict"].startswith("no loss detected at 3 pairs")
    md = cl.markdown(rep)
    assert "| 51 | 0.750 | 0.750 | 120, 90 |" in md and "1.22×" in md


def test_a_lever_that_loses_at_every_pair_is_worse_and_one_pair_has_no_interval():
    sft = _eval([0, 0, 0, 0])
    base = {k: _run([1, 1, 1, 0]) for k in (50, 51, 52)}
    lever = {50: _run([1, 0, 0, 0]), 51: _run([0, 1, 0, 0]), 52: _run([1, 1, 0, 0])}
    rep = cl.lever_report(sft, base, lever, "x", [])
    assert rep["verdict"].startswith("worse: the lever loses")
    assert rep["lever_minus_baseline"]["t_over_pairs"][2] < 0
    one = cl.lever_report(sft, {50: base[50]}, {50: lever[50]}, "x", [])
    assert one["verdict"].startswith("1 pair: no interval yet (difference -0.500)")
    assert cl.lever_report(sft, {}, {}, "x", [])["verdict"] == "no pair finished by both yet"


def test_a_run_on_other_questions_is_refused():
    bad = _run([1, 0, 1, 0])
    bad["eval"]["questions"] = ["other", *QUESTIONS[1:]]
    with pytest.raises(ValueError, match="pair 50: a run answered other questions"):
        cl.lever_report(_eval([0] * 4), {50: bad}, {50: _run([1] * 4)}, "x", [])


def test_a_store_keeps_the_settings_its_runs_were_made_with(tmp_path):
    cl.pin(tmp_path / "s", {"overrides": ["a=1"]})
    cl.pin(tmp_path / "s", {"overrides": ["a=1"]})     # the same settings: resumes
    with pytest.raises(SystemExit, match=r"holds runs made with \{'overrides': \['a=1'\]\}"):
        cl.pin(tmp_path / "s", {"overrides": ["a=2"]})


@pytest.mark.parametrize("argv, message", [
    (["--name", "baseline", "a=b"], "name the lever"),
    (["--name", "x", "nokey"], "'nokey' is not a Hydra override"),
    (["--name", "x"], "a lever is its overrides"),
    (["--name", "x", "--code", "a kernel"], "holds no baseline run yet"),   # a code lever pairs with earlier runs
])
def test_bad_arguments_are_refused(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        cl.main([*argv, "--out", str(tmp_path / "o"), "--results", str(tmp_path / "r")])
    assert message in capsys.readouterr().err


def test_a_code_lever_reports_what_changed_and_each_arm_s_commits():
    sft = _eval([0, 0, 0, 0])
    base = {k: {**_run([1, 0, 1, 0]), "commit": "aaa1111"} for k in (50, 51)}
    lever = {k: {**_run([1, 1, 1, 0]), "commit": "bbb2222"} for k in (50, 51)}
    rep = cl.lever_report(sft, base, lever, "tree", [], code="balance by prefix tree")
    assert rep["code"] == "balance by prefix tree" and rep["per_pair"][0]["commit"] == ["aaa1111", "bbb2222"]
    assert "Code: balance by prefix tree (commits of the runs, baseline / lever: aaa1111 / bbb2222)" in cl.markdown(rep)
    assert "Code:" not in cl.markdown(cl.lever_report(sft, base, lever, "key", ["a=1"]))


def test_the_report_refuses_a_baseline_of_another_sft_model(tmp_path):
    for name, sha in (("baseline", "aaa"), ("x", "bbb")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "sft.json").write_text(json.dumps({"sft_sha256": sha, "precision": "bf16", "eval": {}}))
    a = Namespace(name="x", overrides=[], results=tmp_path)
    with pytest.raises(SystemExit, match="cannot be paired"):
        cl.write_report(a, cl.Store(tmp_path / "baseline"), cl.Store(tmp_path / "x"))


@pytest.mark.slow
def test_a_tiny_check_runs_both_arms_and_a_second_call_trains_nothing(tmp_path):
    env = {**os.environ, "VERL_ARPO_CACHE": str(tmp_path / "cache"), "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, str(ROOT / "experiments" / "check_lever.py"), "--name", "one_process", "--tiny", "--smoke",
           "--pairs", "2", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "res"),
           "--both", "data.train_batch_size=3", "trainer.single_process=true", "trainer.n_gpus_per_node=1"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((tmp_path / "res" / "one_process.json").read_text())
    assert rep["pairs"] == [50, 51] and rep["n_questions"] == 30 and rep["verdict"]
    base = json.loads((tmp_path / "res" / "baseline" / "arpo_pair50.json").read_text())
    lever = json.loads((tmp_path / "res" / "one_process" / "arpo_pair50.json").read_text())
    assert "trainer.single_process=true" in lever["overrides"] and "trainer.single_process=true" not in base["overrides"]
    assert "data.train_batch_size=3" in base["overrides"] and "data.seed=51" in base["overrides"]
    assert "rl: started" in r.stdout
    r2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r2.returncode == 0 and "rl: started" not in r2.stdout and "sft: started" not in r2.stdout
    assert json.loads((tmp_path / "res" / "one_process.json").read_text())["per_pair"] == rep["per_pair"]
