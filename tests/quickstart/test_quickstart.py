"""The quickstart pipeline end to end (tiny model, smoke budget): every stage runs the real entry
points (model prep, main_sft, main_ppo, convert_verl_to_hf, main_eval) and the summary is complete."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_tiny_smoke(tmp_path):
    out = tmp_path / "qs"
    r = subprocess.run([sys.executable, "-m", "verl_arpo.quickstart", "--tiny", "--smoke", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["test"]["n"] == 30
    for tag in ("base", "sft", "rl"):
        lo, hi = s["test"][tag]["ci95"]
        assert 0.0 <= lo <= s["test"][tag]["acc"] <= hi <= 1.0
        assert tag in s["tool_calls_per_question"]
    assert set(s["wall_s"]) >= {"prepare", "sft", "rl", "eval", "total"}
    assert (out / "reward_curve.png").stat().st_size > 0
    assert (Path(s["hf_dir"]) / "config.json").exists()
    assert len(s["reward_curve"]) == s["rl_steps"]
    # a re-run reuses every finished stage (nothing is rewritten) and still reports what each stage cost
    stamps = {f: (out / f).stat().st_mtime_ns for f in ("logs/sft.log", "logs/rl.log", "logs/eval_rl.log",
                                                         "rl/latest_checkpointed_iteration.txt")}
    r2 = subprocess.run([sys.executable, "-m", "verl_arpo.quickstart", "--tiny", "--smoke", "--out", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert {f: (out / f).stat().st_mtime_ns for f in stamps} == stamps
    s2 = json.loads((out / "summary.json").read_text())
    assert {k: s2["wall_s"][k] for k in ("sft", "rl", "eval")} == {k: s["wall_s"][k] for k in ("sft", "rl", "eval")}
    assert s2["wall_s"]["sft"] > 0 and s2["wall_s"]["rl"] > 0
