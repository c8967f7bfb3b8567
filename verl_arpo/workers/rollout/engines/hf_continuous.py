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
needs, so the engine's own decode step is reused here; the two paths share every tensor helper
(`_make_row`, `_prefill_rows`, `_sample_and_record`, `_select`, `_extract`), so a request yields
the same tokens in both up to the float rounding that batch composition changes (see
hf_engine.py, "Sampling and the seed guarantee").
"""

from __future__ import annotations

import torch

from verl_arpo.workers.rollout.engines.base import GenOutput, GenRequest
from verl_arpo.workers.rollout.engines.hf_requests import merge_batches, row_output


class ContinuousBatching:
    """Mixin for HFEngine: `add_requests`, `step`, `has_unfinished`."""

    # A waiting row joins at once when nothing runs or when enough rows wait (a quarter of the
    # running ones); otherwise after at most this many decode steps. Each admission is a prefill
    # forward plus a copy of the running cache, so admitting rows one by one costs more than it
    # saves when tool results trickle in.
    ADMIT_AFTER_STEPS = 4

    def _init_continuous(self) -> None:
        self._waiting: list = []        # _Rows not yet prefilled
        self._running = None            # Batch decoding now
        self._logits = None             # its rows' next-token logits
        self._finished: list = []       # rows finished before they ran (zero budget)
        self._waited = 0                # decode steps the oldest waiting row has waited

    def add_requests(self, requests) -> None:
        self._check_weights()
        if not self.reuse_kv:   # caches that cannot be stitched per row: one generate per step
            return super().add_requests(requests)
        for req in requests:
            row = self._make_row(req)
            if req.max_new_tokens <= 0:
                row.finish = "length"
                self._finished.append(row)
            else:
                self._waiting.append(row)

    def has_unfinished(self) -> bool:
        if not self.reuse_kv:
            return super().has_unfinished()
        return bool(self._waiting or self._running is not None or self._finished)

    @torch.no_grad()
    def step(self) -> list[tuple[GenRequest, GenOutput]]:
        if not self.reuse_kv:
            return super().step()
        was_training = self.model.training
        self.model.eval()
        try:
            done = self._finished
            self._finished = []
            self._admit()
            if self._running is not None:
                done += self._decode_step()
            return [(r.req, row_output(r)) for r in done]
        finally:
            self.model.train(was_training)

    def _admit(self) -> None:
        running = len(self._running.rows) if self._running is not None else 0
        room = self.max_batch_size - running
        if not self._waiting or room <= 0:
            return
        if running and 4 * len(self._waiting) < running and self._waited < self.ADMIT_AFTER_STEPS:
            self._waited += 1
            return
        self._waited = 0
        rows, self._waiting = self._waiting[:room], self._waiting[room:]
        self._share_prefix([r for r in rows if r.past is None])
        batch, logits = self._prefill_rows(rows)
        if self._running is None:
            self._running, self._logits = batch, logits
        else:
            self._running = merge_batches(self._running, batch)
            self._logits = torch.cat([self._logits, logits])

    def _decode_step(self) -> list:
        batch = self._running
        tokens = self._sample_and_record(self._logits, batch.rows)
        done = [i for i, r in enumerate(batch.rows) if r.finish is not None]
        finished = [batch.rows[i] for i in done]
        for i in done:
            r = batch.rows[i]   # its last sampled token was never fed: not in the cache
            self._keep(r.req.request_id, self._extract(batch, i, r.req.prompt_ids + r.tokens[:-1]))
        if done:
            keep = [i for i in range(len(batch.rows)) if batch.rows[i].finish is None]
            if not keep:
                self._running, self._logits = None, None
                return finished
            batch = self._select(batch, keep)
            tokens = tokens[keep]
        self._logits = self._forward(batch, tokens[:, None], torch.ones_like(tokens)[:, None],
                                     batch.next_pos[:, None])
        batch.next_pos = batch.next_pos + 1
        self._running = batch
        return finished
