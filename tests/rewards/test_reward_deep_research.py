"""deep_research scorer: each format rule on its own, F1 computed by hand, yes/no, bonus, lists."""
import numpy as np
import pytest

from verl_arpo.utils.reward_score.deep_research import compute_score, f1_score, normalize_answer

THINK = "<think>I should look this up.</think>\n"
ANS = "<answer>The answer is \\boxed{Paris}</answer>"
SEARCH = "<search>capital of France</search> <result>\nParis is the capital.\n</result>\n"
PYTHON = "<python>print(1+1)</python> <result>\n2\n</result>\n"


def score(text, gt="Paris"):
    return compute_score("hotpotqa", text, gt)


def test_valid_minimal_response_scores_f1():
    out = score(THINK + ANS)
    assert out == {"score": 1.0, "f1": 1.0, "answer": "Paris", "reason": "ok"}


def test_valid_response_with_tool_calls():
    out = score(THINK + SEARCH + THINK + ANS)
    assert out["score"] == 1.0 and out["reason"] == "ok"


@pytest.mark.parametrize(
    "text, reason",
    [
        # think rule
        (ANS, "format:no_think"),
        (THINK + "<think>more" + ANS, "format:think_unbalanced"),
        ("</think>" + THINK + ANS, "format:think_unbalanced"),
        # exactly one <answer>...</answer>
        (THINK + ANS + ANS, "format:answer_count"),
        (THINK + "<answer>\\boxed{Paris}", "format:answer_count"),
        (THINK + "\\boxed{Paris}</answer>", "format:answer_count"),
        (THINK + "</answer>\\boxed{Paris}<answer>", "format:answer_order"),
        # \boxed{} inside the answer
        (THINK + "<answer>Paris</answer>", "format:no_boxed"),
        (THINK + "\\boxed{Paris}<answer>Paris</answer>", "format:no_boxed"),
        (THINK + "<answer>\\boxed{Paris</answer>", "format:no_boxed"),
        (THINK + "<answer>\\fbox{Paris}</answer>", "format:no_boxed"),
        (THINK + "<answer>\\boxed Paris</answer>", "format:no_boxed"),
        # tool calls: closing tag, then <result>, then </result>
        (THINK + "<search>capital of France " + ANS, "format:search_unclosed"),
        (THINK + "<search>capital</search>\n" + ANS, "format:search_no_result"),
        (THINK + "<search>capital</search> <result>Paris " + ANS, "format:search_result_unclosed"),
        (THINK + "<result>x</result><search>capital</search>" + ANS, "format:search_no_result"),
        (THINK + SEARCH + "<search>second query " + ANS, "format:search_unclosed"),
        (THINK + "<python>print(2)" + ANS, "format:python_unclosed"),
        (THINK + "<python>print(2)</python>" + ANS, "format:python_no_result"),
        (THINK + "<python>print(2)</python><result>2" + ANS, "format:python_result_unclosed"),
        (THINK + PYTHON + "<python>x</python>" + ANS, "format:python_no_result"),
    ],
)
def test_each_format_rule_alone_gives_minus_one(text, reason):
    out = score(text)
    assert out["score"] == -1.0
    assert out["reason"] == reason
    assert out["f1"] == 0.0


def test_format_failure_even_with_correct_answer_and_both_tools():
    text = THINK + SEARCH + "<python>print(1)</python>" + ANS
    assert score(text)["score"] == -1.0


def test_last_brace_matched_box_inside_answer_is_the_answer():
    text = THINK + "<answer>\\boxed{London} no, \\boxed{Paris {France}}</answer>"
    out = score(text, gt="Paris, France")
    assert out["answer"] == "Paris {France}"
    # normalised: "paris france" on both sides -> exact
    assert out["f1"] == 1.0


def test_latex_wrappers_are_unwrapped_unlike_the_reference():
    # the reference dropped the backslash and braces -> the single token "textparis" -> 0; we unwrap
    out = score(THINK + "<answer>\\boxed{\\text{Paris}}</answer>", gt="Paris")
    assert out["score"] == 1.0
    assert score(THINK + "<answer>\\boxed{\\text{Paris}}</answer>", gt="textparis")["score"] == 0.0


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("Paris", "Paris", 1.0),
        # pred tokens {eiffel, tower, in, paris}, gold {eiffel, tower}: P=2/4, R=1 -> 2/3
        ("Eiffel Tower in Paris", "the Eiffel Tower", 2 / 3),
        # punctuation removed: "usa" == "usa"
        ("U.S.A.", "usa", 1.0),
        # articles removed
        ("A Tale of Two Cities", "tale of two cities", 1.0),
        # multiplicity: [new, new, york] vs [new, york]: common 2, P=2/3, R=1 -> 0.8
        ("new new york", "new york", 0.8),
        # no overlap
        ("Berlin", "Paris", 0.0),
        # yes/no/noanswer mismatch
        ("yes", "no", 0.0),
        ("yes it is", "yes", 0.0),
        ("no", "no answer is known", 0.0),
        ("no", "No.", 1.0),
        ("", "Paris", 0.0),
    ],
)
def test_f1_by_hand(pred, gold, expected):
    assert f1_score(pred, gold) == pytest.approx(expected)


def test_normalize_answer():
    assert normalize_answer("  The  Quick,  brown FOX! ") == "quick brown fox"


def test_score_uses_f1_of_boxed_answer():
    text = THINK + "<answer>\\boxed{Eiffel Tower in Paris}</answer>"
    out = score(text, gt="the Eiffel Tower")
    assert out["score"] == pytest.approx(2 / 3)
    assert out["reason"] == "ok"


def test_wrong_answer_scores_zero_not_minus_one():
    out = score(THINK + "<answer>\\boxed{Berlin}</answer>")
    assert out["score"] == 0.0 and out["reason"] == "wrong_answer"


def test_yes_no_mismatch_scores_zero():
    out = score(THINK + "<answer>\\boxed{yes}</answer>", gt="no")
    assert out["score"] == 0.0


@pytest.mark.parametrize(
    "gt",
    [
        ["Paris", "City of Light"],
        np.array(["Paris", "City of Light"], dtype=object),
        np.array(["Paris", "City of Light"]),
        {"target": ["Paris", "City of Light"]},
        ("City of Light", "Paris"),
    ],
)
def test_list_ground_truths_take_the_max(gt):
    # vs "paris": 0; vs "city of light" -> [city, light] (of is kept): pred [light, city]
    # common 2, P = 2/2, R = 2/3 -> 0.8
    out = score(THINK + "<answer>\\boxed{light city}</answer>", gt=gt)
    assert out["score"] == pytest.approx(0.8)
    assert score(THINK + ANS, gt=gt)["score"] == 1.0


def test_tool_bonus_requires_both_tools_and_positive_f1():
    both = THINK + SEARCH + THINK + PYTHON + THINK
    # both tools, F1 0.8 -> 0.9
    out = score(both + "<answer>\\boxed{new new york}</answer>", gt="new york")
    assert out["score"] == pytest.approx(0.9) and out["f1"] == pytest.approx(0.8)
    assert out["reason"] == "ok+tool_bonus"
    # both tools, F1 1 -> 1.1
    assert score(both + ANS)["score"] == pytest.approx(1.1)
    # both tools, wrong answer -> 0, no bonus
    assert score(both + "<answer>\\boxed{Berlin}</answer>")["score"] == 0.0
    # one tool only -> no bonus
    assert score(THINK + SEARCH + ANS)["score"] == 1.0
    assert score(THINK + PYTHON + ANS)["score"] == 1.0


def test_qa_f1_is_the_same_rule_without_the_tool_bonus():
    from verl_arpo.utils.reward_score.deep_research import compute_score_qa_f1

    both = THINK + SEARCH + THINK + PYTHON + THINK
    # both tools: F1 alone (1.0, 0.8), where deep_research pays 1.1 and 0.9
    out = compute_score_qa_f1("arpo_toy_search", both + ANS, "Paris")
    assert out["score"] == 1.0 and out["reason"] == "ok"
    partial = compute_score_qa_f1("arpo_toy_multi", both + "<answer>\\boxed{new new york}</answer>", "new york")
    assert partial["score"] == pytest.approx(0.8) and partial["f1"] == pytest.approx(0.8)
    # the format gate and wrong answers are unchanged
    assert compute_score_qa_f1("arpo_toy_search", "<answer>\\boxed{Paris}</answer>", "Paris")["score"] == -1.0
    assert compute_score_qa_f1("arpo_toy_search", THINK + "<answer>\\boxed{Rome}</answer>", "Paris")["score"] == 0.0


def test_empty_ground_truth():
    out = score(THINK + ANS, gt=[])
    assert out["score"] == 0.0 and out["reason"] == "no_ground_truth"


def test_latex_text_commands_are_unwrapped():
    # the reference normalised \text{Paris} to "textparis" (score 0); we unwrap it
    from verl_arpo.utils.reward_score.deep_research import f1_score
    assert f1_score(r"\text{Paris}", "Paris") == 1.0
    assert f1_score(r"\textbf{\mathrm{New York}}", "new york") == 1.0
    assert f1_score(r"\text{Paris} and Lyon", "Paris") == 2 * (1 / 3) * 1 / (1 / 3 + 1)
