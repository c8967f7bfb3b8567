"""How a model calls tools: the format strategy the one agent loop uses
(`actor_rollout_ref.rollout.multi_turn.format`; docs/tools.md, "Tool-call formats").

A format answers three questions for the loop, and nothing else changes between formats:

    stop_strings()          where the engine stops a round
    parse(out)              the round's tool calls (None: the round called no tool, the trajectory ends)
    render_results(...)     the token ids appended after the round (loss mask 0)

`tags` (default; the reference's, bit-identical to before the formats existed)
    the model writes `<python>code</python>` or `<search>query</search>`; the engine stops on the
    closing tag; the call's content is the text between the last opening tag and the stop string
    of *this round*; the result is ` <result>\\n…\\n</result>` encoded without special tokens.

`hermes` (chat-template function calling: Qwen2.5/Qwen3 and most agent models)
    the prompt is rendered by the tokenizer's chat template with `tools=[function schemas]`; the
    model's turn ends at its EOS (`<|im_end|>`); every `<tool_call>{"name": …, "arguments": {…}}
    </tool_call>` of the turn is a call, run concurrently; the results are `role: tool` messages
    rendered by the *same template*, and only the new tokens are appended: earlier assistant turns
    are never re-rendered (a template that strips `<think>` from them cannot change what was
    generated), so the tokens trained are exactly the tokens the engine generated.

Bad calls are the model's errors and become tool messages it reads: a call that is not JSON, an
unknown function, arguments of the wrong shape (schema.argument_error). Each is counted
(`tools/format_errors/<kind>`), none runs a tool, none stops the run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from verl_arpo.workers.rollout.tool_text import (
    neutralise_special_text,
    valid_text,
    extract_tool_call,
    fit_tool_result,
)
from verl_arpo.workers.rollout.tools.base_tool import FunctionCall
from verl_arpo.workers.rollout.tools.schema import argument_error

EMPTY_CALL_TEXT = "Error: the <{tag}> call was empty; write the {tag} input between <{tag}> and </{tag}>."
FORMATS = ("tags", "hermes")


@dataclass
class ToolCall:
    """One call the model made in a round. `error` set: a malformed call, answered with that text
    and no tool run."""

    tag: str                           # the executor's tool key ("" when no tool matches)
    content: str | FunctionCall        # tags: the text between the tags; hermes: name + arguments
    name: str                          # what the dump and the tree viewer show: the tag or function name
    error: str | None = None

    @property
    def record(self) -> dict[str, Any]:
        """The call as the rollout dump keeps it (tags: `content` is the text)."""
        if isinstance(self.content, FunctionCall):
            return {"tag": self.tag, "name": self.name, "arguments": self.content.arguments,
                    "content": json.dumps(self.content.arguments, ensure_ascii=False)}
        return {"tag": self.tag, "content": self.content}


class TagFormat:
    """`<tag>content</tag>` calls and ` <result>` results (the reference's format)."""

    name = "tags"
    forced_eos = True   # a round ended on a stop string: the call-limit stop appends a (masked) EOS

    def __init__(self, tokenizer, executor, **_: Any):
        self.tokenizer = tokenizer
        self._stops = list(executor.stop_strings) if executor is not None else []

    def stop_strings(self) -> list[str]:
        return list(self._stops)

    def parse(self, out) -> list[ToolCall] | None:
        if out.finish_reason != "stop":
            return None
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        tag, content = extract_tool_call(text, out.stop_str)
        return [ToolCall(tag, content, tag, None if content.strip() else EMPTY_CALL_TEXT.format(tag=tag))]

    def render_results(self, calls: list[ToolCall], texts: list[str], room: int, out) -> tuple[list[int], list[str]]:
        (text,) = texts   # one call per round
        ids, shown = fit_tool_result(self.tokenizer, text, room)
        return ids, [shown]


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesFormat:
    """Chat-template function calling with Hermes-style `<tool_call>` JSON (Qwen2.5/Qwen3's)."""

    name = "hermes"
    forced_eos = False   # the turn already ended with the model's own EOS

    def __init__(self, tokenizer, executor, chat_template_kwargs: dict | None = None, **_: Any):
        self.tokenizer, self.executor = tokenizer, executor
        self.kwargs = dict(chat_template_kwargs or {})
        self.functions = executor.function_table() if executor is not None else {}
        self.schemas = [s for _, s in self.functions.values()]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("actor_rollout_ref.rollout.multi_turn.format=hermes renders tool messages with the "
                             "tokenizer's chat template, and this tokenizer has none: set data.custom_chat_template")
        self._tool_framing_check()   # also keeps the placeholder conversation's render (self._base)
        self.errors: dict[str, int] = {}

    def stop_strings(self) -> list[str]:
        return []   # a turn ends at EOS: it may hold several calls

    # -------------------------------------------------------------------------- calls
    def parse(self, out) -> list[ToolCall] | None:
        if out.finish_reason == "length":
            return None
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        blocks = _CALL.findall(text)
        opened = text.count("<tool_call>")
        if not blocks and not opened:
            return None   # the final answer
        calls = [self._call(b) for b in blocks]
        if opened > len(blocks):   # an unclosed <tool_call>: said, not guessed at
            calls.append(self._error("unclosed", "", "a <tool_call> was not closed; write <tool_call>{\"name\": "
                                     "..., \"arguments\": {...}}</tool_call>"))
        return calls

    def _call(self, block: str) -> ToolCall:
        try:
            obj = json.loads(block.strip())
        except json.JSONDecodeError as exc:
            return self._error("invalid_json", "", f"the tool call is not valid JSON ({exc.msg} at character "
                               f"{exc.pos}); write {{\"name\": \"<function>\", \"arguments\": {{...}}}}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return self._error("invalid_json", "", "a tool call is a JSON object with a string \"name\" and an "
                               "object \"arguments\"")
        name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):   # OpenAI's wire form: the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if name not in self.functions:
            known = ", ".join(self.functions) or "none"
            return self._error("unknown_function", name, f"there is no function named {name!r}; the functions "
                               f"are: {known}")
        tag, schema = self.functions[name]
        problem = argument_error(schema, args)
        if problem:
            return self._error("bad_arguments", name, problem)
        return ToolCall(tag, FunctionCall(name, dict(args)), name)

    def _error(self, kind: str, name: str, text: str) -> ToolCall:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        return ToolCall("", FunctionCall(name or "?", {}), name or "?", f"Error: {text}.")

    # -------------------------------------------------------------------------- results
    def render_results(self, calls: list[ToolCall], texts: list[str], room: int, out) -> tuple[list[int], list[str]]:
        """The template's tool messages after this turn, as new ids: (ids, the texts they show).
        Each text is cut to what the budget can hold (8 characters a token) before rendering, and a
        text that spells a special token (`<|im_end|>`) is broken up so it cannot become one."""
        cap = max(1024, 8 * max(0, room))
        shown = [valid_text(t)[:cap] for t in texts]
        messages = [{"role": "tool", "name": c.name, "content": neutralise_special_text(self.tokenizer, s)}
                    for c, s in zip(calls, shown)]
        text = self._delta(messages, self.tokenizer.decode(list(out.token_ids)[-1:], skip_special_tokens=False))
        return self.tokenizer.encode(text, add_special_tokens=False), shown

    _U, _A = "\u2063U\u2063", "\u2063A\u2063"   # placeholders no template edits

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas or None, tokenize=False,
                                                  add_generation_prompt=generation, **self.kwargs)

    def _delta(self, tool_messages: list[dict], turn_end: str) -> str:
        """What the template writes after an assistant turn that ended with `turn_end` (its EOS
        text), up to and including the next generation prompt: the closing framing the model did
        not generate (Qwen: "\\n"), the tool messages, `<|im_start|>assistant\\n`. One render a
        turn: the placeholder conversation's own render is the same every turn (`self._base`)."""
        base_msgs = [{"role": "user", "content": self._U}, {"role": "assistant", "content": self._A}]
        base = self._base
        full = self._render(base_msgs + tool_messages, True)
        tail = base[base.rindex(self._A) + len(self._A):]
        if turn_end and tail.startswith(turn_end):
            tail = tail[len(turn_end):]
        return tail + full[len(base):]

    def _tool_framing_check(self) -> None:
        """Config time: the template must *append* a tool message (render the earlier turns the
        same way with and without it), or no incremental rendering is token-exact."""
        base_msgs = [{"role": "user", "content": self._U}, {"role": "assistant", "content": self._A}]
        try:
            base = self._base = self._render(base_msgs, False)
            full = self._render(base_msgs + [{"role": "tool", "name": "f", "content": "R"}], True)
        except Exception as exc:  # noqa: BLE001 - a template error is the user's config
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format=hermes: the chat template cannot render "
                             f"a tool message ({type(exc).__name__}: {exc}); use a template with tool support "
                             "(data.custom_chat_template)") from exc
        if not full.startswith(base) or "R" not in full[len(base):]:
            raise ValueError("actor_rollout_ref.rollout.multi_turn.format=hermes: the chat template re-renders the "
                             "earlier turns when a tool message follows (or drops the tool message), so no "
                             "incremental rendering is token-exact; use a template that appends tool messages")

    # -------------------------------------------------------------------------- the sanity check
    def full_render_ids(self, messages: list[dict]) -> list[int]:
        """The ids of `messages` rendered in one go (the sanity check's reference)."""
        return self.tokenizer.encode(self._render(messages, False), add_special_tokens=False)

    def metrics(self, reset: bool = True) -> dict[str, float]:
        out = {f"tools/format_errors/{k}": float(v) for k, v in self.errors.items()}
        out["tools/format_errors"] = float(sum(self.errors.values()))
        if reset:
            self.errors = {}
        return out


def build_format(name: str, tokenizer, executor, chat_template_kwargs: dict | None = None):
    """The format strategy named by `multi_turn.format`."""
    if name == "tags":
        return TagFormat(tokenizer, executor)
    if name == "hermes":
        return HermesFormat(tokenizer, executor, chat_template_kwargs)
    raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={name!r}; choose from {list(FORMATS)}")
