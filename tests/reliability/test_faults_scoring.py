"""Issue 51, items 1 and 5: a scoring pool that breaks while it starts, and a scorer that raises on
one row. Both leave the batch scored and counted; neither ends the run. A scorer that raises on
every row is a broken scorer and stops with one line naming the sample and the fix."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rewards"))
from test_reward_manager import _mixed_batch  # noqa: E402

from verl_arpo.workers.reward_manager import NaiveRewardManager, load_custom_reward_function  # noqa: E402

DIES_IN_WORKERS = """
import multiprocessing, os
if multiprocessing.parent_process() is not None:   # a scoring worker dies while starting (OOM kill, crash on import)
    os._exit(1)
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 100.0
"""

RAISES_ON_ONE_ROW = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 4:
        raise KeyError("answer")                     # a bug that only one row reaches
    return len(solution_str) / 100.0
"""


def _scores(out, lengths_from):
    """The score at each row's last response token (the manager places it there)."""
    return out["reward_tensor"].sum(-1).tolist()


def test_a_pool_that_breaks_while_starting_scores_the_batch_serially(tiny_tokenizer, tmp_path, caplog):
    path = tmp_path / "dies.py"
    path.write_text(DIES_IN_WORKERS)
    fn = load_custom_reward_function(str(path), "compute_score")
    data, _ = _mixed_batch(tiny_tokenizer, 8)
    rm = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=2, score_timeout=60)
    out = rm(data, return_dict=True)
    texts = tiny_tokenizer.batch_decode([data.batch["responses"][i][data.batch["attention_mask"][i, -data.batch["responses"].shape[1]:].bool()].tolist()
                                         for i in range(len(data))], skip_special_tokens=True)
    assert _scores(out, data) == pytest.approx([len(t) / 100.0 for t in texts])   # every row scored, in order
    assert out["reward_metrics"]["reward/serial_fallback_batches"] == 1.0
    assert "scoring this batch serially" in caplog.text
    again = rm(data, return_dict=True)       # the next batch tries a fresh pool, breaks again, and still scores
    assert torch.equal(again["reward_tensor"], out["reward_tensor"])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_scorer_that_raises_on_one_row_scores_it_zero_and_counts_it(tiny_tokenizer, tmp_path, caplog, workers):
    path = tmp_path / "one_bad_row.py"
    path.write_text(RAISES_ON_ONE_ROW)
    fn = load_custom_reward_function(str(path), "compute_score")
    data, _ = _mixed_batch(tiny_tokenizer, 8)
    data.non_tensor_batch["extra_info"] = __import__("numpy").array([{"index": i} for i in range(8)], dtype=object)
    out = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=workers,
                             score_timeout=60 if workers else None)(data, return_dict=True)
    scores = _scores(out, data)
    assert scores[4] == 0.0 and all(s > 0 for k, s in enumerate(scores) if k != 4)
    assert out["reward_metrics"]["reward/scorer_errors"] == 1.0
    assert "raised on 1 of 8 samples (first: sample 4" in caplog.text and "KeyError" in caplog.text


def test_a_scorer_that_raises_on_every_row_stops_naming_the_fix(tiny_tokenizer):
    data, _ = _mixed_batch(tiny_tokenizer, 4)

    def broken(**kw):
        raise ValueError("no such field")
    with pytest.raises(RuntimeError, match=r"raised on all 4 samples .*sample 0.*no such field.*custom_reward_function"):
        NaiveRewardManager(tiny_tokenizer, compute_score=broken, num_workers=0)(data)


def test_a_killed_pool_leaves_nothing_for_the_exit_hook_to_race():
    """CPython 3.11's exit hook for process pools writes to each pool's wake-up pipe without the lock
    its manager thread closes that pipe under. A pool whose shutdown still ran in the background at
    exit printed "OSError: [Errno 9] Bad file descriptor" after a run's last line (seen in CI after
    the tool-outage exit). So a pool stopped by the reward timeout (also what `__del__` does) has its
    manager thread finished and its pipe closed when the call returns. The trainer closes its
    reward managers in `shutdown()` (tests/trainer/test_e2e.py)."""
    from verl_arpo.utils.reward_score import default_compute_score
    from verl_arpo.workers.scoring_pool import ScoringPool

    pool = ScoringPool(default_compute_score, num_workers=1, parallel_threshold=2, score_timeout=60)
    assert pool.score_all([(0, "openai/gsm8k", "#### 7", "7", None)])[0]["score"] == 1.0
    executor = pool._pool
    manager, wakeup = executor._executor_manager_thread, executor._executor_manager_thread_wakeup
    workers = list(executor._processes.values())
    assert manager.is_alive() and not wakeup._closed
    pool._kill_pool()                # what a reward timeout does
    assert not manager.is_alive() and wakeup._closed
    assert not any(w.is_alive() for w in workers)
