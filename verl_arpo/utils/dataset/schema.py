"""Row normalisation for RL parquet files (torch-free): two input schemas -> one verl layout.

Input schemas (docs/migrating.md):
- verl / reference files: `data_source` str, `prompt` = list of `{role, content}` messages,
  `ability`, `reward_model` = `{ground_truth, style}`, `extra_info` dict;
- the flat form the docs show: `prompt` str, `answer` str (or list), `data_source`, `tools` list.

Output (one dict per row): `messages` (list of {role, content}), `data_source`, `ability`,
`reward_model` = {ground_truth, style}, `extra_info` (dict; the flat form's `tools` land in
`extra_info["tools"]`).

A row is rejected, with (field, reason), when the prompt is missing, of a wrong type, empty, not
valid UTF-8 (bytes that do not decode), or a message is not a {role: str, content: str} dict; when
the ground truth is missing; or when `data_source` is missing or not a string.

The reference's system prompt was written as a non-raw Python string, so its `\\boxed` became the
backspace control character U+0008 followed by `oxed`. `repair_backspace` puts `\\boxed` back and
returns how many it repaired. Only this defect is repaired; other escape accidents (e.g. `\\f` in
`\\frac` -> form feed) are left alone because none was seen in the reference's data.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["normalize_row", "repair_backspace", "apply_system_prompt", "RowError"]

BACKSPACE_DEFECT = "\x08oxed"
BACKSPACE_FIX = "\\boxed"

RowError = tuple[str, str]  # (field, reason)
_SURROGATE = re.compile("[\ud800-\udfff]")


def repair_backspace(text: str) -> tuple[str, int]:
    """Replace every U+0008 + "oxed" by "\\boxed"; return (text, number of repairs)."""
    count = text.count(BACKSPACE_DEFECT)
    return (text.replace(BACKSPACE_DEFECT, BACKSPACE_FIX), count) if count else (text, 0)


def _as_text(value: Any, field: str) -> tuple[str | None, RowError | None]:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8"), None
        except UnicodeDecodeError as exc:
            return None, (field, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
    if isinstance(value, str):
        if _SURROGATE.search(value):
            return None, (field, "not valid UTF-8 (lone surrogate)")
        return value, None
    return None, (field, f"expected a string, got {type(value).__name__}")


def _messages(prompt: Any, field: str) -> tuple[list[dict[str, str]] | None, RowError | None]:
    if prompt is None:
        return None, (field, "missing")
    if isinstance(prompt, (str, bytes, bytearray)):
        text, err = _as_text(prompt, field)
        if err:
            return None, err
        if not text.strip():
            return None, (field, "empty")
        return [{"role": "user", "content": text}], None
    if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
        prompt = prompt.tolist()  # numpy array of dicts
    if not isinstance(prompt, (list, tuple)):
        return None, (field, f"expected a string or a list of messages, got {type(prompt).__name__}")
    if not prompt:
        return None, (field, "empty")
    messages = []
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            return None, (f"{field}[{j}]", "not a {role, content} message")
        role, err = _as_text(msg["role"], f"{field}[{j}].role")
        if err:
            return None, err
        content, err = _as_text(msg["content"], f"{field}[{j}].content")
        if err:
            return None, err
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        return None, (field, "empty")
    return messages, None


def _ground_truth(raw: dict[str, Any]) -> tuple[Any, str]:
    reward_model = raw.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"], str(reward_model.get("style") or "rule")
    for key in ("answer", "ground_truth"):
        if raw.get(key) is not None:
            return raw[key], "rule"
    return None, "rule"


def _plain(value: Any) -> Any:
    """numpy arrays -> lists, bytes -> str (valid UTF-8 assumed for labels)."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str)):
        value = value.tolist()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def normalize_row(raw: dict[str, Any],
                  prompt_key: str = "prompt") -> tuple[dict[str, Any] | None, RowError | None]:
    """One parquet row (as a dict) -> (normalised row, None) or (None, (field, reason))."""
    messages, err = _messages(raw.get(prompt_key), prompt_key)
    if err:
        return None, err
    ground_truth, style = _ground_truth(raw)
    ground_truth = _plain(ground_truth)
    if ground_truth is None or (isinstance(ground_truth, (str, list)) and len(ground_truth) == 0):
        return None, ("reward_model.ground_truth", "missing")
    if isinstance(ground_truth, str):
        _, gt_err = _as_text(ground_truth, "reward_model.ground_truth")
        if gt_err:
            return None, gt_err
    data_source = raw.get("data_source")
    if isinstance(data_source, (bytes, bytearray)):
        data_source, err = _as_text(data_source, "data_source")
        if err:
            return None, err
    if not isinstance(data_source, str) or not data_source.strip():
        return None, ("data_source", "missing" if data_source in (None, "") else "not a string")
    extra_info = raw.get("extra_info")
    if not isinstance(extra_info, dict):
        extra_info = {} if extra_info is None else {"value": extra_info}
    extra_info = dict(extra_info)
    if raw.get("tools") is not None:
        extra_info.setdefault("tools", _plain(raw["tools"]))
    return {
        "messages": messages,
        "data_source": data_source,
        "ability": str(raw.get("ability") or ""),
        "reward_model": {"ground_truth": ground_truth, "style": style},
        "extra_info": extra_info,
    }, None


def apply_system_prompt(messages: list[dict[str, str]], system_prompt: str) -> list[dict[str, str]]:
    """Replace the first system message's content, or prepend a system message."""
    out = [dict(m) for m in messages]
    for msg in out:
        if msg["role"] == "system":
            msg["content"] = system_prompt
            return out
    return [{"role": "system", "content": system_prompt}] + out
