"""Reward for GSM8K-style answers: the final number of the response.

Rule:
- `method="strict"`: the answer is the number in the last `#### <number>` or, if that comes
  later in the text, the last `\\boxed{<number>}` (boxed content must be a plain number after
  removing `$`, `\\$`, `,` and a trailing `.`/`%`/`\\%`). Anything else -> no answer.
- `method="flexible"`: the answer is the last number anywhere in the response.
- Numbers: optional sign, digits with optional thousands commas, optional decimal part
  (`-1,234.50`). Compared numerically: |a - g| <= 1e-6 · max(1, |g|).
- The ground truth may be a bare number ("72") or a full GSM8K solution ending in "#### 72".
- score = `score` (1.0) if equal, `format_score` (0.0) if an answer was found but is wrong,
  0.0 if none was found.

Returns a dict `{"score", "answer", "reason"}`; reason is "correct", "wrong_answer",
"no_answer" or "no_ground_truth". Never raises on model output.

Departure from verl's gsm8k scorer: it only knows `####`; reasoning models answer in `\\boxed{}`,
which strict mode accepts too (whichever comes last).
"""
from __future__ import annotations

import re
from typing import Any

from verl_arpo.utils.reward_score._text import ground_truths, last_boxed_span, sanitize_text

__all__ = ["compute_score", "extract_solution"]

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_BOX_STRIP = ("\\$", "$", "\\%", "%", "\\!", " ")


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _boxed_number(text: str):
    """(position, number string) of the last `\\boxed{}` if its content is a plain number."""
    span = last_boxed_span(text)
    if span is None:
        return -1, None
    pos, content = span
    for token in _BOX_STRIP:
        content = content.replace(token, "")
    content = content.rstrip(".")
    return (pos, content) if _NUMBER_RE.fullmatch(content) else (-1, None)


def extract_solution(solution_str: Any, method: str = "strict") -> str | None:
    """The final number of a response per `method` ("strict" or "flexible"), or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = sanitize_text(solution_str)
    if method == "flexible":
        numbers = _NUMBER_RE.findall(text)
        return numbers[-1] if numbers else None
    hashes = list(_HASH_RE.finditer(text))
    hash_pos, hash_num = (hashes[-1].start(), hashes[-1].group(1)) if hashes else (-1, None)
    box_pos, box_num = _boxed_number(text)
    if hash_num is None and box_num is None:
        return None
    return hash_num if hash_pos > box_pos else box_num


def _gold_number(gold: str) -> float | None:
    hashes = _HASH_RE.findall(gold)
    if hashes:
        return _to_float(hashes[-1])
    stripped = gold.strip().replace("$", "").rstrip(".")
    return _to_float(stripped) if _NUMBER_RE.fullmatch(stripped) else None


def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None,
                  method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> dict[str, Any]:
    """Score one response (see the module docstring)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return {"score": 0.0, "answer": "", "reason": "no_answer"}
    golds = [g for g in (_gold_number(t) for t in ground_truths(ground_truth)) if g is not None]
    if not golds:
        return {"score": 0.0, "answer": answer, "reason": "no_ground_truth"}
    value = _to_float(answer)
    if value is not None and any(abs(value - g) <= 1e-6 * max(1.0, abs(g)) for g in golds):
        return {"score": float(score), "answer": answer, "reason": "correct"}
    return {"score": float(format_score), "answer": answer, "reason": "wrong_answer"}
