"""Continuous batching for the HF engine: admit and retire sequences between decode steps.

The asynchronous rollout (docs/algorithms.md, "Asynchronous rollout") hands the engine a request
whenever a trajectory is ready to generate (a tool result came back, a branch was made) and wants
each request back as soon as it finishes, while the others keep decoding. `step()` does one
decode step for everything running:

1. admit: queued requests (up to `max_batch_size` rows in all; `ADMIT_AFTER_STEPS` says when)
   are prefilled on their own (from their cached KV when they continue a trajectory or branch
   from one, exactly as in `generate`) and merged into the running batch: both caches are
   left-padded to a common length and stacked (padding in the middle of a row is masked, RoPE
   positions are per row, as in `generate`);
2. sample one token per running row from the logits of the previous forward;
3. retire: finished rows have their KV stored under their request id (the next round of that
   trajectory, or a branch of it, prefills only its new tokens) and are returned;
4. forward the sampled tokens of the rows still running.

transformers ships a continuous-batching generator (`generate_batch` over a paged cache), but it
keeps no per-request KV between calls and reports none of the per-token statistics the branch rule
needs, so the engine's own decode step is reused here. The scheduler owns only the queue (what
waits, what runs); every tensor operation is one of the engine's decode-step operations
(`new_row`, `encode_shared_prefix`, `prefill`, `sample`, `store_finished`, `select`, `advance`),
the same ones `HFEngine.generate` runs, so a request yields the same tokens in both up to the float
rounding that batch composition changes (see hf_engine.py, "Sampling and the seed guarantee").
"""

from __future__ import annotations

import torch

from verl_arpo.workers.rollout.engines.base import GenOutput, GenRequest
from verl_arpo.workers.rollout.engines.hf_requests import merge_batches, row_output


class ContinuousScheduler:
    """The HF engine's continuous batching: `add`, `step`, `has_unfinished` over one engine."""

    # A waiting row joins at once when nothing runs or when enough rows wait (a quarter of the
    # running ones); otherwise after at most this many decode steps. Each admission is a prefill
    # forward plus a copy of the running cache, so admitting rows one by one costs more than it
    # saves when tool results trickle in.
    ADMIT_AFTER_STEPS = 4

    def __init__(self, engine) -> None:
        self.engine = engine            # an HFEngine that keeps KV across calls (reuse_kv)
        self.waiting: list = []         # Rows not yet prefilled
        self.running = None             # the Batch decoding now
        self.logits = None              # its rows' next-token logits
        self.finished: list = []        # rows finished before they ran (zero budget)
        self.waited = 0                 # decode steps the oldest waiting row has waited

    def add(self, requests) -> None:
        for req in requests:
            row = self.engine.new_row(req)
            if req.max_new_tokens <= 0:
                row.finish = "length"
                self.finished.append(row)
            else:
                self.waiting.append(row)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running is not None or self.finished)

    def step(self) -> list[tuple[GenRequest, GenOutput]]:
        """One decode step for every running row (after admitting waiting ones); the requests that
        finished, with their outputs. The caller holds the model in eval mode, without grad."""
        done, self.finished = self.finished, []
        self._admit()
        if self.running is not None:
            done += self._decode_step()
        return [(r.req, row_output(r)) for r in done]

    def _admit(self) -> None:
        running = len(self.running.rows) if self.running is not None else 0
        room = self.engine.max_batch_size - running
        if not self.waiting or room <= 0:
            return
        if running and 4 * len(self.waiting) < running and self.waited < self.ADMIT_AFTER_STEPS:
            self.waited += 1
            return
        self.waited = 0
        rows, self.waiting = self.waiting[:room], self.waiting[room:]
        self.engine.encode_shared_prefix([r for r in rows if r.past is None])
        batch, logits = self.engine.prefill(rows)
        if self.running is None:
            self.running, self.logits = batch, logits
        else:
            self.running = merge_batches(self.running, batch)
            self.logits = torch.cat([self.logits, logits])

    def _decode_step(self) -> list:
        engine, batch = self.engine, self.running
        tokens = engine.sample(self.logits, batch.rows)
        done = [i for i, r in enumerate(batch.rows) if r.finish is not None]
        finished = [batch.rows[i] for i in done]
        for i in done:
            engine.store_finished(batch, i)
        if done:
            keep = [i for i in range(len(batch.rows)) if batch.rows[i].finish is None]
            if not keep:
                self.running, self.logits = None, None
                return finished
            batch = engine.select(batch, keep)
            tokens = tokens[keep]
        self.logits = engine.advance(batch, tokens)
        self.running = batch
        return finished
