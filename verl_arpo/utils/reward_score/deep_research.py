"""Reward for tool-using QA / deep-search rollouts (GAIA, HLE, HotpotQA, ...): format gate + F1.

Rule (the reference's behaviour, docs/algorithms.md, "Rewards"):

1. Format gate; any failure scores **-1.0**:
   - `<think>` and `</think>` occur equally often, at least once each (counted, as the reference
     does; their order is not checked);
   - exactly one `<answer>` and one `</answer>`, the opening tag first;
   - the text between them contains a brace-matched `\\boxed{...}`;
   - every `<search>` (resp. `<python>`) is followed, later in the text, by `</search>`
     (`</python>`), after that by `<result>`, after that by `</result>`.
2. Answer = content of the last brace-matched `\\boxed{}` inside `<answer>...</answer>`.
3. score = max over ground truths of the SQuAD token F1 (HotpotQA variant):
      normalise(s) = collapse_spaces(drop_articles(drop_punctuation(lower(s))))
      P = |common| / |pred tokens|, R = |common| / |gold tokens|, F1 = 2PR / (P + R)
   where |common| counts shared tokens with multiplicity; if either normalised side is one of
   `yes` / `no` / `noanswer` and the two differ, F1 = 0.
4. +0.1 when F1 > 0 and the response used both tools (at least one `<search>` and one `<python>`).
   The score therefore lies in {-1} ∪ [0, 1.1]. The `qa_f1` scorer (`tool_bonus=0`, the bundled
   task's lookups and two-step questions) leaves this out: a lookup needs no Python, and the
   bonus paid for adding a needless call (docs/algorithms.md, "Rewards").

Returns a dict `{"score", "f1", "answer", "reason"}`; `reason` is "ok", "ok+tool_bonus",
"wrong_answer", "no_ground_truth" or "format:<rule>" naming the failed rule.

Departures from the reference: the tool-call rule is checked with one linear scan per tag (the
reference's rule, implemented without re-searching the text per call); the ground truth may also be
a numpy array or a `{"target": [...]}` dict; the response is sanitised first (lone surrogates from
non-UTF-8 bytes become U+FFFD), so this function never raises on model output.

Not covered: LLM-as-judge grading (GAIA/HLE leaderboards use one); semantic equivalence.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from verl_arpo.utils.reward_score._text import ground_truths, last_boxed, sanitize_text

__all__ = ["compute_score", "compute_score_qa_f1", "check_format", "normalize_answer", "f1_score", "TOOL_TAGS"]

FORMAT_PENALTY = -1.0
TOOL_BONUS = 0.1
TOOL_TAGS = ("search", "python")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")


def unwrap_latex_text(text: str) -> str:
    """`\\text{Paris}` → `Paris` (also textbf/textit/mathrm/mathbf/operatorname, nested).

    Departure from the reference, which normalised `\\boxed{\\text{Paris}}` to "textparis" and so
    scored a correct, conventionally written answer 0."""
    for _ in range(8):
        new = _LATEX_TEXT.sub(r"\1", text)
        if new == text:
            break
        text = new
    return text


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace
    (after unwrapping LaTeX text commands)."""
    text = unwrap_latex_text(text).lower().translate(_PUNCT_TABLE)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 between two strings after `normalize_answer` (yes/no/noanswer mismatch -> 0)."""
    pred_norm = normalize_answer(prediction)
    gold_norm = normalize_answer(gold)
    if (pred_norm in _SPECIAL or gold_norm in _SPECIAL) and pred_norm != gold_norm:
        return 0.0
    pred_tokens = pred_norm.split()
    gold_tokens = gold_norm.split()
    if not pred_tokens or not gold_tokens:
        return 0.0
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _tool_calls_closed(text: str, tag: str) -> str | None:
    """None if every `<tag>` is followed by `</tag>`, `<result>`, `</result>` in that order.

    For the call at position p the rule needs the first `</tag>` after p, the first `<result>`
    after that and the first `</result>` after that. Those "first after" positions only move
    forward as p grows, so one pass over the calls with monotone cursors is linear.
    """
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    pos = text.find(open_tag)
    close = res_open = res_close = -1
    while pos >= 0:
        if close < pos:
            close = text.find(close_tag, pos + len(open_tag))
            if close < 0:
                return f"format:{tag}_unclosed"
        if res_open < close:
            res_open = text.find("<result>", close + len(close_tag))
            if res_open < 0:
                return f"format:{tag}_no_result"
        if res_close < res_open:
            res_close = text.find("</result>", res_open + len("<result>"))
            if res_close < 0:
                return f"format:{tag}_result_unclosed"
        pos = text.find(open_tag, pos + len(open_tag))
    return None


def check_format(text: str) -> tuple:
    """Apply the format gate. Returns (failure reason or None, answer or None)."""
    n_think_open, n_think_close = text.count("<think>"), text.count("</think>")
    if n_think_open == 0 and n_think_close == 0:
        return "format:no_think", None
    if n_think_open != n_think_close:
        return "format:think_unbalanced", None
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "format:answer_count", None
    start, end = text.find("<answer>"), text.find("</answer>")
    if end < start:
        return "format:answer_order", None
    answer = last_boxed(text[start + len("<answer>"):end], commands=("\\boxed",), space_form=False)
    if answer is None:
        return "format:no_boxed", None
    for tag in TOOL_TAGS:
        failure = _tool_calls_closed(text, tag)
        if failure:
            return failure, None
    return None, answer


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any,
                  extra_info: Any = None, tool_bonus: float = TOOL_BONUS) -> dict[str, Any]:
    """Score one response (see the module docstring). Never raises on model output.
    `tool_bonus=0` is the `qa_f1` scorer (format gate and F1 only)."""
    text = sanitize_text(solution_str)
    failure, answer = check_format(text)
    if failure:
        return {"score": FORMAT_PENALTY, "f1": 0.0, "answer": "", "reason": failure}
    answer = answer.strip()
    golds: list[str] = ground_truths(ground_truth)
    if not golds:
        return {"score": 0.0, "f1": 0.0, "answer": answer, "reason": "no_ground_truth"}
    f1 = max(f1_score(answer, gold) for gold in golds)
    if f1 <= 0.0:
        return {"score": 0.0, "f1": 0.0, "answer": answer, "reason": "wrong_answer"}
    if tool_bonus and all(f"<{tag}>" in text for tag in TOOL_TAGS):
        return {"score": f1 + tool_bonus, "f1": f1, "answer": answer, "reason": "ok+tool_bonus"}
    return {"score": f1, "f1": f1, "answer": answer, "reason": "ok"}


def compute_score_qa_f1(data_source: Any, solution_str: Any, ground_truth: Any,
                        extra_info: Any = None) -> dict[str, Any]:
    """The format gate and F1 without the tool bonus (rule 4): the `qa_f1` scorer."""
    return compute_score(data_source, solution_str, ground_truth, extra_info, tool_bonus=0.0)
