"""Fuzzing every rule-based scorer: never raises, score in the documented set, reason present.

Extends tests/rewards/test_reward_robustness.py (fixed garbage list, random strings) with
structured responses (the tags the format gate looks at, boxed answers, numbers) and every shape a
ground truth can take in a parquet file (str, lists, numpy arrays, {"target": ...} dicts, numbers,
None, bytes), plus odd extra_info and data_source values.
"""
import math

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis.errors import InvalidArgument
from hypothesis import strategies as st
from rel_helpers import fuzz

from verl_arpo.utils.reward_score import default_compute_score, deep_research, gsm8k
from verl_arpo.utils.reward_score import math as math_score
from verl_arpo.utils.reward_score._text import ground_truths

TAGS = ["<think>", "</think>", "<answer>", "</answer>", "<search>", "</search>", "<python>", "</python>",
        "<result>", "</result>", "\\boxed{", "\\fbox{", "\\boxed ", "{", "}", "\\{", "\\}", "$", "####", "\\text{",
        "\\frac{1}{2}", "0.5", "-1,234.50", "42", "1e400", "nan", "inf", "x=3", "\\sqrt{2}", "yes", "no", "Paris",
        "the", "a", ",", ".", "%", "\\%", " ", "\n", "\udcff", "\ufffd", "\x00", "<|im_end|>"]
piece = st.one_of(st.sampled_from(TAGS), st.text(max_size=6),
                  st.builds(lambda a, k: a * k, st.sampled_from(TAGS), st.integers(2, 50)))
ANSWER_ATOMS = ["42", "7", "-1,234.50", "0.5", "\\frac{1}{2}", "\\sqrt{2}", "x", "=", "3", "+", "^", "\\pi", "Paris",
                "the", "City of Light", "yes", "no", "\\text{Paris}", " ", "\\{1,2\\}", "(0,1]", "\\infty", "%", "$"]
answer = st.lists(st.sampled_from(ANSWER_ATOMS), min_size=1, max_size=6).map("".join)
call = st.builds(lambda tag, q, r: f"<{tag}>{q}</{tag}><result>{r}</result>", st.sampled_from(["search", "python"]),
                 st.text(max_size=5), st.text(max_size=5))
# well-formed responses (past the format gate, into F1 / math-verify / number parsing), lightly broken;
# the ground truth is then often the boxed answer itself, so the success branches are reached too
@st.composite
def scored_case(draw):
    if draw(st.integers(0, 9)) >= 6:  # ~40 %: anything at all
        return draw(garbage), draw(ground_truth)
    ans = draw(answer)
    calls = "".join(draw(st.lists(call, max_size=3)))
    tail = draw(st.sampled_from(["", "", "", "#### 42", "\\boxed{7}", "<think>", "</answer>", "<search>"]))
    text = f"<think>{draw(st.text(max_size=8))}</think>{calls}<answer>\\boxed{{{ans}}}</answer>{tail}"
    gt = draw(st.one_of(ground_truth, st.just(ans), st.just([ans, "other"]), st.just({"target": np.array([ans])})))
    return text, gt


garbage = st.one_of(st.lists(piece, max_size=40).map("".join), st.none(), st.integers(), st.binary(max_size=40),
                    st.builds(lambda b: b.decode("utf-8", "surrogateescape"), st.binary(max_size=40)))
gt_text = st.one_of(answer, st.sampled_from(["42", "Paris", "\\frac{1}{2}", "", " ", "#### 7"]))
gt_scalar = st.one_of(st.text(max_size=12), gt_text, gt_text,
                      st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(),
                      st.binary(max_size=8))
ground_truth = st.recursive(
    gt_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.lists(st.text(max_size=6), max_size=4).map(lambda v: np.array(v, dtype=object)),
        st.lists(st.text(max_size=6), min_size=1, max_size=4).map(np.array),
        st.lists(st.text(max_size=6), min_size=1, max_size=4).map(lambda v: np.array([v], dtype=object)),
        st.dictionaries(st.sampled_from(["target", "ground_truth", "style", "x"]), inner, max_size=3),
    ),
    max_leaves=6,
)
extra_info = st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), st.integers(),
                       st.text(max_size=5))

DR_REASONS = {"ok", "ok+tool_bonus", "wrong_answer", "no_ground_truth"}
MATH_REASONS = {"exact_match", "equivalent", "not_equivalent", "no_boxed", "answer_too_long", "no_ground_truth"}
GSM_REASONS = {"correct", "wrong_answer", "no_answer", "no_ground_truth"}


def _event(text):
    try:
        event(text)  # shown by --hypothesis-show-statistics
    except InvalidArgument:  # called outside a hypothesis test
        pass


def _basic(out):
    assert isinstance(out, dict)
    assert isinstance(out["score"], float) and math.isfinite(out["score"])
    assert isinstance(out["reason"], str) and out["reason"]
    assert isinstance(out.get("answer", ""), str)
    return out["score"], out["reason"]


def check_deep_research(out, tool_bonus=0.1):
    """deep_research's rule; `tool_bonus=0` is the qa_f1 scorer's (the score is the F1 itself)."""
    score, reason = _basic(out)
    _event(f"deep_research: {reason.split(':')[0]}")
    if reason.startswith("format:"):
        assert score == -1.0 and out["f1"] == 0.0
    else:
        assert reason in (DR_REASONS if tool_bonus else DR_REASONS - {"ok+tool_bonus"})
        assert 0.0 <= out["f1"] <= 1.0
        assert score == (out["f1"] + tool_bonus if reason == "ok+tool_bonus" else out["f1"])
        assert 0.0 <= score <= 1.0 + tool_bonus + 1e-12


def check_qa_f1(out):
    check_deep_research(out, tool_bonus=0.0)


def check_math(out):
    score, reason = _basic(out)
    _event(f"math: {reason.split(':')[0]}")
    assert reason in MATH_REASONS or reason.startswith("verify_error: ")
    assert score == (1.0 if reason in ("exact_match", "equivalent") else 0.0)


def check_gsm8k(out):
    score, reason = _basic(out)
    assert reason in GSM_REASONS and score == (1.0 if reason == "correct" else 0.0)


@fuzz(300)
@given(case=scored_case(), extra=extra_info)
def test_deep_research_scorer(case, extra):
    text, gt = case
    check_deep_research(deep_research.compute_score("hotpotqa", text, gt, extra))


@fuzz(200)
@given(case=scored_case(), extra=extra_info, method=st.sampled_from(["strict", "flexible"]))
def test_gsm8k_scorer(case, extra, method):
    text, gt = case
    check_gsm8k(gsm8k.compute_score("openai/gsm8k", text, gt, extra, method=method))


@fuzz(60)
@given(case=scored_case(), extra=extra_info)
def test_math_scorer(case, extra):
    text, gt = case
    check_math(math_score.compute_score("math", text, gt, extra))


@fuzz(200)
@given(gt=ground_truth)
def test_ground_truths_always_a_list_of_non_empty_strings(gt):
    out = ground_truths(gt)
    assert isinstance(out, list) and all(isinstance(g, str) and g for g in out)


CHECKS = {"hotpotqa": check_deep_research, "bamboogle": check_deep_research, "arpo_toy_search": check_qa_f1,
          "aime24": check_math, "numina_olympiads": check_math, "gsm8k": check_math, "openai/gsm8k": check_gsm8k}


@fuzz(80)
@given(source=st.sampled_from(sorted(CHECKS)), case=st.sampled_from(["lower", "upper", "padded"]),
       scored=scored_case())
def test_dispatch_of_known_sources(source, case, scored):
    text, gt = scored
    name = {"lower": source, "upper": source.upper(), "padded": f"  {source} "}[case]
    CHECKS[source](default_compute_score(name, text, gt))


@fuzz(60)
@given(source=st.one_of(st.text(max_size=10), st.integers(), st.none(), st.binary(max_size=6)))
def test_unknown_sources_raise_value_error_naming_the_fix(source):
    try:
        out = default_compute_score(source, "\\boxed{1}", "1")
    except ValueError as exc:
        assert "custom_reward_function" in str(exc)
    else:  # a fuzzed name that happens to be a known source or prefix
        assert isinstance(out["score"], float)


@pytest.mark.parametrize("text", ["<think>a</think><answer>\\boxed{" + "{" * 5000 + "x" + "}" * 5000 + "}</answer>",
                                  "<search>" * 20000 + "</search><result>" * 20000,
                                  "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 301])
def test_pathological_nesting_is_bounded(text):
    import time

    start = time.perf_counter()
    check_deep_research(deep_research.compute_score("hotpotqa", text, "x"))
    check_math(math_score.compute_score("math", text, "x"))
    check_gsm8k(gsm8k.compute_score("openai/gsm8k", text, "1"))
    assert time.perf_counter() - start < 20
