"""math (math-verify) and gsm8k scorers; expected values worked out by hand."""
import pytest

from verl_arpo.utils.reward_score import gsm8k
from verl_arpo.utils.reward_score import math as math_score
from verl_arpo.utils.reward_score._text import last_boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("first \\boxed{3}, finally \\boxed{4}", "4"),
        ("ok \\boxed{3} then broken \\boxed{4", "3"),
        ("\\fbox{7}", "7"),
        ("the answer is \\boxed 7 today", "7"),
        ("$\\boxed 9$", "9"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{a} \\fbox{b}", "b"),
        ("\\boxedx{5}", None),
        ("no box at all", None),
        ("\\boxed{", None),
    ],
)
def test_last_boxed_forms(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\frac12", "1/2"),
        ("\\dfrac{3}{4}", "0.75"),
        ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}"),
        ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
        ("[1, 2)", "[1,2)"),
        ("(0, \\infty)", "(0,\\infty)"),
        ("\\{2, 1\\}", "\\{1,2\\}"),
        ("x^{2}+2x+1", "(x+1)^2"),
        ("x = 3", "3"),
        ("10.0", "10"),
    ],
)
def test_math_equivalent_forms_score_one(pred, gold):
    out = math_score.compute_score("math", f"We get \\boxed{{{pred}}}.", gold)
    assert out["score"] == 1.0, out
    assert out["answer"] == pred


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("[1,2]", "(1,2]"),
        ("0.51", "\\frac{1}{2}"),
        ("3", "2"),
        ("\\sqrt{2}", "2"),
        ("x+1", "(x+1)^2"),
        ("\\{1,2,3\\}", "\\{1,2\\}"),
    ],
)
def test_math_non_equivalent_scores_zero(pred, gold):
    out = math_score.compute_score("math", f"\\boxed{{{pred}}}", gold)
    assert out["score"] == 0.0, out
    assert out["reason"] == "not_equivalent"


def test_math_uses_last_box_and_lists_of_golds():
    assert math_score.compute_score("aime24", "\\boxed{1} oops \\boxed{2}", "2")["score"] == 1.0
    assert math_score.compute_score("aime24", "\\boxed{2} oops \\boxed{1}", "2")["score"] == 0.0
    assert math_score.compute_score("math", "\\boxed{0.25}", ["1/3", "\\frac14"])["score"] == 1.0


def test_math_missing_box_and_too_long():
    assert math_score.compute_score("math", "the answer is 5", "5") == {
        "score": 0.0, "answer": "", "reason": "no_boxed"}
    long = "1+" * 600 + "1"
    out = math_score.compute_score("math", "\\boxed{" + long + "}", "1201")
    assert out["score"] == 0.0 and out["reason"] == "answer_too_long"


@pytest.mark.parametrize(
    "text, gold, method, expected",
    [
        ("so she has 42 apples.\n#### 42", "42", "strict", 1.0),
        ("#### 1,234", "1234", "strict", 1.0),
        ("#### $1,234.50", "1234.5", "strict", 1.0),
        ("#### -3", "-3", "strict", 1.0),
        ("\\boxed{18}", "18", "strict", 1.0),
        ("\\boxed{\\$18}", "18", "strict", 1.0),
        ("\\boxed{18 apples}", "18", "strict", 0.0),  # not a plain number: no strict answer
        ("\\boxed{5} but then\n#### 6", "6", "strict", 1.0),
        ("#### 6 but then \\boxed{5}", "6", "strict", 0.0),
        ("The answer is 42", "42", "strict", 0.0),
        ("The answer is 42", "42", "flexible", 1.0),
        ("I think 41, no wait, 42.", "42", "flexible", 1.0),
        ("42 apples, 43 in total", "42", "flexible", 0.0),
        ("no numbers here", "42", "flexible", 0.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "strict", 1.0),
    ],
)
def test_gsm8k(text, gold, method, expected):
    assert gsm8k.compute_score("openai/gsm8k", text, gold, method=method)["score"] == expected


def test_gsm8k_format_score_and_reasons():
    out = gsm8k.compute_score("openai/gsm8k", "#### 5", "6", format_score=0.1)
    assert out == {"score": 0.1, "answer": "5", "reason": "wrong_answer"}
    assert gsm8k.compute_score("openai/gsm8k", "five", "5")["reason"] == "no_answer"
    with pytest.raises(ValueError, match="strict"):
        gsm8k.compute_score("openai/gsm8k", "#### 5", "5", method="loose")


def test_math_verify_timeouts_keep_the_callers_alarm():
    import signal

    old = signal.signal(signal.SIGALRM, lambda *a: None)
    try:
        signal.alarm(100)
        assert math_score.compute_score("math", "\\boxed{0.5}", "\\frac{1}{2}")["reason"] == "equivalent"
        remaining = signal.alarm(0)
        assert 95 <= remaining <= 100  # math-verify alone would have left 0 (cancelled)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_math_in_a_thread_runs_without_signal_timeouts():
    import threading

    out = {}
    thread = threading.Thread(target=lambda: out.update(math_score.compute_score("math", "\\boxed{0.5}", "1/2")))
    thread.start()
    thread.join()
    assert out["score"] == 1.0 and out["reason"] == "equivalent"
