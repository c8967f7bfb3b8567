"""bench_precision: its ratios are oriented by the precision `auto` picks (> 1: the pick is faster), for
step seconds (lower is faster) and tokens/s (higher is faster), checked against ratios worked by hand; and
a stage's environment is the one the quickstart gives it."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_precision import stage_env, summarize  # noqa: E402

from verl_arpo.quickstart import KEEP_FREED_MEMORY_ENV, STAGE_ENV  # noqa: E402


def _rows():
    # two repetitions each; medians: SFT fp32 27 s, bf16 18 s; evaluation fp32 280 tok/s, bf16 480 tok/s
    rows = []
    for step_fp32, step_bf16 in ((26.0, 17.0), (28.0, 19.0)):
        rows += [{"stage": "sft", "precision": "fp32", "step_s": step_fp32, "peak_rss_mib": 6200.0},
                 {"stage": "sft", "precision": "bf16", "step_s": step_bf16, "peak_rss_mib": 5900.0}]
    for tps_fp32, tps_bf16 in ((270.0, 470.0), (290.0, 490.0)):
        rows += [{"stage": "eval", "precision": "fp32", "tokens_per_s": tps_fp32, "peak_rss_mib": 8400.0},
                 {"stage": "eval", "precision": "bf16", "tokens_per_s": tps_bf16, "peak_rss_mib": 4800.0}]
    return rows


def test_ratio_is_the_picks_speed_over_the_others():
    sft, ev = summarize(_rows(), "bf16")
    assert (sft["ours"], sft["baseline"]) == (18.0, 27.0)
    assert sft["ratio"] == pytest.approx(27 / 18) and sft["met"] is True          # 1.5: bf16 steps are shorter
    assert (ev["ours"], ev["baseline"]) == (480.0, 280.0)
    assert ev["ratio"] == pytest.approx(480 / 280) and ev["met"] is True
    assert (sft["peak_mib"], sft["bare_peak_mib"]) == (5900.0, 6200.0)


def test_a_machine_that_picks_fp32_reads_the_same_runs_the_other_way():
    sft, ev = summarize(_rows(), "fp32")
    assert sft["ratio"] == pytest.approx(18 / 27) and sft["met"] is False        # fp32 would be the slower pick
    assert ev["ratio"] == pytest.approx(280 / 480) and ev["met"] is False
    assert "fp32 = auto's pick" in sft["metric"]


def test_a_stage_missing_an_arm_is_left_out():
    rows = [r for r in _rows() if not (r["stage"] == "eval" and r["precision"] == "fp32")]
    assert [e["metric"].split(",")[0] for e in summarize(rows, "bf16")] == ["SFT step s"]


def test_stage_environment_is_the_quickstarts():
    sft = ev = stage_env()
    assert STAGE_ENV.items() <= sft.items() and STAGE_ENV.items() <= ev.items()
    assert KEEP_FREED_MEMORY_ENV.items() <= ev.items() and KEEP_FREED_MEMORY_ENV.items() <= sft.items()
