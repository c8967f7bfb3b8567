"""NaiveRewardManager: score placement, extra info, parallel == serial, custom functions."""

import os

import numpy as np
import pytest
import torch

from verl_arpo.protocol import DataProto
from verl_arpo.workers.reward_manager import (NaiveRewardManager, get_custom_reward_fn,
                                              get_reward_manager_cls, load_custom_reward_function,
                                              load_reward_manager)

P, R = 4, 48
GOOD = "<think>t</think><answer>\\boxed{Paris}</answer>"
BAD = "<answer>\\boxed{Paris}</answer>"  # no <think>: -1
PART = "<think>t</think><answer>\\boxed{Eiffel Tower in Paris}</answer>"  # F1 vs "the Eiffel Tower" = 2/3
TOOL_CALL = "<think>t</think><search>q</search>"
TOOL_RESULT = " <result>\nr\n</result>"


def _row(tok, pieces):
    """pieces: list of (text, sampled) -> (ids, response_mask) with an EOS after the last piece."""
    ids, mask = [], []
    for text, sampled in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(sampled)] * len(piece)
    return ids, mask


def make_batch(tok, rows, sources, truths, eos=True, extra_keys=True):
    """rows: list of piece lists; responses right-padded to R, prompts left-padded to P."""
    pad = tok.pad_token_id
    responses = torch.full((len(rows), R), pad, dtype=torch.long)
    response_mask = torch.zeros((len(rows), R), dtype=torch.long)
    attention = torch.zeros((len(rows), P + R), dtype=torch.long)
    prompts = torch.full((len(rows), P), pad, dtype=torch.long)
    lengths = []
    for i, pieces in enumerate(rows):
        ids, mask = _row(tok, pieces)
        if eos and ids:
            ids, mask = ids + [tok.eos_token_id], mask + [1]
        assert len(ids) <= R
        responses[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, :len(ids)] = torch.tensor(mask, dtype=torch.long)
        attention[i, P:P + len(ids)] = 1
        prompt = tok.encode("Q?", add_special_tokens=False)
        prompts[i, P - len(prompt):] = torch.tensor(prompt)
        attention[i, P - len(prompt):P] = 1
        lengths.append(len(ids))
    tensors = {"prompts": prompts, "responses": responses, "attention_mask": attention,
               "response_mask": response_mask}
    non_tensors = {"data_source": list(sources),
                   "reward_model": [{"ground_truth": gt, "style": "rule"} for gt in truths]}
    if extra_keys:
        non_tensors["extra_info"] = [{"index": i} for i in range(len(rows))]
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors), lengths


def test_score_on_last_valid_token(tiny_tokenizer):
    rows = [
        [(GOOD, True)],
        [(BAD, True)],
        [(PART, True)],
        [(TOOL_CALL, True), (TOOL_RESULT, False), ("<answer>\\boxed{Paris}</answer>", True)],
    ]
    data, lengths = make_batch(tiny_tokenizer, rows, ["hotpotqa"] * 4,
                               ["Paris", "Paris", "the Eiffel Tower", "Paris"])
    out = NaiveRewardManager(tiny_tokenizer, num_workers=0)(data, return_dict=True)
    scores = out["reward_tensor"]
    assert scores.dtype == torch.float32 and scores.shape == (4, R)
    expected = [1.0, -1.0, 2 / 3, 1.0]
    for i, (length, value) in enumerate(zip(lengths, expected)):
        assert scores[i, length - 1].item() == pytest.approx(value)  # the EOS position
        assert torch.count_nonzero(scores[i]).item() == 1
    info = out["reward_extra_info"]
    assert info["f1"] == pytest.approx([1.0, 0.0, 2 / 3, 1.0])
    assert info["answer"] == ["Paris", "", "Eiffel Tower in Paris", "Paris"]
    assert info["reason"] == ["ok", "format:no_think", "ok", "ok"]


def test_trailing_tool_result_is_read_but_the_score_sits_on_the_last_sampled_token(tiny_tokenizer):
    # the response ends inside a tool result (response_mask 0 there, attention 1): the scorer reads
    # the result, the score goes on the last token the model sampled (the tool call's last token)
    rows = [[(TOOL_CALL, True), (TOOL_RESULT, False)]]
    data, lengths = make_batch(tiny_tokenizer, rows, ["hotpotqa"], ["Paris"], eos=False)
    assert data.batch["response_mask"][0, lengths[0] - 1] == 0
    n_call = len(tiny_tokenizer.encode(TOOL_CALL, add_special_tokens=False))
    assert data.batch["response_mask"][0, n_call - 1] == 1 and data.batch["response_mask"][0, n_call] == 0
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 0.5

    out = NaiveRewardManager(tiny_tokenizer, compute_score=spy, num_workers=0)(data, return_dict=True)
    scores = out["reward_tensor"]
    assert seen == [TOOL_CALL + TOOL_RESULT]
    assert scores[0, n_call - 1].item() == 0.5 and torch.count_nonzero(scores).item() == 1
    assert out["reward_metrics"]["reward/rows_without_sampled_token"] == 0
    # with response_mask only (no attention_mask) the decoded text ends at the last sampled token
    only_mask = DataProto.from_dict(
        tensors={"responses": data.batch["responses"], "response_mask": data.batch["response_mask"]},
        non_tensors={k: v for k, v in data.non_tensor_batch.items()})
    scores = NaiveRewardManager(tiny_tokenizer, compute_score=spy, num_workers=0)(only_mask)
    assert seen[-1] == TOOL_CALL and scores[0, n_call - 1].item() == 0.5


def test_forced_eos_does_not_carry_the_score(tiny_tokenizer):
    # call_limit reached: the loop appends an EOS with loss mask 0; the score stays on the last sampled token
    rows = [[(GOOD, True)], [(TOOL_CALL, True), (TOOL_RESULT, False)]]
    data, lengths = make_batch(tiny_tokenizer, rows, ["hotpotqa"] * 2, ["Paris"] * 2)
    mask = data.batch["response_mask"]
    mask[1, lengths[1] - 1] = 0  # the forced EOS
    expected_pos = [lengths[0] - 1, len(tiny_tokenizer.encode(TOOL_CALL, add_special_tokens=False)) - 1]
    scores = NaiveRewardManager(tiny_tokenizer, compute_score=lambda **kw: 0.75, num_workers=0)(data)
    for i, pos in enumerate(expected_pos):
        assert scores[i, pos].item() == 0.75 and torch.count_nonzero(scores[i]).item() == 1


def test_row_without_sampled_token_gets_no_score_and_is_counted(tiny_tokenizer):
    data, _ = make_batch(tiny_tokenizer, [[], [(GOOD, True)]], ["hotpotqa"] * 2, ["Paris"] * 2)
    data.batch["response_mask"][0] = 0  # the empty row's EOS was not sampled either
    out = NaiveRewardManager(tiny_tokenizer, num_workers=0)(data, return_dict=True)
    assert torch.count_nonzero(out["reward_tensor"][0]).item() == 0
    assert torch.count_nonzero(out["reward_tensor"][1]).item() == 1
    assert out["reward_metrics"]["reward/rows_without_sampled_token"] == 1


def test_mixed_sources_fill_missing_extra_keys_with_none(tiny_tokenizer):
    rows = [[(GOOD, True)], [("\\boxed{\\frac{1}{2}}", True)]]
    data, _ = make_batch(tiny_tokenizer, rows, ["hotpotqa", "math500"], ["Paris", "0.5"])
    out = NaiveRewardManager(tiny_tokenizer, num_workers=0)(data, return_dict=True)
    assert out["reward_extra_info"]["f1"] == [1.0, None]
    assert out["reward_extra_info"]["score"] == [1.0, 1.0]
    assert len(out["reward_extra_info"]["reason"]) == 2


def test_ground_truth_column_fallback_and_bad_returns(tiny_tokenizer):
    data, lengths = make_batch(tiny_tokenizer, [[(GOOD, True)]], ["hotpotqa"], ["Paris"])
    data.non_tensor_batch.pop("reward_model")
    data.non_tensor_batch["ground_truth"] = np.array(["Paris"], dtype=object)
    assert NaiveRewardManager(tiny_tokenizer, num_workers=0)(data)[0, lengths[0] - 1] == 1.0
    bad = NaiveRewardManager(tiny_tokenizer, compute_score=lambda **kw: {"f1": 1.0}, num_workers=0)
    with pytest.raises(TypeError, match="score"):
        bad(data)
    bad = NaiveRewardManager(tiny_tokenizer, compute_score=lambda **kw: "1.0", num_workers=0)
    with pytest.raises(TypeError, match="float"):
        bad(data)


def test_rm_scores_pass_through(tiny_tokenizer):
    data, _ = make_batch(tiny_tokenizer, [[(GOOD, True)]], ["hotpotqa"], ["Paris"])
    data.batch["rm_scores"] = torch.full((1, R), 0.25)
    out = NaiveRewardManager(tiny_tokenizer, num_workers=0)(data, return_dict=True)
    assert torch.equal(out["reward_tensor"], data.batch["rm_scores"])


def _mixed_batch(tok, n):
    texts = [GOOD, BAD, PART, "<think>a</think><answer>\\boxed{Berlin}</answer>"]
    rows, sources, truths = [], [], []
    for i in range(n):
        if i % 3 == 2:
            rows.append([(f"\\boxed{{{i % 5}/2}}", True)])
            sources.append("math")
            truths.append(str((i % 5) / 2))
        else:
            rows.append([(texts[i % 4], True)])
            sources.append("hotpotqa")
            truths.append("the Eiffel Tower" if i % 4 == 2 else "Paris")
    return make_batch(tok, rows, sources, truths)


CUSTOM_FILE = """
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": len(solution_str) / 100.0 + bonus, "pid": os.getpid()}
not_callable = 3
"""


def test_parallel_equals_serial(tiny_tokenizer, tmp_path):
    data, _ = _mixed_batch(tiny_tokenizer, 24)
    serial = NaiveRewardManager(tiny_tokenizer, num_workers=0)(data, return_dict=True)
    manager = NaiveRewardManager(tiny_tokenizer, num_workers=2, parallel_threshold=8)
    try:
        parallel = manager(data, return_dict=True)
        assert manager.scoring.started  # the pool was really used
    finally:
        manager.close()
    assert torch.equal(serial["reward_tensor"], parallel["reward_tensor"])
    assert serial["reward_extra_info"] == parallel["reward_extra_info"]
    assert sorted(set(np.round(serial["reward_tensor"].sum(-1).tolist(), 4))) == [-1.0, 0.0, 0.6667, 1.0]

    # a user's function loaded from a file also runs in (spawned) workers
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_FILE)
    fn = load_custom_reward_function(str(path), "compute_score", {"bonus": 1.0})
    manager = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=2, parallel_threshold=8)
    try:
        par = manager(data, return_dict=True)
    finally:
        manager.close()
    ser = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=0)(data, return_dict=True)
    assert torch.equal(par["reward_tensor"], ser["reward_tensor"])
    assert os.getpid() not in par["reward_extra_info"]["pid"]
    assert set(ser["reward_extra_info"]["pid"]) == {os.getpid()}


def test_unpicklable_scorer_falls_back_to_serial(tiny_tokenizer, caplog):
    data, lengths = _mixed_batch(tiny_tokenizer, 10)
    manager = NaiveRewardManager(tiny_tokenizer, compute_score=lambda **kw: 2.0, num_workers=2,
                                 parallel_threshold=4)
    scores = manager(data)
    assert not manager.scoring.started and "cannot be pickled" in caplog.text
    assert scores.sum().item() == 20.0


def test_custom_function_loading_errors(tmp_path):
    path = tmp_path / "r.py"
    path.write_text(CUSTOM_FILE)
    with pytest.raises(FileNotFoundError, match="custom_reward_function.path"):
        load_custom_reward_function(str(tmp_path / "missing.py"), "compute_score")
    with pytest.raises(AttributeError, match=r"custom_reward_function.name='nope'.*compute_score"):
        load_custom_reward_function(str(path), "nope")
    with pytest.raises(TypeError, match="not_callable"):
        load_custom_reward_function(str(path), "not_callable")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(ImportError, match="broken.py"):
        load_custom_reward_function(str(broken), "compute_score")
    txt = tmp_path / "r.txt"
    txt.write_text(CUSTOM_FILE)
    with pytest.raises(ValueError, match=".py"):
        load_custom_reward_function(str(txt), "compute_score")
    with pytest.raises(ValueError, match="path is empty"):
        load_custom_reward_function("", "compute_score")


def test_get_custom_reward_fn_from_config(tmp_path, tiny_tokenizer):
    from omegaconf import OmegaConf

    path = tmp_path / "r2.py"
    path.write_text(CUSTOM_FILE)
    from verl_arpo.config import JobConfig

    assert get_custom_reward_fn(JobConfig.from_mapping({"custom_reward_function": {"path": None, "name": "x"}})) is None
    assert get_custom_reward_fn(JobConfig()) is None
    cfg = JobConfig.from_mapping({"custom_reward_function": {"path": str(path), "name": "compute_score",
                                                       "reward_kwargs": {"bonus": 0.5}},
                            "reward_model": {"reward_manager": "naive"}})
    fn = get_custom_reward_fn(cfg)
    assert fn(data_source="x", solution_str="abcd", ground_truth="")["score"] == pytest.approx(0.54)
    manager = load_reward_manager(cfg, tiny_tokenizer, num_examine=0)
    assert isinstance(manager, NaiveRewardManager) and manager.compute_score.path == str(path)
    bad = JobConfig.from_mapping({"custom_reward_function": {"path": str(path), "name": "compute"}})
    with pytest.raises(AttributeError, match="compute"):
        get_custom_reward_fn(bad)


def test_registry():
    assert get_reward_manager_cls("naive") is NaiveRewardManager
    with pytest.raises(ValueError, match="naive"):
        get_reward_manager_cls("prime")


def test_num_examine_prints_per_source(tiny_tokenizer, capsys):
    data, _ = _mixed_batch(tiny_tokenizer, 6)
    NaiveRewardManager(tiny_tokenizer, num_examine=1, num_workers=0)(data)
    out = capsys.readouterr().out
    assert out.count("[response]") == 2  # one per data source
    assert "[prompt] Q?" in out


# ------------------------------------------------------------------ failures that must not poison a run
HANGING_FILE = '''
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 5:
        time.sleep(3600)          # a scorer stuck on one sample (a regex blow-up, a dead judge server)
    return {"score": 1.0, "pid": os.getpid()}
'''


def test_non_finite_scores_are_failed_scorings_not_a_poisoned_group(tiny_tokenizer, caplog):
    """NaN / ±inf from a scorer become 0.0 for that sample only and are counted; the group's
    GRPO advantages stay finite."""
    from verl_arpo.algos.core_algos import compute_grpo_outcome_advantage

    bad = {1: float("nan"), 2: float("inf"), 3: -float("inf")}

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return bad.get(extra_info["index"], 0.5 * (extra_info["index"] % 2))

    data, _ = make_batch(tiny_tokenizer, [[(GOOD, True)]] * 6, ["x"] * 6, ["Paris"] * 6)
    with caplog.at_level("WARNING"):
        out = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=0)(data, return_dict=True)
    assert out["reward_tensor"].sum(-1).tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.5]  # by hand: 0, ×, ×, ×, 0, 0.5
    assert out["reward_metrics"]["reward/non_finite_scores"] == 3.0
    assert "3 of 6 scores were NaN or infinite (first: sample 1" in caplog.text
    adv, _ = compute_grpo_outcome_advantage(out["reward_tensor"], data.batch["response_mask"],
                                            np.array(["g"] * 6, dtype=object))
    assert torch.isfinite(adv).all()


def test_a_hung_scorer_ends_in_an_error_naming_the_sample(tiny_tokenizer, tmp_path):
    """Serial (main thread, and another thread) and parallel scoring all stop within the timeout."""
    import threading
    import time

    from verl_arpo.workers.reward_manager import RewardTimeoutError

    path = tmp_path / "hang.py"
    path.write_text(HANGING_FILE)
    fn = load_custom_reward_function(str(path), "compute_score")
    data, _ = _mixed_batch(tiny_tokenizer, 12)
    serial = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=0, score_timeout=1.5)
    serial(_mixed_batch(tiny_tokenizer, 3)[0])   # samples 0-2 score: the scoring process is up
    t0 = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"score_timeout=1.5s: sample 5 \(data_source="):
        serial(data)
    assert time.monotonic() - t0 < 5
    box = {}

    def in_thread():
        try:
            serial(data)
        except RewardTimeoutError as exc:
            box["error"] = str(exc)

    # the first timeout killed the scoring process: this call starts a new one (seconds on a loaded
    # machine: 6.7 s at load 6) before the 1.5 s timeout runs; the scorer itself never returns
    t0 = time.monotonic()
    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join(30)
    assert "sample 5" in box.get("error", "") and time.monotonic() - t0 < 25
    parallel = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=2, parallel_threshold=4,
                                  score_timeout=20)  # spawned scorers start in a few seconds
    try:
        t0 = time.monotonic()
        with pytest.raises(RewardTimeoutError, match=r"samples \d+\.\.\d+ .*were still being scored"):
            parallel(data)
        assert time.monotonic() - t0 < 30
        assert not parallel.scoring.started  # the stuck processes were killed, a new pool comes next time
    finally:
        parallel.close()
    # without a hang the limit changes nothing
    quick = NaiveRewardManager(tiny_tokenizer, num_workers=0, score_timeout=30)
    assert torch.equal(quick(data), NaiveRewardManager(tiny_tokenizer, num_workers=0)(data))


STUCK_FILES = {   # scorers that hold the GIL in C code, so no Python thread or signal handler can run
    "regex": '''
import re
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 5:
        re.match(r"(a+)+$", "a" * 64 + "b")   # catastrophic backtracking: years, in C, holding the GIL
    return 1.0
''',
    "busy_c_loop_that_swallows": '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] == 5:
        while True:
            try:
                sum(range(10 ** 12))          # a C loop; any timeout exception is swallowed and it goes on
            except BaseException:
                pass
    return 1.0
''',
}


@pytest.mark.parametrize("kind", sorted(STUCK_FILES))
@pytest.mark.parametrize("path", ["serial_main_thread", "serial_other_thread", "pool", "main_eval"])
def test_every_scoring_path_is_bounded_even_when_the_scorer_holds_the_gil(tiny_tokenizer, tmp_path, kind, path):
    """[issue 34, item 3] The timeout watchdog was a Python thread: a scorer stuck in C code (a
    backtracking regex on model text) kept the GIL and the run hung forever; main_eval had no limit.
    Every path now scores in a killable process: each stops within its limit, naming the sample."""
    import threading

    from verl_arpo.trainer.main_eval import score_samples
    from verl_arpo.workers.reward_manager import RewardTimeoutError

    file = tmp_path / f"{kind}.py"
    file.write_text(STUCK_FILES[kind])
    fn = load_custom_reward_function(str(file), "compute_score")
    data, _ = _mixed_batch(tiny_tokenizer, 12)
    box = {}

    def run():
        try:
            if path == "main_eval":
                rows = [{"data_source": "arpo_toy_math", "ground_truth": "1", "extra_info": {"index": i},
                         "question": "q"} for i in range(12)]
                score_samples(rows, [[{"text": "x"}] for _ in rows], fn, 1.0, score_timeout=3)
            else:
                workers, threshold = (2, 4) if path == "pool" else (0, 256)
                manager = NaiveRewardManager(tiny_tokenizer, compute_score=fn, num_workers=workers,
                                             parallel_threshold=threshold, score_timeout=3)
                try:
                    manager(data)
                finally:
                    manager.close()
        except RewardTimeoutError as exc:
            box["error"] = str(exc)

    if path == "serial_other_thread":
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
    else:
        run()
    assert "score_timeout=3s" in box.get("error", ""), box
    assert ("sample 5" in box["error"]) or path == "pool"   # the pool names the chunk holding it
