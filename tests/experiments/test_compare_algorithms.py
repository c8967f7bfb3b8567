"""experiments/compare_algorithms.py: the paired bootstrap against a plain reference loop, one run's
training record from real metrics and rollout-dump files, the report from finished runs only, and
(slow) the whole experiment on the tiny model, killed and resumed."""
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))

import compare_algorithms as ca  # noqa: E402
from verl_arpo.utils import stats  # noqa: E402


# --------------------------------------------------------------------------- the bootstrap
def _reference_bootstrap(diff, n_boot, seed):
    """A plain loop: draw K pairs and Q questions with replacement, average diff over the grid."""
    rng = random.Random(seed)
    k, q = len(diff), len(diff[0])
    means = []
    for _ in range(n_boot):
        ks = [rng.randrange(k) for _ in range(k)]
        qs = [rng.randrange(q) for _ in range(q)]
        means.append(sum(diff[a][b] for a in ks for b in qs) / (k * q))
    means.sort()
    return means[int(0.025 * n_boot)], means[int(0.975 * n_boot) - 1]


def test_bootstrap_matches_a_plain_loop_over_questions_and_pairs():
    rng = np.random.default_rng(1)
    # 3 seed pairs x 120 questions, the pairs differ in their mean (0.05, 0.10, 0.15): both sources of spread
    diff = np.stack([rng.choice([-1.0, 0.0, 1.0], size=120, p=[0.1, 0.9 - 0.1 - m, 0.1 + m])
                     for m in (0.05, 0.10, 0.15)])
    mean, lo, hi = stats.paired_bootstrap(diff, n_boot=3000)
    ref_lo, ref_hi = _reference_bootstrap(diff.tolist(), 3000, seed=7)
    assert mean == pytest.approx(diff.mean())
    assert lo < mean < hi
    # two independent Monte-Carlo estimates of the same percentiles: they agree to the resampling error
    assert lo == pytest.approx(ref_lo, abs=0.012) and hi == pytest.approx(ref_hi, abs=0.012)


def test_one_pair_is_the_paired_bootstrap_over_questions():
    """K = 1: the interval is the usual one for a paired mean, ±1.96·sd/√n (n = 600 here)."""
    rng = np.random.default_rng(2)
    d = rng.choice([-1.0, 0.0, 1.0], size=600, p=[0.08, 0.77, 0.15])
    mean, lo, hi = stats.paired_bootstrap(d[None, :])
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))
    assert (hi - lo) / 2 == pytest.approx(half, rel=0.1)
    assert (lo + hi) / 2 == pytest.approx(mean, abs=0.01)


def test_a_constant_difference_has_no_spread_and_the_seed_repeats():
    assert stats.paired_bootstrap(np.full((2, 50), 0.25)) == (0.25, 0.25, 0.25)
    d = np.random.default_rng(3).integers(-1, 2, size=(2, 80)).astype(float)
    assert stats.paired_bootstrap(d) == stats.paired_bootstrap(d)


# --------------------------------------------------------------------------- one run's record
def _write_run(d: Path, steps: list[dict], trajectories: int) -> tuple[Path, Path]:
    (d / "rollout").mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for m in steps:
            f.write(json.dumps(m) + "\n")
    for m in steps:
        (d / "rollout" / f"rollout_{m['step']}.jsonl").write_text("".join("{}\n" for _ in range(trajectories)))
    return d / "metrics.jsonl", d / "rollout"


def test_training_record_counts_executed_calls_per_trajectory(tmp_path):
    steps = [
        {"step": 1, "critic/score/mean": 0.1, "tools/python/calls": 5.0, "tools/search/calls": 7.0, "tools/calls": 12.0,
         "tools/calls_per_traj": 1.5, "rollout/branches": 4.0, "rollout/tokens_generated": 900.0,
         "perf/total_num_tokens": 5000.0, "timing_s/step": 40.0, "timing_s/gen": 15.0},
        # a resumed run logs step 2 twice: the last line counts
        {"step": 2, "critic/score/mean": 0.9, "tools/python/calls": 100.0},
        {"step": 2, "critic/score/mean": 0.3, "tools/python/calls": 3.0, "tools/search/calls": 3.0,  # no total: summed
         "tools/python/successes": 3.0, "tools/calls_per_traj": 0.5, "rollout/branches": 2.0,
         "rollout/tokens_generated": 700.0, "perf/total_num_tokens": 4000.0, "timing_s/step": 50.0,
         "timing_s/gen": 25.0},
    ]
    rec = ca.training_record(*_write_run(tmp_path, steps, trajectories=24))
    assert rec["steps"] == 2 and rec["trajectories_per_step"] == 24
    assert rec["per_step"]["reward"] == [0.1, 0.3]
    assert rec["per_step"]["executed_tool_calls_per_traj"] == [12 / 24, 6 / 24]  # the total counted once; successes are not calls
    assert rec["mean"]["executed_tool_calls_per_traj"] == pytest.approx((12 / 24 + 6 / 24) / 2)
    assert rec["mean"]["tool_calls_in_traj_per_traj"] == pytest.approx(1.0)
    assert rec["mean"]["branches"] == 3.0 and rec["mean"]["tokens_generated"] == 800.0
    assert rec["mean"]["step_s"] == 45.0 and rec["mean"]["rollout_s"] == 20.0
    assert rec["mean"]["entropy_before_tools"] is None  # not logged: no number is made up


def test_a_stopped_run_continues_from_its_checkpoint_with_its_earlier_seconds(tmp_path):
    from verl_arpo.utils.checkpoint.layout import begin_checkpoint, publish_checkpoint

    rl = tmp_path / "rl"
    assert ca.checkpointed_step(rl) == 0                       # nothing: the run starts over
    (rl / "logs").mkdir(parents=True)
    (rl / "latest_checkpointed_iteration.txt").write_text("6\n")
    assert ca.checkpointed_step(rl) == 0                       # a tracker without its checkpoint: nothing to resume
    for step in (3, 6):                                         # checkpoints as the trainer publishes them
        staging = begin_checkpoint(str(rl), step)
        (Path(staging) / "data.pt").write_bytes(b"step %d" % step)
        publish_checkpoint(str(rl), step, staging)
    assert ca.checkpointed_step(rl) == 6
    (rl / "global_step_6" / "data.pt").write_bytes(b"damaged")  # the trainer would skip it: so does the runner
    assert ca.checkpointed_step(rl) == 3
    (rl / "global_step_6" / "data.pt").write_bytes(b"step 6")
    assert ca.checkpointed_step(rl) == 6
    lines = [{"step": 1, "timing_s/step": 40.0}, {"step": 2, "timing_s/step": 99.0},  # step 2 logged twice
             {"step": 2, "timing_s/step": 50.0}, {"step": 7, "timing_s/step": 1000.0}]  # 7: after the checkpoint
    lines = [{**m, "critic/score/mean": 0.5} for m in lines]   # what marks a step's line in metrics.jsonl
    (rl / "logs" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert ca.earlier_steps_s(rl / "logs" / "metrics.jsonl", 6) == 90.0
    assert ca.earlier_steps_s(rl / "logs" / "metrics.jsonl", 0) == 0.0
    runs = {("arpo", 101): {"resumed_from_step": 6}, ("grpo", 101): {}}
    assert ca.resumed_runs(runs) == [{"algo": "arpo", "pair": 101, "step": 6}]


def test_a_stopped_run_resumes_only_under_its_own_settings_with_every_step_logged(tmp_path):
    """resume_refusal: the reasons a stopped run starts over instead of continuing."""
    run = tmp_path / "arpo_pair101"
    logs = run / "rl" / "logs"
    logs.mkdir(parents=True)
    identity = {"config_sha256": "abc", "rl_steps": 13, "precision": "fp32", "sft_sha256": "s", "overrides": ["x=1"]}

    def log(*steps):
        (logs / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "critic/score/mean": 0.5}) + "\n"
                                                    for k in steps))

    log(1, 2, 3, 4, 5, 6)
    assert ca.resume_refusal(run, identity, 0) == "no RL checkpoint"
    assert ca.resume_refusal(run, identity, 6) is None           # a run from before run.json: the rest holds
    assert "past this run's 5 steps" in ca.resume_refusal(run, {**identity, "rl_steps": 5}, 6)
    ca.write_atomic(run / ca.RUN_IDENTITY, identity)
    assert ca.resume_refusal(run, identity, 6) is None
    assert ca.resume_refusal(run, {**identity, "config_sha256": "new"}, 6) == "it began under another config_sha256"
    assert "overrides, precision" in ca.resume_refusal(run, {**identity, "precision": "bf16", "overrides": []}, 6)
    log(1, 2, 3, 4, 5)                                             # killed between step 6's checkpoint and its log line
    assert ca.resume_refusal(run, identity, 6) == "its metrics log lacks step(s) [6] before its checkpoint at step 6"
    assert ca.resume_refusal(run, identity, 5) is None


def test_training_record_refuses_a_run_that_logged_nothing(tmp_path):
    with pytest.raises(ValueError, match="no training step was logged"):
        ca.training_record(*_write_run(tmp_path, [], trajectories=4))


# --------------------------------------------------------------------------- the report
QUESTIONS = [f"q{i}" for i in range(6)]
KIND_OF = ["arithmetic", "lookup", "two-step"] * 2


def _eval_report(correct, calls=1.0):
    sources = {v: k for k, v in ca.KINDS.items()}
    samples = [{"question": q, "data_source": sources[k], "samples": [{"correct": bool(c)}]}
               for q, k, c in zip(QUESTIONS, KIND_OF, correct)]
    per = {sources[k]: {"accuracy": float(np.mean([c for c, kk in zip(correct, KIND_OF) if kk == k]))}
           for k in ca.KINDS.values()}
    return {"overall": {"accuracy": float(np.mean(correct)), "tool_calls_per_question": calls},
            "per_data_source": per, "samples": samples}


def _result(algo, pair, correct, executed):
    return {"algo": algo, "pair": pair, "eval": ca.eval_record(_eval_report(correct)),
            "train": {"per_step": {"reward": [0.1, 0.2]}, "trajectories_per_step": 4,
                      "mean": {"executed_tool_calls_per_traj": executed, "branches": 1.0, "tokens_generated": 10.0,
                               "tokens_trained": 20.0, "step_s": 3.0, "entropy_before_tools": None}},
            "wall_s": {"rl": 60.0, "eval": 5.0}}


def test_report_pairs_runs_compares_with_grpo_and_skips_unfinished_pairs(tmp_path):
    sft = [1, 0, 0, 1, 0, 0]
    runs = {("grpo", 0): _result("grpo", 0, [1, 1, 0, 1, 0, 0], executed=1.0),
            ("arpo", 0): _result("arpo", 0, [1, 1, 1, 1, 0, 0], executed=0.5),
            ("grpo", 1): _result("grpo", 1, [1, 0, 0, 1, 1, 0], executed=2.0),
            ("arpo", 1): _result("arpo", 1, [1, 1, 0, 1, 1, 1], executed=0.5),
            ("grpo", 2): _result("grpo", 2, [1, 1, 1, 1, 1, 1], executed=9.0)}  # pair 2: ARPO never finished
    rep = ca.build_report(ca.eval_record(_eval_report(sft)), runs, ("grpo", "arpo"))
    assert rep["pairs"] == [0, 1] and rep["n_questions"] == 6
    arpo = rep["algos"]["arpo"]
    assert arpo["accuracy"][0] == pytest.approx((4 + 5) / 12)
    assert arpo["gain_over_sft"][0] == pytest.approx((4 + 5) / 12 - 2 / 6)
    assert arpo["per_kind"]["two-step"] == pytest.approx((0.5 + 0.5) / 2)
    vs = rep["vs_baseline"]["arpo"]
    assert vs["accuracy_delta"][0] == pytest.approx(((4 - 3) + (5 - 3)) / 12)
    assert vs["executed_tool_calls_ratio"] == pytest.approx(0.5 / 1.5)   # ratio of the means over pairs
    assert vs["executed_tool_calls_ratio_per_pair"] == pytest.approx([0.5, 0.25])
    assert rep["algos"]["grpo"]["train"]["executed_tool_calls_per_traj"] == (1.5, 1.0, 2.0)  # pair 2 left out
    md = ca.markdown(rep)
    assert "| ARPO |" in md and "(0.33×)" in md and "Seed pairs: 2 (0, 1)" in md
    assert vs["budget_ratio"]["executed_tool_calls"] == pytest.approx(0.5 / 1.5)
    assert vs["accuracy_delta_per_pair"] == pytest.approx([1 / 6, 2 / 6])
    ca.picture(rep, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_runs_from_another_sft_model_stay_in_and_a_one_model_sensitivity_is_given():
    """Pair 2's ARPO run started from a retrained SFT model (sha 'b…', another CPU): the primary interval
    keeps all 3 pairs; the sensitivity is the t-interval over pairs 0 and 1 alone, by hand."""
    sft = [0] * 6
    per_pair = {0: ([1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]),   # ARPO − GRPO: +1/6
                1: ([1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]),   # +2/6
                2: ([1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0])}   # −2/6
    runs = {}
    for p, (g, a) in per_pair.items():
        runs[("grpo", p)] = {**_result("grpo", p, g, 1.0), "sft_sha256": "a" * 64, "cpu_flags": ["avx2", "fma"]}
        runs[("arpo", p)] = {**_result("arpo", p, a, 1.0), "sft_sha256": "a" * 64, "cpu_flags": ["avx2", "fma"]}
    runs[("arpo", 2)].update(sft_sha256="b" * 64, cpu_flags=["avx2", "avx512f", "amx_bf16"])
    rep = ca.build_report(ca.eval_record(_eval_report(sft)), runs, ("grpo", "arpo"), sft_sha="a" * 64)
    vs = rep["vs_baseline"]["arpo"]
    assert rep["pairs"] == [0, 1, 2] and rep["one_sft_pairs"] == [0, 1]
    assert vs["accuracy_delta"][0] == pytest.approx((1 + 2 - 2) / 18)          # all three pairs
    d = [1 / 6, 2 / 6]
    m, s = sum(d) / 2, math.sqrt(sum((x - sum(d) / 2) ** 2 for x in d) / 1)
    assert vs["accuracy_delta_one_sft"] == pytest.approx((m, m - 12.706 * s / math.sqrt(2), m + 12.706 * s / math.sqrt(2)))
    others = ca.other_start_runs(runs, "a" * 64)
    assert others == [{"algo": "arpo", "pair": 2, "sft_sha256": "b" * 64, "cpu": "AVX-512 + AMX"}]
    assert ca.cpu_kind(["avx2", "fma"]) == "AVX2" and ca.cpu_kind(["avx512f"]) == "AVX-512" and ca.cpu_kind(None) == "?"
    md = ca.markdown({**rep, "sft_sha256": "a" * 64, "other_start_runs": others})
    assert "arpo pair 2 (AVX-512 + AMX)" in md and "`bbbbbbbbbbbb`" in md and "over the 2 pair(s)" in md
    assert f"ARPO − GRPO {m:+.3f} [" in md
    # the same run while its pair is not complete: named, in no table, no sensitivity
    part = {k: r for k, r in runs.items() if k != ("grpo", 2)}
    rep3 = ca.build_report(ca.eval_record(_eval_report(sft)), part, ("grpo", "arpo"), sft_sha="a" * 64)
    md3 = ca.markdown({**rep3, "sft_sha256": "a" * 64, "other_start_runs": ca.other_start_runs(part, "a" * 64)})
    assert rep3["pairs"] == [0, 1] and "one_sft_pairs" not in rep3
    assert "arpo pair 2 (AVX-512 + AMX). Their pair is not complete" in md3 and "Sensitivity" not in md3
    # every run from the store's model: no sensitivity, nothing named
    same = {k: {**r, "sft_sha256": "a" * 64} for k, r in runs.items()}
    rep2 = ca.build_report(ca.eval_record(_eval_report(sft)), same, ("grpo", "arpo"), sft_sha="a" * 64)
    assert "one_sft_pairs" not in rep2 and "accuracy_delta_one_sft" not in rep2["vs_baseline"]["arpo"]
    assert ca.other_start_runs(same, "a" * 64) == [] and "another SFT model" not in ca.markdown(rep2)


def test_the_contrasts_between_arms_are_paired_differences_by_hand():
    """ARPO − ARPO_W0 (does the entropy matter) over 2 pairs, computed by hand; no contrast without both arms."""
    sft = [0] * 6
    runs = {("grpo", 0): _result("grpo", 0, [0] * 6, 1.0), ("grpo", 1): _result("grpo", 1, [0] * 6, 1.0),
            ("arpo", 0): _result("arpo", 0, [1, 1, 1, 0, 0, 0], 1.0), ("arpo", 1): _result("arpo", 1, [1, 0, 0, 0, 0, 0], 1.0),
            ("arpo_w0", 0): _result("arpo_w0", 0, [1, 0, 0, 0, 0, 0], 1.0),
            ("arpo_w0", 1): _result("arpo_w0", 1, [1, 1, 0, 0, 0, 0], 1.0)}
    rep = ca.build_report(ca.eval_record(_eval_report(sft)), runs, ("grpo", "arpo", "arpo_w0"))
    c = rep["contrasts"]["arpo-arpo_w0"]
    d = [2 / 6, -1 / 6]
    m, s = sum(d) / 2, math.sqrt(sum((x - sum(d) / 2) ** 2 for x in d))
    assert c["accuracy_delta_per_pair"] == pytest.approx(d)
    assert c["accuracy_delta"] == pytest.approx((m, m - 12.706 * s / math.sqrt(2), m + 12.706 * s / math.sqrt(2)))
    assert list(rep["contrasts"]) == ["arpo-arpo_w0"]          # arpo_before_call never ran
    md = ca.markdown(rep)
    assert f"- ARPO − ARPO_W0 (does the entropy steer usefully" in md and "per pair +0.333, -0.167." in md
    rep2 = ca.build_report(ca.eval_record(_eval_report(sft)), {k: v for k, v in runs.items() if k[0] != "arpo_w0"},
                           ("grpo", "arpo"))
    assert rep2["contrasts"] == {} and "ARPO_W0" not in ca.markdown(rep2)


def test_a_run_on_other_questions_is_refused():
    other = _result("arpo", 0, [1] * 6, 1.0)
    other["eval"]["questions"] = list(reversed(QUESTIONS))
    runs = {("grpo", 0): _result("grpo", 0, [1] * 6, 1.0), ("arpo", 0): other}
    with pytest.raises(ValueError, match="other questions than the SFT model"):
        ca.build_report(ca.eval_record(_eval_report([0] * 6)), runs, ("grpo", "arpo"))


def test_the_store_holds_finished_runs_of_one_experiment_only(tmp_path):
    store = ca.Store(tmp_path / "compare_algorithms")
    sft = ca.eval_record(_eval_report([1, 0, 0, 1, 0, 0]))
    store.bind("a" * 64, "fp32", sft)
    store.put(_result("grpo", 0, [1] * 6, 1.0))
    (store.root / "arpo_pair0.json.tmp").write_text('{"algo": "arpo", "pa')  # killed mid-write
    assert list(store.runs()) == [("grpo", 0)] and store.get("arpo", 0) is None
    assert ca.complete_pairs(store.runs(), ("grpo", "arpo")) == []
    store.bind("a" * 64, "fp32", sft)  # the same experiment again: accepted, nothing rewritten
    assert store.sft()["eval"] == sft
    assert store.sft_if("a" * 64, "fp32")["eval"] == sft  # a fresh clone's same SFT model: its evaluation reused
    assert store.sft_if("b" * 64, "fp32") is None and store.sft_if("a" * 64, "bf16") is None
    for sha, precision in (("b" * 64, "fp32"), ("a" * 64, "bf16")):  # another SFT model, another precision
        with pytest.raises(SystemExit, match="holds the runs of another experiment"):
            store.bind(sha, precision, sft)


def test_weights_sha256_follows_every_weight_byte(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "config.json").write_text("{}")
    sha = ca.weights_sha256(tmp_path)
    (tmp_path / "config.json").write_text('{"x": 1}')  # not a weight
    assert ca.weights_sha256(tmp_path) == sha
    w = bytearray((tmp_path / "model.safetensors").read_bytes())
    w[100] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(w))
    assert ca.weights_sha256(tmp_path) != sha


def test_seed_pairs_start_at_the_quickstarts_seeds():
    import yaml

    base = yaml.safe_load((ROOT / "configs" / "ppo_trainer.yaml").read_text())
    assert ca.seed_overrides(0) == [f"data.seed={base['data']['seed']}",
                                    f"actor_rollout_ref.rollout.seed={base['actor_rollout_ref']['rollout']['seed']}"]
    assert ca.seed_overrides(2) == ["data.seed=3", "actor_rollout_ref.rollout.seed=2"]


def test_bad_arguments_are_refused(capsys):
    for argv, msg in ((["--algos", "grpo,ppo2"], "--algos: unknown ['ppo2']"),
                      (["--algos", "arpo,aepo"], "must include the baseline 'grpo'"),
                      (["lr"], "'lr' is not a Hydra override")):
        with pytest.raises(SystemExit):
            ca.main(["--out", "/nonexistent/never-made", *argv])
        assert msg in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_tiny_experiment_runs_resumes_and_redoes_a_killed_run(tmp_path):
    out, results = tmp_path / "cmp", tmp_path / "results"
    env = {**os.environ, "VERL_ARPO_CACHE": str(tmp_path / "cache"), "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, str(ROOT / "experiments" / "compare_algorithms.py"), "--protocol", "legacy", "--tiny",
           "--smoke", "--pairs", "1", "--algos", "grpo,arpo", "--out", str(out), "--results", str(results),
           "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
           "trainer.max_actor_ckpt_to_keep=2"]   # both steps' checkpoints stay: a stop after step 1 can be staged
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = json.loads((results / "compare_algorithms.json").read_text())
    assert rep["pairs"] == [0] and set(rep["algos"]) == {"grpo", "arpo"} and rep["n_questions"] == 30
    grpo = json.loads((results / "compare_algorithms" / "grpo_pair0.json").read_text())
    assert grpo == {**json.loads((out / "runs" / "grpo_pair0" / "result.json").read_text())}
    assert grpo["train"]["steps"] == 2 and grpo["train"]["trajectories_per_step"] == 3 * 4
    assert "data.seed=1" in grpo["overrides"] and "actor_rollout_ref.rollout.initial_rollouts=null" in grpo["overrides"]
    assert grpo["commit"] and grpo["config_sha256"] and len(grpo["load_avg_start"]) == 3
    assert (results / "compare_algorithms.png").stat().st_size > 0 and "| GRPO |" in (results / "compare_algorithms.md").read_text()
    # stop ARPO's run after its training (the completion marker is gone): a re-run keeps its RL checkpoint,
    # merges and evaluates again, and reuses GRPO and the SFT model untouched
    arpo = out / "runs" / "arpo_pair0"
    (arpo / "result.json").unlink()
    (results / "compare_algorithms" / "arpo_pair0.json").unlink()
    kept = {p: p.stat().st_mtime_ns for p in (out / "runs" / "grpo_pair0" / "result.json", out / "eval_sft.json",
                                              results / "compare_algorithms" / "grpo_pair0.json",
                                              arpo / "rl" / "logs" / "metrics.jsonl")}
    r2 = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    assert "arpo_pair0: half-done (no result.json); RL checkpoint at step 2 of 2: training is complete" in r2.stdout
    assert "rl: started" not in r2.stdout and "eval: started" in r2.stdout
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert "sft: started" not in r2.stdout and "grpo_pair0" not in r2.stdout
    rep2 = json.loads((results / "compare_algorithms.json").read_text())
    assert rep2["algos"]["arpo"]["accuracy"] == rep["algos"]["arpo"]["accuracy"]   # the same model, evaluated again
    assert rep2["algos"]["arpo"]["reward_curves"] == rep["algos"]["arpo"]["reward_curves"]
    # stop it inside training (checkpoint of step 1 only, a stray file after it): the trainer resumes at step 1,
    # and the run ends where the uninterrupted one did
    (arpo / "result.json").unlink()
    (results / "compare_algorithms" / "arpo_pair0.json").unlink()
    import shutil
    shutil.rmtree(arpo / "rl" / "global_step_2")
    (arpo / "rl" / "latest_checkpointed_iteration.txt").write_text("1")
    (arpo / "stray.txt").write_text("half-written")
    r2b = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r2b.returncode == 0, r2b.stdout[-3000:] + r2b.stderr[-3000:]
    assert "RL checkpoint at step 1 of 2: training resumes there" in r2b.stdout
    assert "resumed from" in (arpo / "logs" / "rl.log").read_text()
    resumed = json.loads((results / "compare_algorithms" / "arpo_pair0.json").read_text())
    assert resumed["resumed_from_step"] == 1 and resumed["train"]["steps"] == 2
    rep2 = json.loads((results / "compare_algorithms.json").read_text())
    assert rep2["algos"]["arpo"]["reward_curves"]["0"] == pytest.approx(rep["algos"]["arpo"]["reward_curves"]["0"])
    assert rep2["resumed_runs"] == [{"algo": "arpo", "pair": 0, "step": 1}]
    assert "arpo pair 0 (from step 1)" in (results / "compare_algorithms.md").read_text()
    # a fresh clone (a new --out, the committed store): the SFT model is trained again, is the same
    # model (same sha256), and every stored run is reused: nothing is trained
    r3 = subprocess.run([*cmd[:cmd.index("--out") + 1], str(tmp_path / "fresh"), *cmd[cmd.index("--out") + 2:]],
                        cwd=ROOT, capture_output=True, text=True, timeout=1800, env=env)
    assert r3.returncode == 0, r3.stdout[-3000:] + r3.stderr[-3000:]
    assert "sft: started" in r3.stdout and "rl: started" not in r3.stdout
    assert json.loads((results / "compare_algorithms.json").read_text())["algos"] == rep2["algos"]


# --------------------------------------------------------------------------- issue 46: the protocol
def test_seed_t_interval_by_hand():
    """Per-pair means 0.02, 0.01, 0.04, 0.03: mean 0.025, s = 0.0129, t_{0.975,3} = 3.182."""
    diff = np.array([[0.02] * 10, [0.01] * 10, [0.04] * 10, [0.03] * 10])
    m, lo, hi = stats.seed_t_interval(diff)
    s = math.sqrt(sum((x - 0.025) ** 2 for x in (0.02, 0.01, 0.04, 0.03)) / 3)
    assert m == pytest.approx(0.025) and hi - m == pytest.approx(3.182 * s / 2) and m - lo == pytest.approx(hi - m)
    assert math.isnan(stats.seed_t_interval(diff[:1])[1])     # one pair: no interval
    from verl_arpo.utils.stats import t975
    assert t975(1) == 12.706 and t975(30) == 2.042 and 1.96 < t975(200) < 1.98


def test_cluster_bootstrap_matches_a_plain_loop_and_is_wider_for_clustered_data():
    rng = np.random.default_rng(4)
    templates = [f"t{i % 5}" for i in range(100)]
    effect = {f"t{j}": e for j, e in enumerate((-0.3, -0.1, 0.0, 0.2, 0.4))}   # the template decides the difference
    diff = np.stack([[effect[t] + rng.normal(0, 0.05) for t in templates] for _ in range(3)])
    mean, lo, hi = stats.cluster_bootstrap(diff, templates, n_boot=3000)
    # the plain loop: draw pairs and templates, average every question of the drawn templates
    r = random.Random(9)
    names = sorted(set(templates))
    means = []
    for _ in range(3000):
        ks = [r.randrange(3) for _ in range(3)]
        cs = [r.choice(names) for _ in names]
        vals = [diff[k][q] for k in ks for c in cs for q in range(100) if templates[q] == c]
        means.append(sum(vals) / len(vals))
    means.sort()
    assert mean == pytest.approx(diff.mean())
    assert lo == pytest.approx(means[75], abs=0.03) and hi == pytest.approx(means[2924], abs=0.03)
    _, blo, bhi = stats.paired_bootstrap(diff, n_boot=3000)
    assert hi - lo > 3 * (bhi - blo)   # questions of one template are not independent


def test_budgets_per_step_and_per_prompt():
    run = {"train": {"trajectories_per_step": 24, "mean": {
        "tokens_generated": 1200.0, "tokens_trained": 6000.0, "step_s": 60.0, "tool_calls_in_traj_per_traj": 1.5,
        "executed_tool_calls_per_traj": 0.5, "prompts": 6.0}}}
    b = ca.budgets(run)
    assert b["per_step"]["executed_tool_calls"] == 12.0 and b["per_prompt"]["executed_tool_calls"] == 2.0
    assert b["per_prompt"]["tokens_generated"] == 200.0 and b["per_prompt"]["step_s"] == 10.0
    assert b["per_prompt"]["tool_calls_in_traj_per_traj"] == 1.5     # already per trajectory


def test_prompts_per_step_is_the_quickstarts():
    import yaml

    q = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    assert ca.PROMPTS_PER_STEP == q["data"]["train_batch_size"]
    assert 3 * 2 == q["data"]["train_batch_size"] and ca.TWO_MINI_BATCHES == ["actor_rollout_ref.actor.ppo_mini_batch_size=3"]


def test_the_arms_are_config_switches_and_the_confirmatory_run_is_frozen(tmp_path, capsys):
    assert set(ca.PROTOCOLS["confirm"].arms) == {"grpo", "arpo", "arpo_before_call", "arpo_w0", "aepo"}
    assert "actor_rollout_ref.rollout.entropy_timing=after_result" in ca.ARMS["arpo"]
    assert "actor_rollout_ref.rollout.entropy_weight=0" in ca.ARMS["arpo_w0"]
    rec = ca.protocol_record(ca.PROTOCOLS["confirm"], 13, "fp32", [])
    assert rec == ca.protocol_record(ca.PROTOCOLS["confirm"], 13, "fp32", [])
    assert rec["config_sha256"] != ca.protocol_record(ca.PROTOCOLS["confirm"], 12, "fp32", [])["config_sha256"]
    assert rec["eval_data"] == "rl_datasets/test_fresh.parquet" and "search_cache/local_corpus_fresh.jsonl" in rec["files_sha256"]
    store = ca.Store(tmp_path / "confirm")
    store.freeze(rec)
    store.freeze(rec)   # the same config again: accepted
    with pytest.raises(SystemExit, match="is frozen at config"):
        store.freeze(ca.protocol_record(ca.PROTOCOLS["confirm"], 12, "fp32", []))
    with pytest.raises(SystemExit):
        ca.main(["--out", "/nonexistent/never-made", "actor_rollout_ref.actor.optim.lr=1e-5"])
    assert "runs a frozen config" in capsys.readouterr().err


def test_an_amendment_takes_only_a_change_of_the_hashed_files_and_is_recorded(tmp_path):
    rec = ca.protocol_record(ca.PROTOCOLS["confirm"], 13, "fp32", [])
    store = ca.Store(tmp_path / "confirm")
    store.freeze(rec)
    edited = json.loads(json.dumps(rec))
    edited["files_sha256"]["configs/ppo_trainer.yaml"] = "0" * 64
    edited["config_sha256"] = "f" * 64
    with pytest.raises(SystemExit, match=r"files \['configs/ppo_trainer.yaml'\].*--amend WHY"):
        store.freeze(edited)                        # no reason given: refused
    steps = ca.protocol_record(ca.PROTOCOLS["confirm"], 12, "fp32", [])
    with pytest.raises(SystemExit, match="only the hashed files"):
        store.freeze(steps, amend="fewer steps")    # the steps are not a file: never amendable
    store.freeze(edited, amend="keys added that act only on tool outages")
    held = json.loads((tmp_path / "confirm" / "protocol.json").read_text())
    assert held["config_sha256"] == rec["config_sha256"]          # the original stays the frozen one
    (am,) = held["amendments"]
    assert am["config_sha256"] == "f" * 64 and am["files_changed"] == ["configs/ppo_trainer.yaml"]
    assert am["why"].startswith("keys added")
    store.freeze(edited)      # accepted from now on, without --amend
    store.freeze(rec)         # and the original too
    assert len(json.loads((tmp_path / "confirm" / "protocol.json").read_text())["amendments"]) == 1
    report = {"amendments": held["amendments"], "runs_by_config": ca.runs_by_config(
        {("grpo", 100): {"config_sha256": rec["config_sha256"]}, ("arpo", 100): {"config_sha256": "f" * 64}})}
    assert report["runs_by_config"]["f" * 64] == [{"algo": "arpo", "pair": 100}]


def test_fresh_splits_ask_about_entities_no_other_split_or_sft_trajectory_names():
    import pyarrow.parquet as pq

    def rows(name):
        return pq.read_table(ROOT / "rl_datasets" / f"{name}.parquet").to_pylist()
    old = {n: rows(n) for n in ("train", "valid", "test")}
    old_entities = {r["extra_info"]["entity"] for rs in old.values() for r in rs} - {""}
    old_questions = {r["extra_info"]["question"] for rs in old.values() for r in rs}
    sft_text = (ROOT / "rl_datasets" / "sft_train.jsonl").read_text()
    corpus_titles = {json.loads(line)["title"] for line in
                     (ROOT / "search_cache" / "local_corpus_fresh.jsonl").read_text().splitlines()}
    seen: set = set()
    for name in ("valid_fresh", "test_fresh"):
        fresh = rows(name)
        assert len(fresh) == 600 and {r["extra_info"]["split"] for r in fresh} == {name}
        ents = {r["extra_info"]["entity"] for r in fresh} - {""}
        qs = {r["extra_info"]["question"] for r in fresh}
        assert len(qs) == 600 and not qs & old_questions and not qs & seen
        assert not ents & old_entities and not ents & seen and ents <= corpus_titles
        assert not any(e in sft_text for e in ents)
        assert len({r["extra_info"]["template"] for r in fresh}) == 25
        seen |= ents | qs


def test_a_fresh_split_is_made_the_same_twice(tmp_path):
    sys.path.insert(0, str(ROOT / "rl_datasets"))
    import make_task

    a = make_task.make_fresh_split("xs", 7, 7, 4, tmp_path / "a", corpus=tmp_path / "a.jsonl")
    b = make_task.make_fresh_split("xs", 7, 7, 4, tmp_path / "b", corpus=tmp_path / "b.jsonl")
    assert a["kinds"] == {"math": 4, "multi": 4, "search": 4}
    assert (tmp_path / "a" / "xs.parquet").read_bytes() == (tmp_path / "b" / "xs.parquet").read_bytes()
    n = a["corpus_docs"]
    make_task.make_fresh_split("xs", 7, 7, 4, tmp_path / "a", corpus=tmp_path / "a.jsonl")   # again: appended once
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == n
