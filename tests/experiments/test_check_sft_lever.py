"""experiments/check_sft_lever.py: the SFT lever's report against differences and t-intervals computed
by hand, its verdicts and refusals, and a whole check of one seed on the tiny model that resumes
without training again."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import check_sft_lever as csl  # noqa: E402

QUESTIONS = [f"q{i}" for i in range(4)]


def _run(seed, correct, step_s=10.0, commit="abc", precision="bf16"):
    return {"seed": seed, "eval": {"questions": QUESTIONS, "correct": [float(c) for c in correct]},
            "sft_step_s": step_s, "wall_s": {"sft": 24 * step_s, "eval": 30.0}, "final_loss": 0.5,
            "commit": commit, "precision": precision}


def test_the_sft_lever_against_the_baseline_by_hand():
    base = {42: _run(42, [1, 0, 1, 0], 12), 43: _run(43, [1, 1, 1, 0], 11), 44: _run(44, [0, 0, 1, 1], 13)}
    lever = {42: _run(42, [1, 1, 1, 0], 10, "new"), 43: _run(43, [1, 1, 1, 0], 10, "new"),
             44: _run(44, [1, 0, 1, 1], 11, "new"), 45: _run(45, [1, 1, 1, 1])}   # 45: no baseline yet, left out
    rep = csl.sft_lever_report(base, lever, "x", "what changed")
    assert rep["seeds"] == [42, 43, 44] and rep["n_questions"] == 4
    d = [0.25, 0.0, 0.25]                 # per seed: lever − baseline, by hand
    mean = sum(d) / 3
    half = 4.303 * math.sqrt(sum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3)   # t_{0.975, 2}
    assert rep["lever_minus_baseline"]["t_over_seeds"] == pytest.approx([mean, mean - half, mean + half])
    assert rep["sft_step_ratio"] == pytest.approx(12 / 10)   # medians of the step seconds
    assert rep["per_seed"][0]["commit"] == ["abc", "new"]
    assert rep["verdict"].startswith("no loss detected at 3 seeds")
    md = csl.markdown(rep)
    assert "| 43 | 0.750 | 0.750 | 11.00, 10.00 |" in md and "1.20×" in md and "what changed" in md


def test_a_lever_that_loses_at_every_seed_is_worse_and_other_questions_are_refused():
    base = {k: _run(k, [1, 1, 1, 0]) for k in (42, 43, 44)}
    lever = {42: _run(42, [1, 0, 0, 0]), 43: _run(43, [0, 1, 0, 0]), 44: _run(44, [1, 1, 0, 0])}
    rep = csl.sft_lever_report(base, lever, "x", None)
    assert rep["verdict"].startswith("worse: the lever loses") and rep["lever_minus_baseline"]["t_over_seeds"][2] < 0
    assert csl.sft_lever_report(base, {42: lever[42]}, "x", None)["verdict"].startswith("1 seed: no interval")
    assert csl.sft_lever_report(base, {}, "x", None)["verdict"] == "no seed finished by both yet"
    other = {42: {**lever[42], "eval": {"questions": ["z"] * 4, "correct": [1.0] * 4}}}
    with pytest.raises(ValueError, match="seed 42"):
        csl.sft_lever_report(base, other, "x", None)
    with pytest.raises(ValueError, match="precision"):
        csl.sft_lever_report(base, {42: _run(42, [1, 1, 1, 1], precision="fp32")}, "x", None)


@pytest.mark.parametrize("argv", [["--arm", "a/b"], ["--arm", "baseline", "--report"]])
def test_bad_arguments_are_refused(argv, tmp_path):
    with pytest.raises(SystemExit):
        csl.main([*argv, "--results", str(tmp_path)])


@pytest.mark.slow
def test_a_tiny_check_trains_both_arms_once_and_reports(tmp_path):
    env = {**os.environ, "VERL_ARPO_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    common = ["--tiny", "--smoke", "--seeds", "42", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "res")]
    script = str(ROOT / "experiments" / "check_sft_lever.py")
    for arm in (["--arm", "baseline"], ["--arm", "same_code", "--code", "nothing: the same checkout"]):
        r = subprocess.run([sys.executable, script, *arm, *common], cwd=ROOT, capture_output=True, text=True,
                           timeout=900, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "sft: started" in r.stdout
    rep = json.loads((tmp_path / "res" / "same_code.json").read_text())
    assert rep["seeds"] == [42] and rep["n_questions"] == 30
    # the same code and seed: the same SFT model bit for bit, so the same answers
    runs = [json.loads((tmp_path / "res" / a / "seed42.json").read_text()) for a in ("baseline", "same_code")]
    assert runs[0]["sft_sha256"] == runs[1]["sft_sha256"] and rep["per_seed"][0]["baseline"] == rep["per_seed"][0]["lever"]
    r = subprocess.run([sys.executable, script, "--arm", "same_code", *common], cwd=ROOT, capture_output=True,
                       text=True, timeout=900, env=env)
    assert r.returncode == 0 and "sft: started" not in r.stdout
