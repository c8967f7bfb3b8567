"""The sections that describe a trained (or frozen) model: `actor_rollout_ref.model`, `.actor`, `.ref`
and `critic`, with the optimizer and FSDP sub-sections they share.

Field defaults equal configs/ppo_trainer.yaml (tests/trainer/test_job_config.py keeps them equal).
Each section's `problems(where)` returns the value rules of its own keys; the rules that read
several sections live in `JobConfig.problems` (config/__init__.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from verl_arpo.config.typed import Problems, choices

ModelDtype = Literal["float32", "fp32", "bfloat16", "bf16"]
MODEL_DTYPE_NAMES = choices(ModelDtype)
"""Accepted values of fsdp_config.model_dtype besides null (sharded_model.model_dtype)."""

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLPenalty = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]
WarmupStyle = Literal["constant", "cosine"]
Strategy = Literal["fsdp", "fsdp2"]

_DTYPE_HINT = "null: fp32 trained, bf16 reference on GPU"


def resolve_model_dtype(value: str | None, trained: bool, device_type: str) -> str:
    """"float32" or "bfloat16": the dtype a model's weights are loaded in (`fsdp_config.model_dtype`,
    verl's key). null: fp32 for a trained model (actor, critic: the optimizer's master weights); for
    the frozen reference bf16 on CUDA, as verl loads it (half the memory and half the init broadcast;
    it computes in bf16 there anyway), and fp32 on the CPU, where bf16 is emulated on most machines
    (docs/performance.md, "Precision on the CPU")."""
    if value is not None:
        if value not in MODEL_DTYPE_NAMES:
            raise ValueError(f"fsdp_config.model_dtype={value!r}: choose one of {sorted(MODEL_DTYPE_NAMES)} or null")
        return "bfloat16" if value.startswith("b") else "float32"
    return "bfloat16" if not trained and device_type == "cuda" else "float32"


def _positive(where: str, leaf: str, value: float | None, what: str, nullable: bool = False) -> Problems:
    if value is None or value > 0:
        return []
    return [(f"{where}.{leaf}", f"must be {'null or ' if nullable else ''}a number > 0 ({what})")]


def _at_least(where: str, leaf: str, value: int | None, low: int, what: str = "") -> Problems:
    if value is None or value >= low:
        return []
    return [(f"{where}.{leaf}", f"must be an integer >= {low}" + (f" ({what})" if what else ""))]


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # ??? in the YAML: required
    external_lib: str | None = None
    override_config: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    use_prefix_sharing: bool = False
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"

    def problems(self, where: str) -> Problems:
        out = []
        folder = Path(os.path.expanduser(self.path)) if self.path else None
        if folder is None:
            out.append((f"{where}.path", "is required: set it to a Hugging Face model folder (the one holding config.json)"))
        elif not folder.is_dir():
            out.append((f"{where}.path", f"{self.path!r} is not a folder: give a local Hugging Face model folder "
                        "(with config.json)"))
        elif not (folder / "config.json").is_file():
            out.append((f"{where}.path", f"{self.path!r} has no config.json: point it at a Hugging Face model folder"))
        out += _at_least(where, "lora_rank", self.lora_rank, 0, "0 = full fine-tuning")
        if self.use_prefix_sharing:
            if not self.use_remove_padding:
                out.append((f"{where}.use_prefix_sharing", "packs the rows' prefix tree, so it needs packed sequences: "
                            f"set {where}.use_remove_padding=true (or use_prefix_sharing=false)"))
            if self.attn_implementation not in (None, "sdpa", "eager", "flex_attention"):
                out.append((f"{where}.use_prefix_sharing", "needs attention that takes a tree mask: set "
                            f"{where}.attn_implementation to sdpa, eager or flex_attention (or use_prefix_sharing=false)"))
        return out


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    warmup_style: WarmupStyle = "constant"
    total_training_steps: int = -1
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8

    def problems(self, where: str) -> Problems:
        return _positive(where, "lr", self.lr, "the learning rate") + _positive(where, "eps", self.eps, "AdamW epsilon")


PrecisionName = Literal["bfloat16", "bf16", "float16", "fp16", "float32", "fp32"]


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """`fsdp_config.mixed_precision` (FSDP2's MixedPrecisionPolicy, sharded_model.fsdp_mixed_precision):
    the dtype the parameters are cast to for the forward and backward, and the dtype gradients are
    reduced in; the optimizer keeps the weights in their load dtype (model_dtype). verl's FSDP1-only
    `buffer_dtype` is not a key here: FSDP2 keeps buffers in the model's dtype."""

    param_dtype: PrecisionName = "bfloat16"
    reduce_dtype: PrecisionName = "float32"


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    reshard_after_forward: bool = True
    grad_sync_once: bool = False
    """Reduce-scatter the gradients once a mini-batch, after its last micro-batch, not after every
    micro-batch (sharded_model.sync_gradients): fewer collectives, the unsharded fp32 gradients held
    through the mini-batch. The sum's order changes, so the numbers do in the last bits."""
    fsdp_size: int = -1
    mixed_precision: MixedPrecisionConfig | None = None
    """null: bf16 parameters with fp32 reduction on CUDA, none (fp32) on the CPU."""
    model_dtype: ModelDtype | None = field(default=None, metadata={"hint": _DTYPE_HINT})  # sharded_model.model_dtype


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # a name in algos.core_algos.POLICY_LOSS_REGISTRY (checked by trainer.config.validate_config)


@dataclass(frozen=True)
class CheckpointConfig:
    contents: tuple = ("model", "optimizer", "extra")


@dataclass(frozen=True)
class ActorConfig:
    strategy: Strategy = "fsdp"
    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 2
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ulysses_sequence_parallel_size: int = 1
    grad_clip: float | None = 1.0
    max_grad_norm: float | None = None
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLPenalty = "low_var_kl"
    ppo_epochs: int = 1
    skip_old_log_prob_on_policy: bool = True
    shuffle: bool = False
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    enable_entropy_balanced_clipping: bool = False
    enable_entropy_balanced_advantage: bool = False
    entropy_advantage_alpha: float = 0.2
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)

    @property
    def clip_norm(self) -> float | None:
        """The gradient-norm clip: `max_grad_norm` (verl's alias) when set, else `grad_clip`."""
        return self.max_grad_norm if self.max_grad_norm is not None else self.grad_clip

    def problems(self, where: str) -> Problems:
        out = _positive(where, "clip_ratio", self.clip_ratio, "PPO ε")
        for leaf in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, leaf)
            if value is not None and value < 0:
                out.append((f"{where}.{leaf}", "must be null or a number >= 0"))
        if self.clip_ratio_low is not None and self.clip_ratio_low >= 1:
            out.append((f"{where}.clip_ratio_low", "must be < 1 (the lower bound is 1 − clip_ratio_low)"))
        if self.clip_ratio_c <= 1:
            out.append((f"{where}.clip_ratio_c", f"dual-clip constant must be > 1, got {self.clip_ratio_c!r}: use e.g. 3.0"))
        for leaf in ("grad_clip", "max_grad_norm"):
            out += _positive(where, leaf, getattr(self, leaf), "max gradient norm", nullable=True)
        out += _at_least(where, "ppo_epochs", self.ppo_epochs, 1)
        out += _at_least(where, "ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size, 1,
                         "ranks that split one sequence (1 = off)")
        return out + update_sizes_problems(self, where)


def update_sizes_problems(section: "ActorConfig | CriticConfig", where: str) -> Problems:
    """The micro sizes of an update, each on its own (the divisibility rules need the batch: JobConfig)."""
    out = _at_least(where, "ppo_mini_batch_size", section.ppo_mini_batch_size, 1, "prompts per optimizer step")
    out += _at_least(where, "ppo_micro_batch_size_per_gpu", section.ppo_micro_batch_size_per_gpu, 1)
    return out


@dataclass(frozen=True)
class RefFSDPConfig:
    param_offload: bool = False
    reshard_after_forward: bool = True
    mixed_precision: MixedPrecisionConfig | None = None
    model_dtype: ModelDtype | None = field(default=None, metadata={"hint": _DTYPE_HINT})


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size: int | None = None
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    ulysses_sequence_parallel_size: int = 1  # ${actor_rollout_ref.actor.ulysses_sequence_parallel_size}
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)

    def problems(self, where: str) -> Problems:
        return _at_least(where, "log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu, 1)


@dataclass(frozen=True)
class CriticModelConfig:
    path: str | None = None  # ${actor_rollout_ref.model.path}
    tokenizer_path: str | None = None  # ${actor_rollout_ref.model.path}
    override_config: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    use_remove_padding: bool = False
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass(frozen=True)
class CriticConfig:
    strategy: Strategy = "fsdp"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = 16
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int = 2
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ulysses_sequence_parallel_size: int = 1
    ppo_epochs: int = 1
    shuffle: bool = False
    grad_clip: float | None = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: LossAggMode = "token-mean"

    def gae_problems(self, where: str) -> Problems:
        """The critic's rules; JobConfig asks for them only when a critic is built (adv_estimator=gae)."""
        out = []
        if not self.model.path:
            out.append((where, "adv_estimator=gae needs a critic: give critic.model.path (and the critic section "
                        "of ppo_trainer.yaml), or use algorithm.adv_estimator=grpo"))
        out += _at_least(where, "ulysses_sequence_parallel_size", self.ulysses_sequence_parallel_size, 1,
                         "ranks that split one sequence (1 = off)")
        return out + self.optim.problems(f"{where}.optim") + update_sizes_problems(self, where)
