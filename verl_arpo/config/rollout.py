"""`actor_rollout_ref.rollout`: the engine, the sampling, ARPO/AEPO branching and the tools.

Field defaults equal configs/ppo_trainer.yaml (tests/trainer/test_job_config.py keeps them equal).
The agent loop reads this section as it is (workers/rollout/__init__.build_agent_loop).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Literal

from verl_arpo.config.typed import Problems, choices

RolloutName = Literal["hf", "vllm"]
ROLLOUT_NAMES = choices(RolloutName)
RolloutMode = Literal["sync_with_tool", "async_with_tool"]
ROLLOUT_MODES = choices(RolloutMode)
"""rollout.mode: rounds with barriers (agent_loop.py) or none (async_agent_loop.py)."""
EntropyMode = Literal["topk_proxy", "full"]
EntropyTiming = Literal["after_result", "before_call"]
"""rollout.entropy_timing: when ΔH is measured (branching.py; docs/algorithms.md "When the entropy is measured")."""

VLLM_ONLY_KEYS = {"enforce_eager": True, "load_format": "auto", "max_num_batched_tokens": 8192, "max_num_seqs": 1024}
"""vLLM engine arguments passed through from the rollout section, with their YAML defaults."""


@dataclass(frozen=True)
class MultiTurnConfig:
    # "" (or null) is the seeds' unset ${ENABLE_MULTI_TURN}: accepted as the default (true); false is refused
    enable: Literal[True, ""] | None = field(default=True, metadata={
        "hint": "false is not implemented: the rollout is always the multi-turn tool loop; set it to true "
                "(a single-turn run is a tool config without tool_instances)"})
    format: Literal["tags", "hermes"] = field(default="tags", metadata={
        "hint": "tags: <python>…</python> calls and <result> results (the reference's); hermes: the chat "
                "template's function calling, <tool_call> JSON and role: tool messages (docs/tools.md)"})
    tokenization_sanity_check_mode: Literal["strict", "disable"] = field(default="strict", metadata={
        "hint": "hermes: strict compares each trajectory's incremental ids with a full render of its messages "
                "(rollout/tokenization_mismatch and a warning); disable skips it"})


@dataclass(frozen=True)
class ValKwargs:
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0
    n: int = 1
    do_sample: bool = False


@dataclass(frozen=True)
class ToolsConfig:
    """`actor_rollout_ref.rollout.tools`, also the root of a tool YAML file (configs/tools/*.yaml) read by
    the tool registry; `tool_instances` maps a tool name to {class_path, params} (free-form params:
    each tool class checks its own, see docs/tools.md)."""

    call_limit: int = 3
    """maximum tool calls per trajectory (the rollout enforces it)"""
    max_workers: int = 64
    """tool calls running at the same time"""
    timeout: float = 120
    """wall-clock seconds for one call, retries and backoff included"""
    retry_count: int = 3
    """extra attempts after an exception or an empty result"""
    retry_backoff: float = 0.5
    """seconds before the first retry; doubles each time"""
    verbose_logging: bool = False
    """log every call (tag, seconds, ok)"""
    fail_on_error: bool = True
    """raise when a tool fails to load instead of skipping it with a warning"""
    infra_failure_policy: Literal["mask", "drop_group", "keep"] = "mask"
    """a trajectory that ends with a tool *infrastructure* failure (service down, 429 after retries, a
    call past its timeout): mask (it trains nothing and leaves its group's baseline), drop_group (its
    whole group trains nothing) or keep (trained as is; the model's own errors are always kept)"""
    infra_failure_stop_rate: float | None = 0.5
    """stop the run (after saving a checkpoint) when more than this share of a step's trajectories hit
    an infrastructure failure; null never stops"""
    tool_instances: dict = field(default_factory=lambda: {
        "python": {"class_path": "verl_arpo.workers.rollout.tools.python_tool.PythonTool",
                   "params": {"timeout": 20, "sandbox": "auto", "conda_path": None, "conda_env": None}},
        "search": {"class_path": "verl_arpo.workers.rollout.tools.local_search_tool.LocalSearchTool",
                   "params": {"cache_file": "search_cache/local_search_cache.sqlite", "max_results": 3,
                              "result_length": 500, "api_key": None, "zone": None, "location": "us"}}})


@dataclass(frozen=True)
class RolloutSection:
    """`actor_rollout_ref.rollout` as written; the agent loop reads it as it is."""

    name: RolloutName = "hf"
    mode: RolloutMode = field(default="sync_with_tool", metadata={
        "hint": "sync: rounds with barriers; async: no barriers"})
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    prompt_length: int = 1536
    response_length: int = 4096
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    ignore_eos: bool = False
    enforce_eager: bool = True
    free_cache_engine: bool = True
    load_format: str = "auto"
    tensor_model_parallel_size: int = 1
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    max_num_seqs: int = 1024
    enable_prefix_caching: bool = True
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    do_sample: bool = True
    n: int = 1
    initial_rollouts: int | None = None
    beam_size: int = 2
    branch_rule: str = "arpo"  # a name in algos.branching.BRANCH_RULES (checked by trainer.config.validate_config)
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    entropy_mode: EntropyMode = "topk_proxy"
    entropy_window: int = 20
    entropy_timing: EntropyTiming = field(default="after_result", metadata={
        "hint": "after_result: the paper's timing (the k tokens after each tool result); before_call: the "
                "reference's (the round that ended in the call; first-call draws see ΔH = 0)"})
    entropy_topk: int = 10
    enable_dynamic_rollouts: bool = False
    dynamic_rollout_beta: float = 0.5
    branch_penalty_gamma: float = 0.05
    initial_entropy_tokens: int = 50
    max_rounds: int | None = None
    seed: int = 0
    seed_requests: bool = True
    calculate_log_probs: bool = True
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def problems(self, where: str) -> Problems:
        out = []
        if self.name == "vllm" and importlib.util.find_spec("vllm") is None:
            out.append((f"{where}.name", "vllm is not installed here: install it, or use actor_rollout_ref.rollout.name=hf"))
        for leaf, what in (("n", "trajectories per prompt"), ("beam_size", ""), ("entropy_window", ""),
                           ("entropy_topk", ""), ("initial_entropy_tokens", ""), ("log_prob_micro_batch_size_per_gpu", "")):
            if getattr(self, leaf) < 1:
                out.append((f"{where}.{leaf}", "must be an integer >= 1" + (f" ({what})" if what else "")))
        if self.val_kwargs.n < 1:
            out.append((f"{where}.val_kwargs.n", "must be an integer >= 1"))
        m0 = self.initial_rollouts
        if m0 is not None and m0 < 1:
            out.append((f"{where}.initial_rollouts", "must be null or an integer >= 1"))
        elif m0 is not None and self.n >= 1 and self.n < m0:
            out.append((f"{where}.initial_rollouts", f"{m0} is larger than rollout.n={self.n}: set initial_rollouts "
                        "<= n (ARPO starts initial_rollouts trajectories and branches up to n)"))
        rate = self.tools.infra_failure_stop_rate
        if rate is not None and not 0.0 < rate <= 1.0:
            out.append((f"{where}.tools.infra_failure_stop_rate", f"{rate} must be in (0, 1] (a share of a step's "
                        "trajectories), or null to never stop"))
        if not self.temperature > 0:  # the update scores the sampled tokens under logits / temperature
            out.append((f"{where}.temperature", f"{self.temperature} must be > 0: training samples and its log-probs "
                        "divide the logits by it (greedy decoding is for validation: val_kwargs.temperature=0)"))
        if not 0.0 <= self.branch_probability <= 1.0:
            out.append((f"{where}.branch_probability", "must be a number in [0, 1]"))
        tp = self.tensor_model_parallel_size
        if tp < 1:
            out.append((f"{where}.tensor_model_parallel_size", "must be an integer >= 1"))
        elif tp > 1:  # refused, not ignored: each engine lives in one worker (one GPU) and holds the whole model
            out.append((f"{where}.tensor_model_parallel_size", f"{tp} is not implemented: every rollout engine runs "
                        "inside one worker on one device and holds the whole model; set it to 1 (a model whose weights "
                        "plus KV cache do not fit in gpu_memory_utilization of one GPU cannot be trained here yet)"))
        if self.name == "hf":  # vLLM's engine keys: the HF engine has no such setting
            for leaf, default in VLLM_ONLY_KEYS.items():
                value = getattr(self, leaf)
                if value != default:
                    out.append((f"{where}.{leaf}", f"{value!r} applies to the vLLM engine only (rollout.name=vllm); "
                                f"the hf engine has no such setting: remove the override or set it back to {default!r}"))
        return out
