"""Text ↔ tokens at the tool boundary: find the call in the model's text, encode the result safely.

Kept apart from the loop because both rules are [fix]es with their own tests:
- the call's content comes from the text the model generated in *this round* (the reference
  searched the whole context, prompt included, and could execute an example from the system
  prompt);
- the result is encoded without special tokens, and tool output that *spells* a special token
  (`<|im_end|>`, `<|endoftext|>` …) stays plain text instead of becoming that token's id.
"""

from __future__ import annotations

import re

RESULT_TEMPLATE = " <result>\n{text}\n</result>"
_SURROGATE = re.compile("[\ud800-\udfff]")


def extract_tool_call(round_text: str, stop_str: str | None) -> tuple[str, str]:
    """(tag, content) for a round that ended with the stop string `</tag>`.

    content = the text between the last `<tag>` and the final `</tag>` of `round_text`, stripped;
    "" when the opening tag is missing (the caller turns that into an error message).
    """
    if not stop_str or not stop_str.startswith("</") or not stop_str.endswith(">"):
        raise ValueError(f"stop string {stop_str!r} is not a closing tool tag like '</python>'")
    tag = stop_str[2:-1]
    end = round_text.rfind(stop_str)
    if end < 0:
        return tag, ""
    start = round_text.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return tag, ""
    return tag, round_text[start + len(tag) + 2:end].strip()


def neutralise_special_text(tokenizer, text: str) -> str:
    """Break up literal special-token strings (e.g. '<|im_end|>' → '<| im_end|>')."""
    for tok in sorted(set(getattr(tokenizer, "all_special_tokens", [])), key=len, reverse=True):
        if tok and len(tok) > 1 and tok in text:
            text = text.replace(tok, tok[:2] + " " + tok[2:] if len(tok) > 2 else tok[0] + " " + tok[1:])
    return text


def valid_text(text) -> str:
    """`text` as a str the tokenizer accepts: lone surrogates (bytes a tool decoded with
    `surrogateescape`) become U+FFFD. [reliability: tests/reliability/README.md] the Rust tokenizer rejected them with a
    TypeError that escaped into the rollout, and json dumps of such text fail too."""
    text = text if isinstance(text, str) else str(text)
    return _SURROGATE.sub("\ufffd", text)


def encode_tool_result(tokenizer, text: str) -> list[int]:
    """Token ids of ` <result>\\n{text}\\n</result>` that contain no special-token id."""
    text = valid_text(text)
    full = RESULT_TEMPLATE.format(text=text)
    special = set(getattr(tokenizer, "all_special_ids", []))
    try:
        ids = tokenizer.encode(full, add_special_tokens=False, split_special_tokens=True)
    except TypeError:  # tokenizers without split_special_tokens
        ids = tokenizer.encode(full, add_special_tokens=False)
    if special.intersection(ids):
        ids = tokenizer.encode(RESULT_TEMPLATE.format(text=neutralise_special_text(tokenizer, text)),
                               add_special_tokens=False)
    return [i for i in ids if i not in special]  # last resort: never emit a special id


def fit_tool_result(tokenizer, text: str, max_tokens: int) -> tuple[list[int], str]:
    """(ids, shown): `encode_tool_result` of the part of `text` the budget can hold.

    [reliability: tests/reliability/README.md] Tokenising a 10 MB tool output took 20-40 s on a CPU and ~0.4 GB of
    Python ints, for a result cut to `max_tokens` ids right after. Here only a prefix is encoded:
    8 characters per budget token to start with, 4x more until the ids overflow the budget by a
    margin (so the cut falls inside the text, never on the closing tag) or the whole text is used.
    `shown` is that prefix (sanitised), i.e. what the trajectory really contains; when the whole
    text fits it is the text itself and `ids` are exactly `encode_tool_result(tokenizer, text)`.
    """
    text = valid_text(text)
    chars = max(1024, 8 * max(0, int(max_tokens)))
    while True:
        shown = text[:chars]
        ids = encode_tool_result(tokenizer, shown)
        if len(shown) == len(text) or len(ids) >= max_tokens + 32:
            return ids, shown
        chars *= 4
