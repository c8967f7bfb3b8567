"""The agent protocol's text layer for cold-start SFT: system prompt, `conversations` records, and
tokenisation with a loss mask on assistant-generated tokens only.

Protocol (the bundled task's system prompt, `SYSTEM_PROMPT`; the tags are the reference's): the
assistant reasons in `<think> … </think>`, calls Python with `<python> … </python>` and search
with `<search> … </search>`; the rollout appends the tool output as ` <result>\\n…\\n</result>`
inside the same assistant turn; the final answer is `<answer> \\boxed{…} </answer>`.

Records: one JSON object per line with `conversations` = [{"from", "value"}] (the seeds' format;
`from` is user/human, assistant/gpt, system, tool/observation/function) or `messages` =
[{"role", "content"}], plus an optional top-level `system` string. Two ways of writing tool results
are understood, and both end up with loss mask 0:
- inline (ours, what the RL rollout produces): ` <result>\\n…\\n</result>` inside an assistant turn;
- as separate turns (the seeds' example): a `user`/`tool` turn holding `<result>…</result>` between
  two assistant turns.

Tokenisation (`tokenize_conversation`): the chat template is rendered once per assistant turn,
as prefix = template(messages[:i], add_generation_prompt=True) and full = template(messages[:i+1]);
full[len(prefix):] is the assistant span. Its pieces are tokenised *separately*, in order: the
template text (mask 0), the assistant's own text (mask 1), every inline `<result>` block (mask 0,
encoded like the rollout encodes tool output: no special-token ids), and the end-of-turn marker up
to and including the EOS token (mask 1; whatever the template writes after EOS, e.g. "\\n", is 0).
Tokenising piece by piece makes the token boundaries at a tool call the ones the rollout sees
(generation stops at `</python>`, the result is encoded on its own, generation resumes).

Function calling (the hermes format, docs/tools.md): an assistant message may carry `tool_calls`
([{"function": {"name", "arguments"}}] or [{"name", "arguments"}]) and `role: tool` messages hold the
results; a record's top-level `tools` (function schemas) is rendered into the prompt. The template
renders the calls; the assistant span up to its EOS is trained (mask 1) and the tool messages, part
of the next turn's prefix, are not (mask 0): what the hermes rollout trains.

Not covered: chat templates that rewrite earlier turns when a later one is added (e.g. templates
that drop past `<think>` blocks); such a conversation raises ValueError naming the turn.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from verl_arpo.utils.chat_template import render_chat

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves problems with two tools. To run Python, write code "
    "between <python> and </python> and print the values you need. To search the knowledge base, "
    "write a short query between <search> and </search>. Each tool output comes back between "
    "<result> and </result>. Think briefly inside <think> </think> before you act. Give the final "
    "answer inside <answer> </answer> as \\boxed{...}, for example <answer> \\boxed{42} </answer>."
)
"""The bundled task's system prompt (our wording of the reference's tag protocol)."""

ROLE_ALIASES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
}
RESULT_BLOCK = re.compile(r" ?<result>.*?</result>", re.S)
"""An inline tool result, with the single space the rollout writes before it."""


def to_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    """One record (`conversations` or `messages`, optional `system`) → [{role, content}] (assistant
    `tool_calls` and a tool message's `name` kept: the hermes format's conversations)."""
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, (list, tuple)) or not turns:
        raise ValueError("record has no non-empty 'conversations' or 'messages' list")
    out: list[dict[str, str]] = []
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        out.append({"role": "system", "content": system})
    for j, turn in enumerate(turns):
        role = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
        content = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
        calls = turn.get("tool_calls") if isinstance(turn, dict) else None
        if content is None and calls:
            content = ""   # a turn of function calls only
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES or not isinstance(content, str):
            raise ValueError(f"turn {j}: expected {{from/role, value/content}} with a known role, got {turn!r:.120}")
        role = ROLE_ALIASES[role.lower()]
        if role == "system" and out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": content}
            continue
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance((c.get("function") or c).get("name"), str) for c in calls):
                raise ValueError(f"turn {j}: tool_calls belong to an assistant turn, as a list of "
                                 f"{{function: {{name, arguments}}}}; got {calls!r:.120}")
            msg["tool_calls"] = [c if "function" in c else {"type": "function", "function": c} for c in calls]
        if role == "tool" and isinstance(turn.get("name"), str):
            msg["name"] = turn["name"]
        out.append(msg)
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("conversation has no assistant turn (nothing to train on)")
    return out


def record_tools(record: dict[str, Any]) -> list[dict] | None:
    """A record's function schemas (`tools`: a list, or its JSON text as some datasets store it)."""
    tools = record.get("tools")
    if isinstance(tools, str) and tools.strip():
        tools = json.loads(tools)
    if tools and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"record 'tools' must be a list of function schemas, got {tools!r:.120}")
    return tools or None


def read_records(paths: str | Path | Iterable[str | Path]) -> list[dict[str, Any]]:
    """Records from .jsonl (one per line), .json (a list) or .parquet files, in order."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    records: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            records += pq.read_table(path).to_pylist()
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            records += data if isinstance(data, list) else [data]
        else:
            with open(path, encoding="utf-8") as f:
                records += [json.loads(line) for line in f if line.strip()]
    return records


def split_assistant(content: str) -> list[tuple[str, int]]:
    """An assistant turn's text as (piece, trainable) pieces: inline `<result>` blocks are 0."""
    pieces, pos = [], 0
    for m in RESULT_BLOCK.finditer(content):
        if m.start() > pos:
            pieces.append((content[pos:m.start()], 1))
        pieces.append((m.group(0), 0))
        pos = m.end()
    if pos < len(content):
        pieces.append((content[pos:], 1))
    return pieces


def _render(tokenizer, messages: list[dict[str, str]], generation_prompt: bool, template_kwargs=None) -> str:
    return render_chat(tokenizer, messages, generation_prompt, template_kwargs)


def _encode(tokenizer, text: str, tool_output: bool = False) -> list[int]:
    if not text:
        return []
    if tool_output:  # like the rollout: tool text never becomes a special-token id
        from verl_arpo.workers.rollout.tool_text import RESULT_TEMPLATE, encode_tool_result

        inner = text[len(" <result>\n"):-len("\n</result>")]
        if RESULT_TEMPLATE.format(text=inner) == text:
            return encode_tool_result(tokenizer, inner)
        special = set(tokenizer.all_special_ids)
        return [i for i in tokenizer.encode(text, add_special_tokens=False) if i not in special]
    return list(tokenizer.encode(text, add_special_tokens=False))


def conversation_pieces(tokenizer, messages: list[dict[str, str]],
                        template_kwargs: dict | None = None) -> list[tuple[str, int, bool]]:
    """(text, trainable, is_tool_output) pieces covering the rendered conversation up to its
    last assistant turn (trailing non-assistant turns carry no loss and are dropped)."""
    eos = tokenizer.eos_token or ""
    pieces: list[tuple[str, int, bool]] = []
    done = ""  # rendered text covered so far
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i] if i else [], True, template_kwargs)
        full = _render(tokenizer, messages[:i + 1], False, template_kwargs)
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise ValueError(f"turn {i}: the chat template does not render the conversation as a growing "
                             "prefix; cannot place the loss mask")
        pieces.append((prefix[len(done):], 0, False))
        span, content = full[len(prefix):], msg["content"]
        k = span.find(content) if content else -1
        if k < 0:  # function calls only, or the template changed the text: train on the span up to its EOS
            j = span.find(eos) if eos else -1
            cut = j + len(eos) if j >= 0 else len(span)
            pieces += [(span[:cut], 1, False), (span[cut:], 0, False)]
        else:
            pieces.append((span[:k], 1, False))
            pieces += [(text, m, m == 0) for text, m in split_assistant(content)]
            tail = span[k + len(content):]
            j = tail.find(eos) if eos else -1
            cut = j + len(eos) if j >= 0 else len(tail)
            pieces += [(tail[:cut], 1, False), (tail[cut:], 0, False)]
        done = full
    return [p for p in pieces if p[0]]


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_length: int | None = None,
                          truncation: str = "error", template_kwargs: dict | None = None,
                          tools: list[dict] | None = None) -> dict[str, list[int]] | None:
    """{"input_ids", "loss_mask"} (loss_mask[t] = 1: token t is a training target). `tools`: the
    record's function schemas, rendered into the prompt by the template.

    truncation when longer than max_length: "error" raises, "right" keeps the first max_length
    tokens, "skip" returns None."""
    ids: list[int] = []
    mask: list[int] = []
    if tools:
        template_kwargs = {**dict(template_kwargs or {}), "tools": tools}
    for text, trainable, tool in conversation_pieces(tokenizer, messages, template_kwargs):
        piece = _encode(tokenizer, text, tool_output=tool)
        ids += piece
        mask += [trainable] * len(piece)
    if max_length is not None and len(ids) > max_length:
        if truncation == "right":
            ids, mask = ids[:max_length], mask[:max_length]
        elif truncation == "skip":
            return None
        else:
            raise ValueError(f"conversation has {len(ids)} tokens > data.max_length={max_length}; "
                             "set data.truncation=right|skip or raise data.max_length")
    return {"input_ids": ids, "loss_mask": mask}


def make_record(question: str, trajectory: str, system: str = SYSTEM_PROMPT, **extra: Any) -> dict[str, Any]:
    """A `conversations` record: system prompt, the user's question, one assistant turn."""
    return {"system": system,
            "conversations": [{"from": "user", "value": question}, {"from": "assistant", "value": trajectory}],
            **extra}
