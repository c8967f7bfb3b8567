"""bench_arm_cost: the ratio is the baseline's seconds over this checkout's (> 1: an arm costs less now),
the RL stage's totals are sums over its logged steps, and a `--from` that is not a finished quickstart is
refused by name; all against values worked by hand."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_arm_cost import rl_metrics, seed_run, sft_arguments, summarize  # noqa: E402


def _row(arm, rl, merge, ev, tokens, gen):
    return {"arm": arm, "rl_s": rl, "merge_s": merge, "eval_rl_s": ev, "arm_s": rl + merge + ev,
            "rl": {"generated_tokens": tokens, "gen_s": gen}}


def test_ratios_are_the_baselines_cost_over_ours_and_our_rate_over_theirs():
    rows = [_row("baseline", 700.0, 8.0, 300.0, 15000, 300.0), _row("this checkout", 600.0, 7.0, 200.0, 14000, 200.0),
            _row("this checkout", 620.0, 7.0, 210.0, 14000, 175.0), _row("baseline", 720.0, 8.0, 320.0, 15000, 250.0)]
    arm, rl, ev, rate = summarize(rows)
    # medians: baseline arm (1008, 1048) -> 1028, ours (807, 837) -> 822
    assert (arm["ours"], arm["baseline"]) == (822.0, 1028.0) and arm["ratio"] == pytest.approx(1028 / 822)
    assert (rl["ours"], rl["baseline"]) == (610.0, 710.0) and rl["ratio"] == pytest.approx(710 / 610)
    assert ev["ratio"] == pytest.approx(310 / 205)
    # tokens/s: ours 70 and 80 -> 75; baseline 50 and 60 -> 55; higher is better, so ours / baseline
    assert (rate["ours"], rate["baseline"]) == (75.0, 55.0) and rate["ratio"] == pytest.approx(75 / 55)


def test_no_ratio_without_both_arms():
    assert summarize([_row("baseline", 700.0, 8.0, 300.0, 1, 1.0)]) == []


def test_rl_totals_sum_the_logged_steps_and_leave_out_what_a_checkout_does_not_log(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1, "critic/score/mean": 0.85, "rollout/tokens_generated": 1140.0, "timing_s/gen": 20.0, "timing_s/step": 47.5,
                             "perf/cpu_memory_peak_gb": 2.8}) + "\n"
                 + json.dumps({"step": 2, "critic/score/mean": 0.79, "rollout/tokens_generated": 1000.0, "timing_s/gen": 19.25, "timing_s/step": 41.0,
                               "perf/cpu_memory_peak_gb": 3.1}) + "\n")
    assert rl_metrics(f) == {"steps": 2, "generated_tokens": 2140.0, "gen_s": 39.2, "step_s": 88.5, "worker_peak_gb": 3.1}


def test_from_must_be_a_finished_quickstart_and_gives_its_sft_models_arguments(tmp_path):
    with pytest.raises(SystemExit, match="eval_sft.json"):
        (tmp_path / "sft_model").mkdir()
        (tmp_path / "eval_base.json").write_text("{}")
        sft_arguments(tmp_path)
    (tmp_path / "eval_sft.json").write_text("{}")
    with pytest.raises(SystemExit, match="verl_arpo_sft.json"):
        sft_arguments(tmp_path)
    (tmp_path / "sft_model" / "verl_arpo_sft.json").write_text(json.dumps({"steps": 24, "epochs": 1, "precision": "bf16"}))
    assert sft_arguments(tmp_path) == ["--precision", "bf16", "--sft_steps", "24"]
    # a run folder gets the reused stages and only their recorded seconds
    (tmp_path / "stage_seconds.json").write_text(json.dumps({"eval_base": 31.3, "sft": 459.2, "eval_sft": 194.8,
                                                             "rl": 612.4, "eval_rl": 201.7}))
    run = tmp_path / "run"
    seed_run(tmp_path, run)
    assert sorted(p.name for p in run.iterdir()) == ["eval_base.json", "eval_sft.json", "sft_model", "stage_seconds.json"]
    assert json.loads((run / "stage_seconds.json").read_text()) == {"eval_base": 31.3, "sft": 459.2, "eval_sft": 194.8}


def test_a_revision_this_clone_lacks_is_refused_by_name():
    from bench_arm_cost import git

    with pytest.raises(SystemExit, match="git rev-parse --verify no-such-revision-here failed"):
        git("rev-parse", "--verify", "no-such-revision-here")
