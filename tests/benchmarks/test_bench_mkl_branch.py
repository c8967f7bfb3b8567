"""bench_mkl_branch: its ratios are oriented by the MKL code path this machine's processes get (> 1: that
path is faster), for step seconds (lower is faster) and tokens/s (higher is faster), against ratios worked by
hand."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_mkl_branch import summarize  # noqa: E402


def _rows():
    # two repetitions each; medians: SFT AVX2 24 s, MKL's own ("") 30 s; evaluation AVX2 300 tok/s, own 200 tok/s
    rows = []
    for avx2, auto in ((23.0, 29.0), (25.0, 31.0)):
        rows += [{"stage": "sft", "path": "AVX2", "step_s": avx2, "peak_rss_mib": 6000.0},
                 {"stage": "sft", "path": "", "step_s": auto, "peak_rss_mib": 6100.0}]
    for avx2, auto in ((290.0, 190.0), (310.0, 210.0)):
        rows += [{"stage": "eval", "path": "AVX2", "tokens_per_s": avx2, "peak_rss_mib": 8000.0},
                 {"stage": "eval", "path": "", "tokens_per_s": auto, "peak_rss_mib": 8200.0}]
    return rows


def test_ratio_is_the_default_paths_speed_over_the_others():
    sft, ev = summarize(_rows(), "AVX2")
    assert (sft["ours"], sft["baseline"]) == (24.0, 30.0)
    assert sft["ratio"] == pytest.approx(30 / 24) and sft["met"] is True
    assert (ev["ours"], ev["baseline"]) == (300.0, 200.0)
    assert ev["ratio"] == pytest.approx(300 / 200) and ev["met"] is True
    assert (ev["peak_mib"], ev["bare_peak_mib"]) == (8000.0, 8200.0)


def test_an_intel_machine_reads_the_same_runs_the_other_way():
    sft, ev = summarize(_rows(), "")
    assert sft["ratio"] == pytest.approx(24 / 30) and sft["met"] is False
    assert ev["ratio"] == pytest.approx(200 / 300) and "MKL's own pick = the default" in ev["metric"]
