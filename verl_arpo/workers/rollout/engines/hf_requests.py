"""What the HF engine keeps of a request while it generates (workers/rollout/engines/hf_engine.py):
its cached keys and values (`KV`), its row in a decode batch (`Row`, `Batch`), the stop strings it
watches (`StopChecker`), and what it returns (`row_output`). Shared by the engine's batched
`generate` and its continuous batching (hf_continuous.py), so neither imports the other's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verl_arpo.workers.rollout.engines.base import GenOutput, GenRequest, SamplingParams


@dataclass
class KV:
    """Cached state of one sequence: the tokens seen, and per layer their keys/values
    `[kv_heads, len(tokens), head_dim]` (never modified in place: branches share them)."""

    tokens: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def cut(self, n: int) -> "KV":
        """The first n tokens (views, no copy)."""
        return KV(self.tokens[:n], [k[:, :n] for k in self.keys], [v[:, :n] for v in self.values])


@dataclass
class Row:
    """One request while it is being generated."""

    req: GenRequest
    past: KV | None          # reused cache (already validated and cut)
    suffix: list[int]         # prompt tokens still to prefill
    rng: torch.Generator
    stop: "StopChecker"
    kv: KV | None = None     # after a separate prefill, before decode batching
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[list[float]] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    finish: str | None = None
    stop_str: str | None = None

    @property
    def sp(self) -> SamplingParams:
        return self.req.sampling


@dataclass
class Batch:
    """Rows decoding together: a DynamicCache, its 2-D padding mask (same length) and the
    position the next fed token will have in each row."""

    rows: list[Row]
    cache: object
    mask: torch.Tensor        # [B, T] long, 1 = real token
    next_pos: torch.Tensor    # [B] long


class StopChecker:
    """Finds stop strings in the decoded text of the newly generated tokens.

    Called after every token, so a hit is always completed by the latest token. Only a window of
    the last tokens is decoded: a stop string of b bytes spans at most b byte-level tokens, and
    the extra tokens in front absorb a possibly cut multi-byte character."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 2

    def check(self, tokens: list[int]) -> str | None:
        if not self.stops:
            return None
        text = self.tokenizer.decode(tokens[-self.window:], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        hits = [(text.find(s), s) for s in self.stops if s in text]
        return min(hits)[1] if hits else None


def row_output(r: Row) -> GenOutput:
    return GenOutput(token_ids=r.tokens, finish_reason=r.finish, stop_str=r.stop_str, logprobs=r.logprobs,
                     topk_logprobs=r.topk, entropy=r.entropy if r.sp.full_entropy else None)


def merge_batches(a, b):
    """One batch from two: each cache left-padded to the longer one, rows stacked (a first), with
    the larger of their decode rooms (kv_room.py)."""
    from verl_arpo.workers.rollout.engines.kv_room import PreallocatedLayer, preallocated_cache

    Ta, Tb = a.mask.shape[1], b.mask.shape[1]
    T, Ba, Bb = max(Ta, Tb), a.mask.shape[0], b.mask.shape[0]
    layers = []
    for la, lb in zip(a.cache.layers, b.cache.layers):
        room = max(getattr(la, "room", 0), getattr(lb, "room", 0))
        layers.append(PreallocatedLayer(room).fill([(la.keys, la.values), (lb.keys, lb.values)],
                                                   T, room, la.keys.device))
    mask = a.mask.new_zeros((Ba + Bb, T))
    mask[:Ba, T - Ta:] = a.mask
    mask[Ba:, T - Tb:] = b.mask
    return Batch(a.rows + b.rows, preallocated_cache(layers), mask, torch.cat([a.next_pos, b.next_pos]))
