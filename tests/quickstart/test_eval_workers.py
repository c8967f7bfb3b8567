"""main_eval --workers (trainer/eval_workers.py): which calls each worker runs, how the cores or GPUs are
split, the workers' arguments, and real runs of the CLI: the workers' answers, merged, are one process's
answers at the same thread count (greedy and sampled), and a worker that fails ends the evaluation."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_arpo.trainer.eval_workers import _worker_argv, call_starts, parse_shard, worker_env, write_shard

ROOT = Path(__file__).resolve().parents[2]


def test_calls_go_round_robin_and_cover_every_question_once():
    assert call_starts(600, 150) == [0, 150, 300, 450]
    assert call_starts(600, 150, 0, 2) == [0, 300] and call_starts(600, 150, 1, 2) == [150, 450]
    assert call_starts(5, 2, 0, 2) == [0, 4] and call_starts(5, 2, 1, 2) == [2]
    assert call_starts(150, 150, 1, 2) == []   # one call: the second worker has none (main_eval then runs one)
    for n, b, w in [(601, 150, 2), (7, 3, 3), (10, 4, 2)]:
        starts = sorted(s for i in range(w) for s in call_starts(n, b, i, w))
        assert starts == list(range(0, n, b))


def test_shard_text_is_checked():
    assert parse_shard("1/2") == (1, 2)
    for bad in ("2/2", "x", "1/0", "-1/2"):
        with pytest.raises(SystemExit, match="--shard"):
            parse_shard(bad)


def test_cores_or_gpus_are_split_between_workers():
    assert worker_env(0, 2, 2, []) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert worker_env(1, 2, 8, [])["OMP_NUM_THREADS"] == "4"
    assert worker_env(2, 3, 7, [])["OMP_NUM_THREADS"] == "2"
    with pytest.raises(SystemExit, match=r"--workers 3: this process may use 2 CPU core\(s\); use --workers <= 2"):
        worker_env(0, 3, 2, [])
    assert worker_env(1, 2, 2, ["4", "6"]) == {"CUDA_VISIBLE_DEVICES": "6"}   # one visible GPU each
    with pytest.raises(SystemExit, match=r"only 1 GPU\(s\) visible"):
        worker_env(0, 2, 16, ["0"])
    with pytest.raises(SystemExit, match="--engine vllm on the CPU: its workers would bind the same cores"):
        worker_env(0, 2, 2, [], "vllm")
    assert worker_env(0, 2, 2, ["0", "1"], "vllm") == {"CUDA_VISIBLE_DEVICES": "0"}


def test_worker_arguments_drop_workers_and_out_and_add_the_shard():
    argv = ["--model", "m", "--workers", "2", "--out=r.json", "--k", "1", "--out", "x.json", "--workers=2", "--limit", "9"]
    got = _worker_argv(argv, 1, 2, Path("/t/s1.json"))
    assert got[:3] == [sys.executable, "-m", "verl_arpo.trainer.main_eval"]
    assert got[3:] == ["--model", "m", "--k", "1", "--limit", "9", "--shard", "1/2", "--generations_out", "/t/s1.json"]


def test_a_workers_file_keeps_each_call_whole(tmp_path):
    gens = [[{"text": str(i)}] for i in range(5)]   # questions 0-1 (call 0) and 4 (call 4) of calls of 2
    write_shard(tmp_path / "s.json", [0, 4], gens[:2] + gens[4:], 2)
    assert json.loads((tmp_path / "s.json").read_text()) == {"0": gens[:2], "4": gens[4:]}


def _main_eval(args: list[str], threads: int, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "verl_arpo.trainer.main_eval", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _samples(path: Path) -> list[list[dict]]:
    return [[{k: s[k] for k in ("text", "num_tool_calls", "finish_reason", "response_tokens", "correct")}
             for s in q["samples"]] for q in json.loads(path.read_text())["samples"]]


@pytest.mark.parametrize("k", [1, 2])
def test_two_workers_answer_as_one_process_at_their_thread_count(tiny_model_dir, tmp_path, k):
    """5 questions in calls of 2: worker 0 runs calls 0 and 2 (questions 0, 1, 4), worker 1 call 1.
    Merged, every sample equals the one-process run's with the workers' thread count (k = 2: each call
    keeps its own sampling seed), and the report is scored as one."""
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("needs 2 CPU cores")
    common = ["--model", tiny_model_dir, "--data", str(ROOT / "rl_datasets" / "valid.parquet"), "--limit", "5",
              "--batch_size", "2", "--max_batch_size", "2", "--k", str(k), "--max_response_length", "24",
              "--seed", "5", "--tools", "configs/tools/python_search_local.yaml"]
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    r1 = _main_eval([*common, "--out", str(one)], threads=cores // 2)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = _main_eval([*common, "--workers", "2", "--out", str(two)], threads=cores)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "eval worker 0/2: calls starting at [0, 4]" in r2.stderr and "eval worker 1/2: calls starting at [2]" in r2.stderr
    assert _samples(one) == _samples(two) and len(_samples(two)) == 5
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    assert a["overall"] == b["overall"] and b["overall"]["n_questions"] == 5
    assert "shard" not in b and not list(tmp_path.glob("*.tmp"))


def test_a_failing_worker_ends_the_evaluation_naming_it(tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    r = _main_eval(["--model", tiny_model_dir, "--data", str(ROOT / "rl_datasets" / "valid.parquet"), "--limit", "4",
                    "--batch_size", "2", "--tools", "none", "--dtype", "float64x", "--workers", "2", "--out", str(out)],
                   threads=2)
    assert r.returncode != 0 and "evaluation worker" in r.stderr and "failed (exit" in r.stderr
    assert not out.exists()


def test_bad_worker_flags_are_refused(tiny_model_dir):
    for args, msg in ((["--workers", "0"], "--workers 0: must be >= 1"),
                      (["--shard", "0/2"], "--shard and --generations_out go together")):
        with pytest.raises(SystemExit, match=msg):
            from verl_arpo.trainer import main_eval

            main_eval.main(["--model", tiny_model_dir, "--data", "rl_datasets/valid.parquet", *args])
