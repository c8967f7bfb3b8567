"""Test helpers: an engine whose outputs and entropies the test scripts, and a scripted tool.

The engine implements the real `InferenceEngine` interface; the tool is a real `BaseTool` run by
the real `ToolExecutor`. Only the *model* is replaced, so every rule of the loop is exercised.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from verl_arpo.workers.rollout.engines.base import GenOutput, GenRequest, InferenceEngine
from verl_arpo.workers.rollout.tools.base_tool import BaseTool
from verl_arpo.workers.rollout.tools.registry import ToolExecutor


@dataclass
class Turn:
    text: str
    entropy: float = 1.0
    finish: str | None = None  # None: "stop" if text ends with a stop string, else "eos"


@dataclass
class ScriptedEngine(InferenceEngine):
    """`script(request, round_k) -> Turn`, where round_k is the trajectory's round: the number of tool
    results (`</result>`) in its context, so that a branch forked at a tool-result boundary (or after
    a whole round) continues with the round it is at."""

    tokenizer: object
    script: Callable[[GenRequest, int], Turn]
    calls: list[list[GenRequest]] = field(default_factory=list)
    rounds: dict = field(default_factory=dict)
    round_of: Callable[[str], int] | None = None   # the round from the decoded context (default: `</result>`s)

    def __post_init__(self):
        self.eos_token_ids = [self.tokenizer.eos_token_id]

    def generate(self, requests):
        self.calls.append(list(requests))
        outs = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids)
            k = self.round_of(text) if self.round_of else text.count("</result>")
            self.rounds[r.request_id] = k + 1
            turn = self.script(r, k)
            ids = self.tokenizer.encode(turn.text, add_special_tokens=False)
            finish = turn.finish or ("stop" if any(turn.text.endswith(s) for s in r.stop) else "eos")
            stop_str = next((s for s in r.stop if turn.text.endswith(s)), None) if finish == "stop" else None
            if finish == "eos":
                ids = ids + [self.tokenizer.eos_token_id]
            if len(ids) > r.max_new_tokens:
                ids, finish, stop_str = ids[: r.max_new_tokens], "length", None
            outs.append(GenOutput(token_ids=ids, finish_reason=finish, stop_str=stop_str,
                                  logprobs=[-0.5] * len(ids), topk_logprobs=[[-0.1, -2.5]] * len(ids),
                                  entropy=[turn.entropy] * len(ids)))
        return outs

    def update_weights(self, named_tensors):
        pass

    def release(self, request_ids=None):
        self.rounds.clear() if request_ids is None else None


class EchoTool(BaseTool):
    """Returns a fixed template of its input, or the text `reply(content)` gives."""

    def __init__(self, tag="python", reply=None):
        self.name = self.trigger_tag = tag
        self.argument = {"python": "code", "search": "query"}.get(tag, "input")   # its function's one argument
        self.reply = reply or (lambda c: f"ran:{c}")
        self.seen: list[str] = []

    def run(self, content):
        self.seen.append(content)
        return self.reply(content)


def make_executor(call_limit=3, **tools) -> ToolExecutor:
    tools = tools or {"python": EchoTool("python"), "search": EchoTool("search")}
    return ToolExecutor(tools, max_workers=4, timeout=10, retry_count=0, call_limit=call_limit)
