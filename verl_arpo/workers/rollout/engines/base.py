"""The inference-engine interface: everything the multi-turn rollout loop needs from a generator.

The rollout loop (agent_loop.py / branching.py) talks to an engine only through this module:
it sends `GenRequest`s (one per active trajectory, each with its whole context so far) and
gets back `GenOutput`s in the same order. Engines are interchangeable: `HFEngine` (our own
batched decode loop on a transformers model, the CPU default) and `VLLMEngine` (vLLM, GPU or
the CPU build).

Distribution convention (all engines)
-------------------------------------
`logprobs`, `topk_logprobs` and `entropy` describe the distribution the token was drawn from
*before* top-k / top-p truncation:

    p = softmax(logits / T)        (T = 1 when greedy)

so a token sampled with temperature 0.7 reports log softmax(logits / 0.7)[token], and the
entropy is the exact full-vocabulary entropy of that same p. Truncation only decides which tokens
may be drawn; it does not renormalise the reported numbers. (This is what the policy-gradient
ratio needs when the trainer recomputes log-probs at the same temperature without truncation.)

Stop strings
------------
Generation of a sequence stops at EOS, at the first stop string that appears in the decoded text
of the tokens generated *in this call*, or at its own `max_new_tokens`. On a stop string the
output ends right after the token that completes it (a stop string may straddle several tokens,
and that last token may carry text past the stop string); the stop string's tokens are included.
On EOS the EOS token is included in `token_ids` with its log-prob.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence

from verl_arpo.config.rollout import ROLLOUT_NAMES

FINISH_REASONS = ("eos", "stop", "length")
ENGINE_NAMES = ROLLOUT_NAMES   # the config's Literal: one list of accepted names


@dataclass
class SamplingParams:
    """How to pick the next token, and what to report about the distribution."""

    temperature: float = 1.0
    """softmax temperature T; T <= 0 is treated as greedy."""
    top_p: float = 1.0
    """nucleus sampling: draw only from the smallest set of tokens whose mass reaches top_p."""
    top_k: int = -1
    """draw only from the k most likely tokens (-1 or 0 = no limit)."""
    greedy: bool = False
    """argmax decoding; reported log-probs are then those of softmax(logits) (T = 1)."""
    logprobs: bool = True
    """return the sampled token's log-prob at every position (`rollout.calculate_log_probs`); False
    lets an engine skip that work, and `GenOutput.logprobs` may then be shorter than the tokens."""
    logprobs_topk: int = 10
    """how many top log-probs per generated position to return (0 = none)."""
    full_entropy: bool = True
    """also return the exact full-vocabulary entropy per position when the engine can."""
    stats_window: int | None = None
    """top-k log-probs and entropies are needed for the first `stats_window` generated positions of
    the call only (the branch rule reads `rollout.entropy_window` of them): past it, topk lists are
    empty and the entropy list ends, and engines skip the work (None = every position)."""

    @property
    def is_greedy(self) -> bool:
        """Greedy either explicitly or through a non-positive temperature."""
        return self.greedy or self.temperature <= 0


@dataclass
class GenRequest:
    """One trajectory's next generation round."""

    request_id: str
    """the trajectory id; engines key their cached state (KV) by it."""
    prompt_ids: list[int]
    """the whole context so far: prompt + response so far, tool results included."""
    max_new_tokens: int
    """this sequence's own budget for this call."""
    stop: list[str] = field(default_factory=list)
    """stop strings, e.g. ["</python>", "</search>"]; the output includes the stop string tokens."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    parent_id: str | None = None
    """a branch: the engine may start from the parent's cached KV (after checking the prefix)."""
    seed: int | None = None
    """per-request sampling seed, for reproducible trees (see each engine for the guarantee)."""


@dataclass
class GenOutput:
    """What one request produced in one call."""

    token_ids: list[int]
    finish_reason: str
    """"eos" | "stop" | "length"."""
    stop_str: str | None
    """the stop string that ended generation (finish_reason == "stop"), else None."""
    logprobs: list[float]
    """log-prob of each generated token under the sampled-from distribution (see module doc)."""
    topk_logprobs: list[list[float]]
    """per position, the top-k log-prob values, descending, followed by the sampled token's when it
    is not among the top k (`topk_with_sampled`); empty lists when k = 0 and past `stats_window`."""
    entropy: list[float] | None
    """exact full-vocabulary entropy per position up to `stats_window`, or None if the engine cannot
    provide it."""


def topk_with_sampled(top_ids: Sequence[int], top_values: Sequence[float], token: int, token_logprob: float,
                      k: int) -> list[float]:
    """One position's `topk_logprobs` row: the first k of (top_ids, top_values) (descending), then
    `token_logprob` when `token` is not among those k ids.

    This is the set the reference's top-k entropy proxy summed over (vLLM returns the sampled
    token's log-prob next to the top k), so every engine reports it the same way and
    branching.topk_proxy_entropy gives the same number for the same logits on any engine.
    """
    if k <= 0:
        return []
    ids, values = list(top_ids[:k]), [float(v) for v in top_values[:k]]
    return values if token in ids else values + [float(token_logprob)]


class InferenceEngine(ABC):
    """A generator the rollout loop can drive round by round.

    Attributes every engine sets: `tokenizer` (a HF tokenizer) and `eos_token_ids` (the ids that
    end a sequence with finish_reason "eos").
    """

    tokenizer: Any
    eos_token_ids: list[int]

    @abstractmethod
    def generate(self, requests: list[GenRequest]) -> list[GenOutput]:
        """Generate one round for every request; outputs are in the same order."""

    def release(self, request_ids: Iterable[str] | None = None) -> None:
        """Forget cached state of these requests (None = all). Engines without state ignore it."""

    # -- requests at any time (rollout.mode=async_with_tool, docs/algorithms.md "Asynchronous rollout")
    def add_requests(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests; they start at the next `step`. Engines with continuous batching admit
        them between decode steps; this default runs every queued request in one `generate` call
        at the next `step` (correct, only without overlap)."""
        self.__dict__.setdefault("_queued", []).extend(requests)

    def step(self) -> list[tuple[GenRequest, GenOutput]]:
        """Advance generation; return the requests that finished, with their outputs."""
        queued, self.__dict__["_queued"] = self.__dict__.get("_queued", []), []
        return list(zip(queued, self.generate(queued))) if queued else []

    def has_unfinished(self) -> bool:
        """Whether a request is queued or still generating."""
        return bool(self.__dict__.get("_queued"))

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights given as (HF parameter name, tensor) pairs; cached KV becomes stale and
        is dropped. The pairs are consumed one at a time and not kept (docs/gpu.md, "Weight sync"):
        a caller streaming a generator holds at most one full parameter at once. A sleeping
        engine wakes its weights for the sync, not its KV cache."""

    def check_weight_names(self, names: Iterable[str]) -> None:
        """Raise (naming the bad names) before a sync whose names this engine does not know, so a
        wrong sync copies nothing. Engines without a fixed name set accept any."""

    def sleep(self) -> None:
        """Free what memory can be freed while the trainer runs (optional)."""

    def wake(self) -> None:
        """Undo `sleep` before the next `generate` (optional)."""

    def discard_weights(self) -> bool:
        """Free the weights until the next `update_weights` refills them all (vLLM's sleep level 2):
        the hybrid engine's update overwrites them anyway (docs/gpu.md, "Host memory"). Returns
        whether they were freed; engines that cannot (the default) keep them and return False."""
        return False

    @property
    def weights_discarded(self) -> bool:
        """True between `discard_weights` and the `update_weights` that refills them."""
        return False


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (a continuing trajectory): one C-speed comparison
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
