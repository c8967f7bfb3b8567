"""Text helpers shared by the rule-based scorers (no torch, no third-party imports).

- `sanitize_text`: any model output -> a clean `str`. Lone UTF-16 surrogates (what
  `bytes.decode(errors="surrogateescape")` leaves behind for non-UTF-8 bytes, e.g. '\\udcff') become
  U+FFFD, `bytes` are decoded as UTF-8 with replacement, `None` becomes "". Never raises.
- `last_boxed`: the *last* `\\boxed{...}` / `\\fbox{...}` (brace-matched) or
  `\\boxed 5` (space form: up to the next whitespace or `$`). Escaped braces `\\{` `\\}` inside the
  box are literal characters and do not count for matching (so `\\boxed{\\{1,2\\}}` works).
  An unmatched `{` means "no box" rather than "box to end of text".
- `ground_truths`: a ground truth given as a string, a list/tuple, a numpy array of strings, or a
  verl search-style dict `{"target": [...]}` -> a list of non-empty strings.

All functions are linear in the input length, so a 1 MB response costs milliseconds.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["sanitize_text", "last_boxed", "last_boxed_span", "ground_truths", "in_main_thread"]

_SURROGATES = re.compile("[\ud800-\udfff]")
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def sanitize_text(value: Any) -> str:
    """Return `value` as a str that is valid UTF-8 (lone surrogates -> U+FFFD). Never raises."""
    try:
        if value is None:
            return ""
        if isinstance(value, (bytes, bytearray, memoryview)):
            return bytes(value).decode("utf-8", errors="replace")
        if not isinstance(value, str):
            value = str(value)
        return _SURROGATES.sub("\ufffd", value)
    except Exception:  # pragma: no cover - str() of an exotic object failed
        return ""


def _match_brace(text: str, open_idx: int, limit: int) -> int:
    """Index of the `}` closing the `{` at `open_idx` (searching before `limit`), or -1.

    Escaped `\\{`/`\\}` are skipped."""
    depth = 0
    i = open_idx
    n = min(len(text), limit)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\ ...)
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _box_at(text: str, start: int, command: str, limit: int,
            space_form: bool) -> tuple[tuple[int, str] | None, int]:
    """Parse the box command at `start`.

    Returns ((end, content) or None, open_brace_index or -1). The brace match is searched only
    before `limit` (see `last_boxed`); an unmatched brace returns its index so the caller can
    lower its limit.
    """
    i = start + len(command)
    n = len(text)
    # `\\boxed` must not be a prefix of a longer command name (e.g. `\\boxedx`).
    if i < n and text[i].isalpha():
        return None, -1
    j = i
    while j < n and text[j] in " \t":
        j += 1
    if j < n and text[j] == "{":
        close = _match_brace(text, j, limit)
        if close < 0:
            return None, j
        return (close + 1, text[j + 1:close]), -1
    if space_form and i < j < n:  # space form: `\\boxed 5`
        k = j
        while k < n and not text[k].isspace() and text[k] != "$":
            k += 1
        if k > j:
            return (k, text[j:k]), -1
    return None, -1


def last_boxed(text: str, commands: tuple[str, ...] = _BOX_COMMANDS,
               space_form: bool = True) -> str | None:
    """Content of the last well-formed box in `text`, else None (see `last_boxed_span`)."""
    span = last_boxed_span(text, commands, space_form)
    return None if span is None else span[1]


def last_boxed_span(text: str, commands: tuple[str, ...] = _BOX_COMMANDS,
                    space_form: bool = True) -> tuple[int, str] | None:
    """(start, content) of the last well-formed `\\boxed{}`/`\\fbox{}`/`\\boxed x`, else None.

    `commands` and `space_form` restrict the accepted forms (deep_research wants `\\boxed{}` only).

    Scans backwards from the end. If the box whose `{` is at q never closes, a box opened earlier
    can only close before q (otherwise its own brace would still be open at the end), so later
    scans stop at q: each character is scanned about once even for 1 MB of `\\boxed{\\boxed{...`.
    """
    best: tuple[int, str] | None = None
    for command in commands:
        limit = len(text)
        pos = text.rfind(command)
        while pos >= 0:
            span, open_brace = _box_at(text, pos, command, limit, space_form)
            if span is not None:
                if best is None or pos > best[0]:
                    best = (pos, span[1])
                break
            if open_brace >= 0:
                limit = open_brace
            pos = text.rfind(command, 0, pos)
    return best


def ground_truths(value: Any) -> list[str]:
    """Normalise a ground truth (str | list | tuple | numpy array | {"target": [...]}) to strings."""
    if value is None:
        return []
    if isinstance(value, dict):
        for key in ("target", "ground_truth", "answer"):
            if key in value:
                return ground_truths(value[key])
        return []
    if isinstance(value, (str, bytes, bytearray)):
        text = sanitize_text(value).strip()
        return [text] if text else []
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    if callable(tolist) and not isinstance(value, (list, tuple)):
        value = tolist()
        if not isinstance(value, list):
            return ground_truths(value if isinstance(value, str) else sanitize_text(value))
    if isinstance(value, (list, tuple, set)):
        out: list[str] = []
        for item in value:
            out.extend(ground_truths(item))
        return out
    text = sanitize_text(value).strip()
    return [text] if text else []


def in_main_thread() -> bool:
    """True when signal-based timeouts (signal.alarm, used by math-verify) are usable here."""
    import threading

    return threading.current_thread() is threading.main_thread()
