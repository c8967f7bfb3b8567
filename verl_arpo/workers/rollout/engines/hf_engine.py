"""HFEngine: our own batched decode loop on a transformers causal LM, with a KV cache kept
across rounds. The default engine on CPU.

Why not `model.generate`: the rollout needs per-sequence budgets, stop strings checked on the new
text, exact per-position entropy, per-request seeds and, above all, a KV cache that survives
between tool rounds. One ARPO trajectory is generate -> tool result -> generate -> ...; with the
cache kept, round k only prefills the few tool-result tokens instead of the whole context.

How a call runs
---------------
1. Lookup: for each request take the cached entry of `request_id` (or, for a new branch, of
   `parent_id`), check that the new `prompt_ids` start with the cached tokens and cut the entry to
   the common prefix (a mismatch therefore degrades to partial or full re-encoding, never to a
   wrong answer). The rest of the prompt is the *suffix* to prefill. Fresh requests (no cached
   entry) that start with the same tokens, such as a system prompt, get that shared prefix
   encoded once and used as their cached past.
2. Prefill: requests are grouped by suffix length (so a fresh 500-token prompt does not pad
   thirty 30-token tool results); each group's cached keys/values are left-padded to a common
   length, the suffixes are left-padded after them, and one forward runs with an explicit
   attention mask (1 = real token) and explicit position ids (= number of real tokens before).
   Padding in the middle of a row is fine: it is masked, and RoPE keys keep their own positions.
3. Decode: one token per step for the whole batch, written into room the batch's cache set aside
   for what its rows may still generate (kv_room.py: no per-step copy of the cache); a finished
   sequence's keys/values are copied out (real positions only) into the per-request store and the
   row leaves the batch.

Cached entries are never modified in place, so a branch shares its parent's tensors (views cut to
the common prefix) without copying: copy-on-write for free. Entries live in CPU memory until
`release()`; `update_weights()` and `sleep()` drop them all.

Sampling and the seed guarantee
-------------------------------
Log-probs, top-k log-probs and entropy follow the convention of `base.py` (softmax(logits / T)
before truncation; float32 `log_softmax` even for bf16 models). A sampled token is drawn by
inverse CDF with one uniform number per generated token. With `seed` set, that number comes
from the request's own `torch.Generator` re-seeded at every `generate` call, so a request gets
the same tokens whatever else is in the batch, *provided the logits are the same*: batch
composition changes padding and therefore float rounding (~1e-6 in fp32, ~1e-2 in bf16), which
flips a draw only when the uniform falls that close to a CDF boundary. Callers that want fresh
randomness per round pass a different seed per round. Requests without a seed share the engine's
generator (seeded at construction), so their draws depend on the batch order.

`generate` runs groups of `max_batch_size` one after another; `add_requests`/`step` admit and
retire requests between decode steps instead (continuous batching: the scheduler object of
hf_continuous.py, over the same decode-step operations). What this
does not do: paged attention, speculative decoding. Models whose cache is not a plain full-attention
`DynamicCache` (sliding-window, linear-attention or hybrid layers) re-encode the full context
every round (logged once); everything else still works for them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterable

import torch

from verl_arpo.utils.device import without_cudnn_attention
from verl_arpo.workers.rollout.engines.base import (
    GenOutput,
    GenRequest,
    InferenceEngine,
    topk_with_sampled,
    common_prefix_len,
)
from verl_arpo.workers.rollout.engines import fused_projections
from verl_arpo.workers.rollout.engines.hf_continuous import ContinuousScheduler
from verl_arpo.workers.rollout.engines.hf_requests import KV, Batch, Row, StopChecker, row_output
from verl_arpo.workers.rollout.engines.hf_weights import EngineWeights
from verl_arpo.workers.rollout.engines.kv_room import (
    ROOM,
    PreallocatedLayer,
    preallocated_cache,
    select_cache_rows,
)

logger = logging.getLogger(__name__)

# Fresh prompts share their first tokens when at least this many (shorter: not worth a forward).
_MIN_SHARED_PREFIX = 16

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class HFEngine(EngineWeights, InferenceEngine):
    """Batched generation on a transformers causal LM with a per-trajectory persistent KV cache.

    Args:
        model_or_path: a HF model folder, or an already loaded `PreTrainedModel` (used as is: no
            copy, no cast; `dtype` and `attn_implementation` then do not apply).
        tokenizer: a HF tokenizer (loaded from the folder when None).
        dtype: "float32" or "bfloat16" (bf16 is ~2x faster on CPUs with AMX).
        device: torch device; default cuda when available, else cpu.
        attn_implementation: None = on CPU our grouped decode attention (`decode_attention.py`:
            sdpa for prefill, grouped matmuls for one-token steps), elsewhere "sdpa";
            "flash_attention_2" only if flash_attn is installed
            (otherwise sdpa, with a warning); "eager" works too.
        max_batch_size: rows decoded together; larger requests lists run in groups.
        kv_cache: keep each trajectory's KV between calls (False = re-encode every round).
        max_prefill_tokens: cap on padded tokens per prefill forward (memory bound).
        max_cached_tokens: cap on tokens kept in the KV store; the least recently stored
            trajectories are evicted first (None = no cap; the rollout loop calls `release`).
        seed: seed of the generator used by requests without their own seed.
        kv_room: spare positions the decode cache sets aside per allocation (kv_room.py); 0
            concatenates at every step as transformers' `DynamicLayer` does (for comparisons).
        share_prefix: encode the prefix that the fresh prompts of one call share once.
        fuse_projections: decode steps compute each layer's q/k/v and gate/up projections as one
            matmul each (fused_projections.py); None = on when the engine owns bf16 weights on a CPU.

    A module shared with the trainer (no copy) changes under the engine at every optimizer step:
    call `release()` after each step (there is then no need for `update_weights`).
    """

    def __init__(self, model_or_path, tokenizer=None, dtype: str = "float32", device=None,
                 attn_implementation: str | None = None, max_batch_size: int = 64,
                 kv_cache: bool = True, max_prefill_tokens: int = 16384,
                 max_cached_tokens: int | None = None, seed: int = 0, share_prefix: bool = True,
                 kv_room: int = ROOM, fuse_projections: bool | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # a module handed in may be the trainer's own: never discard its weights
        self._owns_weights = not isinstance(model_or_path, torch.nn.Module)
        if not self._owns_weights:
            self.model = model_or_path
        else:
            if dtype not in _DTYPES:
                raise ValueError(f"HFEngine dtype={dtype!r}; choose one of {sorted(_DTYPES)}")
            # on an accelerator the weights load straight onto it: no full host copy per rank
            on_device = {"device_map": {"": self.device}} if self.device.type != "cpu" else {}
            self.model = AutoModelForCausalLM.from_pretrained(
                str(model_or_path), dtype=_DTYPES[dtype],
                attn_implementation=_pick_attn(attn_implementation, self.device), **on_device).to(self.device)
        self.model.eval()
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
            str(model_or_path))
        self.pad_id = _pad_id(self.tokenizer, self.model)
        # ids the tokenizer knows; a padded vocabulary has more logit rows (Qwen2.5: 152064 for
        # 151665 ids), which are masked so that no padding id is ever sampled
        self.n_token_ids = len(self.tokenizer)
        self.eos_token_ids = _eos_ids(self.tokenizer, self.model)
        self.max_batch_size = max(1, int(max_batch_size))
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.max_cached_tokens = max_cached_tokens
        self._rng = torch.Generator().manual_seed(seed)
        self._store: dict[str, KV] = {}   # insertion order = recency (for eviction)
        self._n_cached = 0
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._cache_arg = kv_cache_arg(self.model)
        self._asleep = False
        self._discarded: dict[torch.nn.Parameter, torch.Size] = {}   # freed by discard_weights
        self.reuse_kv = bool(kv_cache)
        self.kv_room = max(0, int(kv_room))
        self.share_prefix = bool(share_prefix)
        if fuse_projections is None:   # measured faster in bf16 on a CPU, not in fp32 (docs/performance.md)
            fuse_projections = (self._owns_weights and self.device.type == "cpu"
                                and next(self.model.parameters()).dtype == torch.bfloat16)
        if fuse_projections and not self._owns_weights:
            raise ValueError("HFEngine fuse_projections=True needs weights of its own: a module shared with the "
                             "trainer changes under the engine without update_weights")
        self.fused_groups = fused_projections.fuse(self.model) if fuse_projections else 0
        if kv_cache and (why := _why_no_kv_reuse(self.model)):
            logger.warning("HFEngine: %s; the KV cache is not kept across rounds (every round "
                           "re-encodes the full context)", why)
            self.reuse_kv = False
        # add_requests / step between decode steps (hf_continuous.py); without kept KV, base.py's
        # default (one generate per step) applies
        self.scheduler = ContinuousScheduler(self) if self.reuse_kv else None
        self.reset_stats()

    # ------------------------------------------------------------------ public API

    def reset_stats(self) -> None:
        """Counters for benchmarks/tests: tokens prefilled vs reused from the cache, etc."""
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "generated_tokens": 0,
                      "forward_calls": 0, "prefill_calls": 0, "prefix_mismatches": 0,
                      "shared_prefix_tokens": 0}

    def cached_tokens(self) -> int:
        """Tokens currently held in the per-request KV store (branches sharing storage count twice)."""
        return self._n_cached

    def release(self, request_ids: Iterable[str] | None = None) -> None:
        if request_ids is None:
            self._store.clear()
        else:
            for rid in request_ids:
                self._store.pop(rid, None)
        self._n_cached = sum(len(kv.tokens) for kv in self._store.values())

    @torch.no_grad()
    def generate(self, requests: list[GenRequest]) -> list[GenOutput]:
        self._check_weights()
        with self._eval_mode():
            return self._generate(requests)

    def add_requests(self, requests) -> None:
        self._check_weights()
        if self.scheduler is None:   # caches that cannot be stitched per row: one generate per step
            return super().add_requests(requests)
        self.scheduler.add(requests)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() if self.scheduler is None else self.scheduler.has_unfinished()

    @torch.no_grad()
    def step(self) -> list[tuple[GenRequest, GenOutput]]:
        if self.scheduler is None:
            return super().step()
        with self._eval_mode():
            return self.scheduler.step()

    @contextlib.contextmanager
    def _eval_mode(self):
        was_training = self.model.training   # a module shared with the trainer may be in train()
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)

    def _generate(self, requests: list[GenRequest]) -> list[GenOutput]:
        # Look everything up before anything is stored, so a parent continuing in this same call
        # cannot change what its branch starts from.
        rows = [self.new_row(r) for r in requests]
        live = [r for r in rows if r.req.max_new_tokens > 0]
        self.encode_shared_prefix([r for r in live if r.past is None])
        for r in rows:
            if r.req.max_new_tokens <= 0:
                r.finish = "length"
        # Similar context lengths decode together (less padding in the attention).
        live.sort(key=lambda r: len(r.req.prompt_ids))
        for i in range(0, len(live), self.max_batch_size):
            self._run_group(live[i:i + self.max_batch_size])
        return [row_output(r) for r in rows]

    # ------------------------------------------------------------------ decode-step operations
    # What a decode loop does, as operations: `_run_group` below and the continuous-batching
    # scheduler (hf_continuous.py) are two loops over the same ones.

    def new_row(self, req: GenRequest) -> Row:
        """A row for `req`, starting from the longest cached KV its own id or its parent's offers."""
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r} has empty prompt_ids")
        past, n = None, 0
        if self.reuse_kv:
            for key in (req.request_id, req.parent_id):
                entry = self._store.get(key) if key is not None else None
                if entry is None:
                    continue
                # Keep at least one prompt token to feed: the next token's logits come from it.
                m = min(common_prefix_len(entry.tokens, req.prompt_ids), len(req.prompt_ids) - 1)
                if m < len(entry.tokens) and m < len(req.prompt_ids) - 1:
                    self.stats["prefix_mismatches"] += 1
                if m > n:
                    past, n = entry, m
        if past is not None:
            past = past if n == len(past.tokens) else past.cut(n)
        rng = self._rng if req.seed is None else torch.Generator().manual_seed(int(req.seed))
        self.stats["reused_tokens"] += n
        return Row(req, past, list(req.prompt_ids[n:]), rng, StopChecker(self.tokenizer, req.stop))

    def encode_shared_prefix(self, fresh: list[Row]) -> None:
        """Encode the prefix that all fresh rows share (the system prompt and chat template,
        ~118 of ~140 tokens in the quickstart's prompts) once, and give it to each of them as
        its cached past: their prefill then covers only their own suffixes. Rows with a cached
        entry of their own (continuing trajectories, branches) already skip their prefix."""
        if not (self.reuse_kv and self.share_prefix) or len(fresh) < 2:
            return
        first = fresh[0].suffix
        n = min(min(common_prefix_len(first, r.suffix), len(r.suffix) - 1) for r in fresh[1:])
        n = min(n, len(first) - 1)
        if n < _MIN_SHARED_PREFIX:
            return
        head = Row(fresh[0].req, None, first[:n], fresh[0].rng, fresh[0].stop)
        batch, _ = self._prefill([head])
        shared = self._extract(batch, 0, first[:n])
        self.stats["shared_prefix_tokens"] += n * (len(fresh) - 1)
        for r in fresh:
            r.past, r.suffix = shared, r.suffix[n:]

    def prefill(self, rows: list[Row]) -> tuple[Batch, torch.Tensor]:
        """Prefill `rows` into one decoding batch; returns it with each row's next-token logits."""
        chunks = self._prefill_chunks(rows)
        if len(chunks) == 1:
            return self._prefill(chunks[0])
        # Prefill each chunk on its own, copy the rows' KV out, re-pad them together.
        parts = {}
        for chunk in chunks:
            b, lg = self._prefill(chunk)
            for i, r in enumerate(chunk):
                r.kv = self._extract(b, i, r.req.prompt_ids)
                parts[id(r)] = lg[i]
        logits = torch.stack([parts[id(r)] for r in rows])
        cache, mask = self._assemble([r.kv for r in rows], 0, self._room(rows))
        batch = Batch(rows, cache, mask, torch.tensor([len(r.kv.tokens) for r in rows],
                                                       device=self.device))
        for r in rows:
            r.kv = None
        return batch, logits

    def store_finished(self, batch: Batch, i: int) -> None:
        """Keep finished row i's KV under its request id (no-op without kept KV): its next round,
        or a branch of it, prefills only its new tokens. Its last sampled token was never fed, so
        it is not in the cache."""
        if self.reuse_kv:
            r = batch.rows[i]
            self._keep(r.req.request_id, self._extract(batch, i, r.req.prompt_ids + r.tokens[:-1]))

    def advance(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one sampled token per row; the rows' next-token logits."""
        logits = self._forward(batch, tokens[:, None], torch.ones_like(tokens)[:, None], batch.next_pos[:, None])
        batch.next_pos = batch.next_pos + 1
        return logits

    def _run_group(self, rows: list[Row]) -> None:
        batch, logits = self.prefill(rows)
        while True:
            tokens = self.sample(logits, batch.rows)
            done = [i for i, r in enumerate(batch.rows) if r.finish is not None]
            if done:
                for i in done:
                    self.store_finished(batch, i)
                keep = [i for i in range(len(batch.rows)) if batch.rows[i].finish is None]
                if not keep:
                    return
                batch = self.select(batch, keep)
                tokens = tokens[keep]
            logits = self.advance(batch, tokens)

    def _keep(self, rid: str, kv: KV) -> None:
        """Store a finished row's KV (most recent last); evict the oldest beyond the cap."""
        old = self._store.pop(rid, None)
        self._n_cached += len(kv.tokens) - (len(old.tokens) if old is not None else 0)
        self._store[rid] = kv
        while self.max_cached_tokens is not None and self._n_cached > self.max_cached_tokens \
                and len(self._store) > 1:
            self._n_cached -= len(self._store.pop(next(iter(self._store))).tokens)

    def _prefill_chunks(self, rows: list[Row]) -> list[list[Row]]:
        """Group rows by suffix length so padding stays small (one chunk without KV reuse: the
        per-row KV copy-out needs a plain DynamicCache)."""
        if not self.reuse_kv or len(rows) == 1:
            return [rows]
        rows = sorted(rows, key=lambda r: len(r.suffix))
        chunks, cur, total = [], [], 0
        for r in rows:
            n = len(r.suffix)
            padded = (len(cur) + 1) * n   # rows are sorted: n is the new maximum
            if cur and (padded > 1.25 * (total + n) + 32 or padded > self.max_prefill_tokens):
                chunks.append(cur)
                cur, total = [], 0
            cur.append(r)
            total += n
        chunks.append(cur)
        return chunks

    # ------------------------------------------------------------------ tensors

    def _prefill(self, rows: list[Row]) -> tuple[Batch, torch.Tensor]:
        S = max(len(r.suffix) for r in rows)
        cache, past_mask = self._assemble([r.past for r in rows], S, self._room(rows))
        ids = torch.full((len(rows), S), self.pad_id, dtype=torch.long)
        smask = torch.zeros((len(rows), S), dtype=torch.long)
        pos = torch.zeros((len(rows), S), dtype=torch.long)
        for i, r in enumerate(rows):
            n, p0 = len(r.suffix), (len(r.past.tokens) if r.past is not None else 0)
            ids[i, S - n:] = torch.tensor(r.suffix)
            smask[i, S - n:] = 1
            pos[i, S - n:] = torch.arange(p0, p0 + n)
        self.stats["prefill_tokens"] += sum(len(r.suffix) for r in rows)
        self.stats["prefill_calls"] += 1
        batch = Batch(rows, cache, past_mask, pos[:, -1].to(self.device) + 1)
        logits = self._forward(batch, ids.to(self.device), smask.to(self.device),
                               pos.to(self.device))
        return batch, logits

    def _forward(self, batch: Batch, ids, new_mask, pos) -> torch.Tensor:
        """Run the model on new tokens; extend the batch mask; return last-position float32 logits."""
        batch.mask = torch.cat([batch.mask, new_mask], dim=1)
        kw = {"logits_to_keep": 1} if self._logits_to_keep else {}
        with without_cudnn_attention(self.device):
            out = self.model(input_ids=ids, attention_mask=batch.mask, position_ids=pos,
                             use_cache=True, **{self._cache_arg: batch.cache}, **kw)
        batch.cache = getattr(out, self._cache_arg)
        self.stats["forward_calls"] += 1
        logits = out.logits[:, -1].float()
        if logits.shape[-1] > self.n_token_ids:  # padding rows of the vocabulary: never sampled
            logits[:, self.n_token_ids:] = float("-inf")
        return logits

    def _room(self, rows: list[Row]) -> int:
        """Spare decode-cache positions for `rows`: what they may still generate, at most `kv_room`."""
        return min(self.kv_room, max(r.req.max_new_tokens - len(r.tokens) for r in rows))

    def _assemble(self, kvs: list[KV | None], new: int, room: int):
        """Left-pad cached keys/values into one cache that takes `new` positions (the next
        forward's) plus `room` more before it reallocates; return it with its 2-D mask."""
        from transformers import DynamicCache

        lens = [len(kv.tokens) if kv is not None else 0 for kv in kvs]
        P, B = max(lens), len(kvs)
        mask = torch.zeros((B, P), dtype=torch.long, device=self.device)
        if not self.reuse_kv:
            return DynamicCache(config=self.model.config), mask
        if P == 0:
            return preallocated_cache(room=room), mask
        layers = []
        for li in range(len(next(kv for kv in kvs if kv is not None and kv.tokens).keys)):
            blocks = [(kv.keys[li][None], kv.values[li][None]) if n else None
                      for kv, n in zip(kvs, lens)]
            layers.append(PreallocatedLayer(room).fill(blocks, P, new + room, self.device))
        for i, n in enumerate(lens):
            mask[i, P - n:] = 1 if n else 0
        return preallocated_cache(layers), mask

    def _extract(self, batch: Batch, i: int, tokens: list[int]) -> KV:
        """Copy row i's real positions out of the batch cache (to CPU memory)."""
        pos = batch.mask[i].nonzero()[:, 0]
        a, b = (int(pos[0]), int(pos[-1]) + 1) if len(pos) else (0, 0)
        if b - a == len(pos):   # one run of real positions (the usual case): a plain copy of it
            def take(t):
                return t[i, :, a:b].to("cpu", copy=True)
        else:                   # padding in the middle (rows merged from several prefills)
            def take(t):
                return t[i].index_select(1, pos).to("cpu")
        keys = [take(layer.keys) for layer in batch.cache.layers]
        values = [take(layer.values) for layer in batch.cache.layers]
        if keys and keys[0].shape[1] != len(tokens):
            raise RuntimeError(f"HFEngine internal error: {keys[0].shape[1]} cached positions for "
                               f"{len(tokens)} tokens")
        return KV(list(tokens), keys, values)

    def select(self, batch: Batch, keep: list[int]) -> Batch:
        """Drop finished rows, then the columns that are padding in every remaining row."""
        idx = torch.tensor(keep, device=self.device)
        mask = batch.mask[idx]
        first = int(mask.any(0).long().argmax()) if self.reuse_kv else 0
        select_cache_rows(batch.cache, idx, first)
        mask = mask[:, first:]
        return Batch([batch.rows[i] for i in keep], batch.cache, mask, batch.next_pos[idx])

    # ------------------------------------------------------------------ sampling

    def sample(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Pick one token per row, append it with its statistics, set finish reasons."""
        V = logits.shape[-1]
        temps = torch.tensor([1.0 if r.sp.is_greedy else float(r.sp.temperature) for r in rows],
                             device=logits.device)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        tokens = logp.argmax(-1)
        sampled = [i for i, r in enumerate(rows) if not r.sp.is_greedy]
        if sampled:
            tokens[sampled] = _draw(logp[sampled], [rows[i] for i in sampled])
        chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
        # statistics only for rows still inside their stats_window (the branch rule's window)
        in_window = [r.sp.stats_window is None or len(r.tokens) < r.sp.stats_window for r in rows]
        k = min(max((r.sp.logprobs_topk for r, w in zip(rows, in_window) if w), default=0), V)
        # statistics for the rows inside their window only (under continuous batching rows join
        # at any time, so most steps have a few such rows among many past their window)
        win = [i for i, w in enumerate(in_window) if w]
        topv, topi = [[] for _ in rows], [[] for _ in rows]
        if k > 0 and win:
            top = logp[win].topk(k, dim=-1)
            for i, v, ix in zip(win, top.values.tolist(), top.indices.tolist()):
                topv[i], topi[i] = v, ix
        ent = [0.0] * len(rows)
        ent_rows = [i for i in win if rows[i].sp.full_entropy]
        if ent_rows:
            lp = logp[ent_rows]
            p = lp.exp()
            for i, h in zip(ent_rows, (-torch.where(p > 0, p * lp, torch.zeros_like(p)).sum(-1)).tolist()):
                ent[i] = h
        toks = tokens.tolist()
        for i, r in enumerate(rows):
            t = toks[i]
            r.tokens.append(t)
            r.logprobs.append(chosen[i])
            if not in_window[i]:
                r.topk.append([])
            else:
                r.topk.append(topk_with_sampled(topi[i], topv[i], t, chosen[i], min(r.sp.logprobs_topk, V)))
                if r.sp.full_entropy:
                    r.entropy.append(ent[i])
            if t in self.eos_token_ids:
                r.finish = "eos"
            elif (s := r.stop.check(r.tokens)) is not None:
                r.finish, r.stop_str = "stop", s
            elif len(r.tokens) >= r.req.max_new_tokens:
                r.finish = "length"
        self.stats["generated_tokens"] += len(rows)
        return tokens


def _draw(logp: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row from that row's generator; top-k/top-p only
    restrict the support (the reported log-probs stay those of the untruncated distribution)."""
    V = logp.shape[-1]
    u = torch.cat([torch.rand(1, generator=r.rng, dtype=torch.float64) for r in rows])
    u = u.to(logp.device)
    probs = logp.double().exp()
    top_k = torch.tensor([r.sp.top_k if r.sp.top_k and r.sp.top_k > 0 else V for r in rows],
                         device=logp.device)
    top_p = torch.tensor([float(r.sp.top_p) for r in rows], dtype=torch.float64, device=logp.device)
    if bool((top_k < V).any()) or bool((top_p < 1).any()):
        sp, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logp.device)[None]
        # Keep rank < k, and tokens whose preceding mass is < p (so the first always stays).
        keep = (rank < top_k[:, None]) & ((sp.cumsum(-1) - sp) < top_p[:, None])
        cdf = (sp * keep).cumsum(-1)
        last = keep.sum(-1, keepdim=True) - 1
    else:
        order, cdf = None, probs.cumsum(-1)
        last = torch.full((len(rows), 1), V - 1, device=logp.device)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    idx = torch.minimum(idx, last)   # u * total may round up to total
    return (order.gather(1, idx) if order is not None else idx)[:, 0]


def kv_cache_arg(model) -> str:
    """The name `model`'s forward takes its KV cache by, which is also the output's field: `cache`
    in transformers >= 5.2x (`past_key_values` warns there, and goes in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _pick_attn(name: str | None, device: torch.device) -> str:
    if name in (None, "") and device.type == "cpu":
        from verl_arpo.workers.rollout.engines import decode_attention

        return decode_attention.register()
    if name in (None, "", "sdpa"):
        return "sdpa"
    if name == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            logger.warning("HFEngine: flash_attn is not installed; using sdpa attention")
            return "sdpa"
    return name


def _why_no_kv_reuse(model) -> str | None:
    """Why this model's cache cannot be cut, re-padded and stitched per row (None = it can)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception as e:  # an unusual config: be safe
        return f"cannot inspect the cache layout ({type(e).__name__}: {e})"
    odd = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if odd:
        return f"cache layers {sorted(odd)} are not plain full-attention layers"
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    return None


def _eos_ids(tokenizer, model) -> list[int]:
    ids = []
    for src in (getattr(tokenizer, "eos_token_id", None),
                getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for t in (src if isinstance(src, (list, tuple)) else [src]):
            if t is not None and int(t) not in ids:
                ids.append(int(t))
    if not ids:
        raise ValueError("HFEngine: neither the tokenizer nor the model defines an eos token id")
    return ids


def _pad_id(tokenizer, model) -> int:
    for t in (getattr(tokenizer, "pad_token_id", None), getattr(model.config, "pad_token_id", None),
              getattr(tokenizer, "eos_token_id", None)):
        if t is not None:
            return int(t)
    return 0
