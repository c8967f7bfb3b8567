"""Reward for math answers (MATH, AIME, MATH500, NuminaMath, ...): last `\\boxed{}` + math-verify.

Rule:
1. answer = content of the last brace-matched `\\boxed{...}` / `\\fbox{...}` (or `\\boxed 5`) in the
   response; none -> 0.0 ("no_boxed").
2. score = 1.0 if the answer equals some ground truth after light whitespace/`$` normalisation,
   or if math-verify judges them equivalent (`verify(parse(gold), parse(answer))`: symbolic and
   numeric equality, fractions, decimals, LaTeX forms, sets, intervals, equations `x=3` vs `3`);
   else 0.0.

Returns a dict `{"score", "answer", "reason"}` like every scorer in this package; `reason` is
"exact_match", "equivalent", "not_equivalent", "no_boxed", "answer_too_long", "no_ground_truth"
or "verify_error: <exception>".

Safety: math-verify (sympy) can take unbounded time on pathological input. We (a) refuse answers
longer than `MAX_ANSWER_CHARS` and ground truths longer than `MAX_GOLD_CHARS`, (b) pass
math-verify's own timeouts (`parsing_timeout`, `timeout_seconds`), which use `signal.alarm` and so
only work in a process's main thread; in any other thread they are switched off (math-verify
raises otherwise) and only the length cap protects us. The reward manager scores in the main
thread of its worker processes, where the timeouts apply. A caller's own pending `signal.alarm`
(pytest-timeout, a watchdog) would be cancelled by math-verify; we re-arm it afterwards.
A timeout counts as "not equivalent". Any exception inside math-verify is caught and scores 0.0:
this function never raises on model output.

Departure from the reference: the seed documents describe its math reward as an exact match of
normalised strings (so `0.5` vs `\\frac{1}{2}` would score 0); docs/algorithms.md ("Rewards") asks for
symbolic equivalence, which is what we do.
"""
from __future__ import annotations

import contextlib
import math as _pymath
import signal
import time
from typing import Any
from collections.abc import Iterator

from verl_arpo.utils.reward_score._text import ground_truths, in_main_thread, last_boxed, sanitize_text

__all__ = ["compute_score", "extract_answer", "is_equiv", "MAX_ANSWER_CHARS"]

MAX_ANSWER_CHARS = 1000
MAX_GOLD_CHARS = 2000
DEFAULT_TIMEOUT_SECONDS = 5


def extract_answer(solution_str: Any) -> str | None:
    """The last boxed answer of a response, stripped, or None."""
    answer = last_boxed(sanitize_text(solution_str))
    return None if answer is None else answer.strip()


def _light_normalize(text: str) -> str:
    text = text.strip().strip("$").strip()
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "\\displaystyle"):
        text = text.replace(token, "")
    text = "".join(text.split())
    return text.rstrip(".")


def _wrap_gold(gold: str) -> str:
    return gold if ("\\boxed" in gold or "$" in gold) else "\\boxed{" + gold + "}"


@contextlib.contextmanager
def _keep_outer_alarm() -> Iterator[None]:
    """math-verify's timeout cancels any pending `signal.alarm` of the caller (e.g. pytest-timeout).

    Take the caller's remaining alarm out before and re-arm it (minus the time spent) after.
    """
    pending = signal.alarm(0)
    start = time.monotonic()
    try:
        yield
    finally:
        if pending:
            signal.alarm(max(1, pending - _pymath.ceil(time.monotonic() - start)))


def is_equiv(answer: str, gold: str, timeout_seconds: int | None = DEFAULT_TIMEOUT_SECONDS) -> bool:
    """math-verify equivalence of a boxed answer and a ground truth (raises on library errors)."""
    from math_verify import parse, verify  # heavy import (sympy), done lazily

    timeout = timeout_seconds if (timeout_seconds and in_main_thread()) else None
    with _keep_outer_alarm() if timeout else contextlib.nullcontext():
        gold_parsed = parse(_wrap_gold(gold), parsing_timeout=timeout)
        pred_parsed = parse("\\boxed{" + answer + "}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None,
                  timeout_seconds: int | None = DEFAULT_TIMEOUT_SECONDS) -> dict[str, Any]:
    """Score one response (see the module docstring). Never raises on model output."""
    answer = extract_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "answer": "", "reason": "no_boxed"}
    if len(answer) > MAX_ANSWER_CHARS:
        return {"score": 0.0, "answer": answer[:100], "reason": "answer_too_long"}
    golds = [g for g in ground_truths(ground_truth) if len(g) <= MAX_GOLD_CHARS]
    if not golds:
        return {"score": 0.0, "answer": answer, "reason": "no_ground_truth"}
    norm_answer = _light_normalize(answer)
    if norm_answer and any(norm_answer == _light_normalize(g) for g in golds):
        return {"score": 1.0, "answer": answer, "reason": "exact_match"}
    try:
        if any(is_equiv(answer, gold, timeout_seconds) for gold in golds):
            return {"score": 1.0, "answer": answer, "reason": "equivalent"}
    except Exception as exc:  # math-verify / sympy failure on odd input
        return {"score": 0.0, "answer": answer, "reason": f"verify_error: {type(exc).__name__}"}
    return {"score": 0.0, "answer": answer, "reason": "not_equivalent"}
