"""verl's chat-template keys, one meaning everywhere a prompt is rendered (RL dataset, SFT data,
evaluation): `data.custom_chat_template` replaces the tokenizer's template (a Jinja string, or the
path of a file holding one) and `data.apply_chat_template_kwargs` are passed to every
`apply_chat_template` call (Qwen3: `{enable_thinking: false}`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def load_chat_template(value: str | None) -> str | None:
    """The template text: `value` itself, or the contents of the file it names."""
    if not value:
        return None
    path = os.path.expanduser(str(value))
    if "{" not in value and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"data.custom_chat_template={value!r} is neither a Jinja template nor an existing file")
    return str(value)


def configure_chat_template(tokenizer: Any, custom_chat_template: str | None) -> Any:
    """Install the custom template on `tokenizer` (in place) when one is given; returns it."""
    template = load_chat_template(custom_chat_template)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool,
                kwargs: Mapping[str, Any] | None = None, tools: list[dict] | None = None) -> str:
    """`apply_chat_template(..., tokenize=False)` with the configured extra keyword arguments, and
    the function schemas (`tools`) when the hermes format renders them into the prompt."""
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = tools
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)
