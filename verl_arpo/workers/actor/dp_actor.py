"""The data-parallel PPO actor: log-probs of responses and the policy update (verl's DataParallelPPOActor).

Data layout (from the rollout; P prompt slots left-padded, R response slots right-padded):
`input_ids`, `attention_mask`, `position_ids` [B, P+R]; `responses`, `response_mask` [B, R]
(loss mask m: 0 on tool results, forced tokens, padding); for the update also `old_log_probs`,
`advantages` and, with an active KL loss (use_kl_loss and kl_loss_coef ≠ 0), `ref_log_prob` [B, R]. logits[:, −R−1:−1] score the responses.
Without `old_log_probs` the update must be strictly on-policy (ppo_epochs=1, one mini-batch): π_old
is then the update's own forward, detached (ratio 1, same gradient), saving a whole forward pass.

Exact mini-batch objective. One optimizer step = one mini-batch. Every micro-batch loss is
aggregated with the *mini-batch's* global counts (core_algos.agg_loss: `batch_num_tokens` = valid
tokens for token-mean, `global_batch_size` = sequences with ≥ 1 valid token for the seq-* modes),
summed over the data-parallel group, and multiplied by dp_size because FSDP averages gradients.
So Σ over micro-batches and ranks of the micro-batch gradients is ∇ of the mini-batch objective,
and fixed, token-budget (use_dynamic_bsz) and data-parallel splits give the same gradient
(older verl scaled each micro-batch mean by its share of rows, exact only when every micro-batch
has the same number of valid tokens per row).

AEPO (docs/algorithms.md, "AEPO 2" and "AEPO 3"). `enable_entropy_balanced_clipping` selects the registered
"entropy_balanced" policy loss. `enable_entropy_balanced_advantage` computes the full-vocabulary
entropy H (detached) in the same forward *whenever the flag is on* — the reference computed H only
when entropy_coeff != 0 (0 in every shipped config), so the feature silently did nothing — and uses
A' = compute_entropy_aware_advantage(A, H, m, α) per micro-batch (z-statistics over the
micro-batch, as in the reference; so AEPO advantages, unlike the plain loss, depend on the split).

use_remove_padding (packed sequences). The valid tokens of all rows are concatenated into one row
with position_ids restarting at 0 and attention_mask=None. transformers (checked in 5.19:
masking_utils.find_packed_sequence_indices, called by create_causal_mask) infers the sequence
boundaries from the position_ids and builds a block-diagonal causal mask for sdpa, eager and flex
attention; flash_attention_2/3 take the varlen path from the same position_ids. So packing works
on CPU with sdpa and equals the padded forward (tests check this). The transformers docs recommend
flash attention for packing, and for a reason: with sdpa the packed row gets a dense N×N mask (N =
valid tokens of the micro-batch), so packing saves the MLP/lm-head work on padding, but attention
then costs N² instead of B·S² (more whenever N > S·√B) plus N² mask memory. On CPU it pays only
for very unequal row lengths; on GPU use flash_attention_2. Other attention backends (custom
kernels without that mask logic) fall back to padded batches with a one-time warning, as do rows
whose position_ids do not run 0..L−1.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from verl_arpo.trainer.ppo.core_algos import (agg_loss, compute_entropy_aware_advantage, get_policy_loss_fn,
                                              kl_penalty, kl_term_active)
from verl_arpo.utils.seqlen_balancing import get_reverse_idx, split_micro_batches
from verl_arpo.utils.torch_functional import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
)

__all__ = ["DataParallelPPOActor", "global_loss_counts", "clip_grad_and_step", "response_forward", "unpack",
           "packing_supported", "maybe_reshard", "TokenWeightedMeans", "cfg_get"]

# Attention backends whose transformers mask/varlen logic detects packed rows from position_ids.
PACKING_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


def cfg_get(config: Any, key: str, default: Any = None) -> Any:
    """`key` of a dict / OmegaConf node / object; `default` when absent or None."""
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


# --------------------------------------------------------------------------------------------
# Forward helpers shared with the critic
# --------------------------------------------------------------------------------------------
def packing_supported(module: torch.nn.Module) -> tuple[bool, str]:
    """Whether packed rows (attention_mask=None, restarting position_ids) are masked correctly."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return False, "transformers is not importable"
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return False, "this transformers version does not infer packed sequences from position_ids"
    attn = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if attn not in PACKING_ATTN_IMPLEMENTATIONS:
        return False, f"attn_implementation {attn!r} does not separate packed sequences"
    return True, ""


def _pack(micro, response_length: int) -> dict | None:
    """Flatten the valid tokens of a padded micro-batch into one packed row.

    Returns input_ids/position_ids [1, N], `keep` [B, R] (response slot holds a real token) and
    `keep_idx` [K] (packed index of the token *before* each kept response token, whose logits
    score it); None when a row's position_ids are not 0..L−1 (boundaries would be ambiguous).
    """
    mask = micro["attention_mask"].bool()
    pos = micro["position_ids"]
    expected = mask.long().cumsum(-1) - 1
    if not torch.equal(pos[mask], expected[mask]):
        return None
    flat_index = (mask.flatten().long().cumsum(0) - 1).view(mask.shape)
    s, r = mask.shape[1], response_length
    keep = mask[:, s - r:]
    keep_idx = flat_index[:, s - r - 1:s - 1][keep]
    return dict(input_ids=micro["input_ids"][mask].unsqueeze(0), position_ids=pos[mask].unsqueeze(0),
                keep=keep, keep_idx=keep_idx)


def response_forward(module: torch.nn.Module, micro, response_length: int, use_remove_padding: bool,
                     causal_lm: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Run `module` and return the logits that score the response slots.

    Returns (logits, keep, packed): padded → logits [B, R, C] for positions −R−1:−1; packed →
    logits [K, C] for the kept slots only (scatter back with `unpack`). keep [B, R] marks response
    slots holding real tokens (attention_mask); outputs at other slots are set to 0 by callers.
    `causal_lm` asks the model for only the needed logits (`logits_to_keep`), which a token
    classification head does not accept.
    """
    r = response_length
    packed = _pack(micro, r) if use_remove_padding else None
    if use_remove_padding and packed is None:
        _warn_once("pos", "use_remove_padding: position_ids are not 0..L-1 per row; using padded batches")
    if packed is not None:
        extra = {"logits_to_keep": packed["keep_idx"]} if causal_lm else {}
        out = module(input_ids=packed["input_ids"], position_ids=packed["position_ids"], attention_mask=None,
                     use_cache=False, **extra)
        logits = out.logits[0] if causal_lm else out.logits[0, packed["keep_idx"]]
        return logits, packed["keep"], True
    s = micro["input_ids"].shape[1]
    extra = {"logits_to_keep": r + 1} if causal_lm else {}
    out = module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro["position_ids"], use_cache=False, **extra)
    logits = out.logits[:, -r - 1:-1] if causal_lm else out.logits[:, s - r - 1:s - 1]
    return logits, micro["attention_mask"][:, s - r:].bool(), False


def unpack(values: torch.Tensor, keep: torch.Tensor, packed: bool) -> torch.Tensor:
    """[K] packed or [B, R] padded per-slot values → [B, R], zero where `keep` is False."""
    if packed:
        out = values.new_zeros(keep.shape)
        return out.masked_scatter(keep, values)
    return values * keep.to(values.dtype)


def maybe_reshard(module: torch.nn.Module) -> None:
    """FSDP2 leaves the root unsharded after a no_grad forward; reshard so the next
    state-dict/weight-sync sees sharded parameters and the memory is freed."""
    if hasattr(module, "reshard"):
        module.reshard()


# --------------------------------------------------------------------------------------------
# Loss scaling and the optimizer step (shared with the critic)
# --------------------------------------------------------------------------------------------
def _dp_size(dp_group) -> int:
    return dist.get_world_size(dp_group) if dist.is_available() and dist.is_initialized() else 1


def global_loss_counts(response_mask: torch.Tensor, dp_group=None) -> dict:
    """agg_loss kwargs for one mini-batch: valid tokens and valid sequences summed over the
    data-parallel group (when torch.distributed is initialized), and dp_size."""
    counts = torch.stack([response_mask.sum(), (response_mask.sum(-1) > 0).sum()]).to(torch.float64)
    dp_size = _dp_size(dp_group)
    if dp_size > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=dp_group)
    return dict(dp_size=dp_size, batch_num_tokens=counts[0].item(), global_batch_size=counts[1].item())


def clip_grad_and_step(module: torch.nn.Module, optimizer, grad_clip: float | None, name: str) -> float:
    """Clip the global gradient norm and step; skip the step (with a warning) on a non-finite norm.

    torch.nn.utils.clip_grad_norm_ works on FSDP2 DTensor gradients: the norm comes back as a
    DTensor with a partial placement, whose `full_tensor()` is the global norm (identical on every
    rank, so every rank makes the same skip decision). Returns the norm before clipping.
    """
    max_norm = float(grad_clip) if grad_clip is not None and grad_clip > 0 else math.inf
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if math.isfinite(norm):
        optimizer.step()
    else:
        warnings.warn(f"{name}: grad_norm is {norm}; skipping this optimizer step", stacklevel=2)
    optimizer.zero_grad(set_to_none=True)
    return norm


class TokenWeightedMeans:
    """Token-weighted running means of micro-batch metrics → exact mini-batch masked means."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weight = 0.0

    def add(self, weight: float, **values: float) -> None:
        self.weight += weight
        for k, v in values.items():
            self.sums[k] += float(v) * weight

    def means(self) -> dict[str, float]:
        return {k: v / max(self.weight, 1.0) for k, v in self.sums.items()}


# --------------------------------------------------------------------------------------------
# The actor
# --------------------------------------------------------------------------------------------
class DataParallelPPOActor:
    """PPO actor over a (possibly FSDP2-wrapped) HF causal LM.

    config: the `actor_rollout_ref.actor` node (dict or DictConfig) with ppo_mini_batch_size and
    ppo_micro_batch_size_per_gpu already normalized to trajectories per rank; optional
    `use_remove_padding` (the worker copies it from model config). dp_group: the data-parallel
    process group for loss counts and micro-batch counts (None = the default group).
    """

    def __init__(self, config: Any, actor_module: torch.nn.Module, actor_optimizer=None, *, dp_group=None):
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.dp_group = dp_group
        self.use_remove_padding = bool(cfg_get(config, "use_remove_padding", False))
        if self.use_remove_padding:
            ok, why = packing_supported(actor_module)
            if not ok:
                _warn_once("actor_pack", f"use_remove_padding disabled: {why}; using padded batches")
                self.use_remove_padding = False
        self._shuffle_gen = torch.Generator().manual_seed(int(cfg_get(config, "shuffle_seed", 0)))
        # the same rule normalize_config applies: a KL loss with weight 0 is off (no ref_log_prob read)
        self.use_kl_loss = kl_term_active(cfg_get(config, "use_kl_loss", False), cfg_get(config, "kl_loss_coef", 0.0))

    # -- forward ------------------------------------------------------------------------------
    def _forward_micro_batch(self, micro, temperature: float, calculate_entropy: bool = False,
                             entropy_grad: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(entropy [B, R] or None, log_probs [B, R]) of the response tokens under logits/temperature.

        Entropy is the full-vocabulary H; with `entropy_grad` it stays in the graph (entropy
        bonus), else it is computed without grad in float32 chunks. Slots past the response are 0.
        """
        r = micro["responses"].shape[-1]
        logits, keep, packed = response_forward(self.actor_module, micro, r, self.use_remove_padding)
        if temperature != 1.0:
            logits = logits / temperature
        labels = micro["responses"][keep] if packed else micro["responses"]
        log_probs = unpack(logprobs_from_logits(logits, labels), keep, packed)
        entropy = None
        if calculate_entropy:
            if entropy_grad:
                entropy = entropy_from_logits(logits)
            else:
                with torch.no_grad():
                    entropy = entropy_from_logits_with_chunking(logits.detach())
            entropy = unpack(entropy.to(log_probs.dtype), keep, packed)
        return entropy, log_probs

    def compute_log_prob(self, data, calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log π(response token) [B, R] (and entropy [B, R] or None), in the input row order.

        meta_info: temperature (required; logits are divided by it), micro_batch_size,
        use_dynamic_bsz, max_token_len (token budget per micro-batch when use_dynamic_bsz); the last
        three default to config log_prob_* keys, then to the ppo_* keys.
        """
        meta, c = data.meta_info, self.config
        if "temperature" not in meta:
            raise KeyError("compute_log_prob needs meta_info['temperature'] (the rollout temperature)")
        # meta_info wins; else the ref/rollout keys (log_prob_*), else the actor's ppo_* keys.
        use_dynamic = meta.get("use_dynamic_bsz",
                               cfg_get(c, "log_prob_use_dynamic_bsz", cfg_get(c, "use_dynamic_bsz", False)))
        micro_size = meta.get("micro_batch_size") or cfg_get(c, "log_prob_micro_batch_size_per_gpu",
                                                             cfg_get(c, "ppo_micro_batch_size_per_gpu"))
        max_len = meta.get("max_token_len") or cfg_get(c, "log_prob_max_token_len_per_gpu",
                                                       cfg_get(c, "ppo_max_token_len_per_gpu"))
        self.actor_module.eval()
        batch = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]).batch
        micro_batches, groups = split_micro_batches(batch, bool(use_dynamic), micro_size, max_len,
                                                    dp_group=self.dp_group)
        log_probs, entropies = [], []
        with torch.no_grad():
            for micro in micro_batches:
                ent, lp = self._forward_micro_batch(micro, float(meta["temperature"]), calculate_entropy)
                log_probs.append(lp)
                entropies.append(ent)
        maybe_reshard(self.actor_module)
        log_probs = torch.cat(log_probs, dim=0)
        entropy = torch.cat(entropies, dim=0) if calculate_entropy else None
        order = [i for g in groups for i in g]
        if order != list(range(len(order))):
            rev = torch.tensor(get_reverse_idx(order), device=log_probs.device)
            log_probs = log_probs[rev]
            entropy = entropy[rev] if entropy is not None else None
        return log_probs, entropy

    # -- update -------------------------------------------------------------------------------
    def _policy_loss_fn(self):
        mode = cfg_get(cfg_get(self.config, "policy_loss", {}), "loss_mode", "vanilla")
        if cfg_get(self.config, "enable_entropy_balanced_clipping", False):
            if mode not in ("vanilla", "entropy_balanced"):
                raise ValueError(f"enable_entropy_balanced_clipping selects the 'entropy_balanced' loss but "
                                 f"policy_loss.loss_mode is {mode!r}; set one of them")
            mode = "entropy_balanced"
        return get_policy_loss_fn(mode)

    def _micro_loss(self, micro, temperature: float, agg: dict, policy_loss_fn) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (already scaled to the mini-batch objective) and its metrics."""
        c = self.config
        mode = cfg_get(c, "loss_agg_mode", "token-mean")
        entropy_coeff = float(cfg_get(c, "entropy_coeff", 0.0))
        aepo_adv = bool(cfg_get(c, "enable_entropy_balanced_advantage", False))
        mask = micro["response_mask"]
        # [fix] H is computed whenever the AEPO advantage needs it, not only when entropy_coeff != 0.
        on_policy = "old_log_probs" not in micro.keys()
        entropy, log_prob = self._forward_micro_batch(
            micro, temperature, calculate_entropy=aepo_adv or entropy_coeff != 0 or on_policy,
            entropy_grad=entropy_coeff != 0)
        # Strictly on-policy (one epoch, one mini-batch): π_old is the current policy, so its
        # log-probs are this forward's, detached — the separate old-log-prob pass is skipped.
        old_log_prob = log_prob.detach() if on_policy else micro["old_log_probs"]
        advantages = micro["advantages"]
        if aepo_adv:
            advantages = compute_entropy_aware_advantage(advantages, entropy.detach(), mask,
                                                         alpha=float(cfg_get(c, "entropy_advantage_alpha", 0.2)))
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss_fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask,
            loss_agg_mode=mode, config=c, **agg)
        loss = pg_loss
        stats = dict(pg_loss=pg_loss.item(), pg_clipfrac=clipfrac.item(), ppo_kl=ppo_kl.item(),
                     pg_clipfrac_lower=clipfrac_lower.item())
        if entropy is not None:  # H of the policy being updated ("actor/entropy" is the rollout policy's)
            n = mask.sum().clamp(min=1)
            stats["update_entropy"] = ((entropy.detach() * mask).sum() / n).item()
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * agg_loss(entropy, mask, mode, **agg)
        if self.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_prob"], cfg_get(c, "kl_loss_type", "low_var_kl"))
            kl_loss = agg_loss(kld, mask, mode, **agg)
            loss = loss + float(cfg_get(c, "kl_loss_coef", 0.0)) * kl_loss
            stats["kl_loss"] = kl_loss.item()
        return loss, stats

    def update_policy(self, data) -> dict[str, list | float]:
        """`ppo_epochs` passes of PPO over `data`; one optimizer step per mini-batch of
        `ppo_mini_batch_size` rows. Returns verl-named metrics (lists: one entry per mini-batch;
        losses are the mini-batch objective terms — under DP each rank's share × dp_size, so the
        mean over ranks is the objective —, fractions/entropy are this rank's token means)."""
        c = self.config
        if self.actor_optimizer is None:
            raise ValueError("update_policy needs an optimizer (actor_optimizer=None)")
        if "temperature" not in data.meta_info:
            raise KeyError("update_policy needs meta_info['temperature'] (the rollout temperature)")
        temperature = float(data.meta_info["temperature"])
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "advantages"]
        mini_size = int(cfg_get(c, "ppo_mini_batch_size", len(data)))
        if "old_log_probs" in data.batch.keys():
            keys.append("old_log_probs")
        elif int(cfg_get(c, "ppo_epochs", 1)) != 1 or mini_size < len(data):
            raise KeyError("update_policy needs 'old_log_probs' (compute_log_prob) unless the update is strictly "
                           f"on-policy: ppo_epochs=1 and one mini-batch (ppo_mini_batch_size {mini_size} >= "
                           f"{len(data)} rows)")
        if self.use_kl_loss:
            if "ref_log_prob" not in data.batch.keys():
                raise KeyError("use_kl_loss is on with kl_loss_coef != 0 but the batch has no 'ref_log_prob': "
                               "run compute_ref_log_prob first")
            keys.append("ref_log_prob")
        batch = data.select(batch_keys=keys).batch
        if "response_mask" in data.batch.keys():
            batch["response_mask"] = data.batch["response_mask"]
        else:  # verl fallback: every real response token counts
            batch["response_mask"] = batch["attention_mask"][:, -batch["responses"].shape[-1]:]
        use_dynamic = bool(cfg_get(c, "use_dynamic_bsz", False))
        policy_loss_fn = self._policy_loss_fn()
        metrics: dict[str, list | float] = defaultdict(list)
        self.actor_module.train()
        for _ in range(int(cfg_get(c, "ppo_epochs", 1))):
            epoch_batch = batch
            if cfg_get(c, "shuffle", False):
                epoch_batch = batch[torch.randperm(batch.batch_size[0], generator=self._shuffle_gen)]
            for mini in epoch_batch.split(mini_size):
                agg = global_loss_counts(mini["response_mask"], self.dp_group)
                micro_batches, _ = split_micro_batches(
                    mini, use_dynamic, cfg_get(c, "ppo_micro_batch_size_per_gpu"),
                    cfg_get(c, "ppo_max_token_len_per_gpu"), dp_group=self.dp_group)
                self.actor_optimizer.zero_grad(set_to_none=True)
                means, sums = TokenWeightedMeans(), defaultdict(float)
                for micro in micro_batches:
                    loss, stats = self._micro_loss(micro, temperature, agg, policy_loss_fn)
                    loss.backward()
                    sums["pg_loss"] += stats.pop("pg_loss")
                    if "kl_loss" in stats:
                        sums["kl_loss"] += stats.pop("kl_loss")
                    means.add(micro["response_mask"].sum().item(), **stats)
                grad_norm = clip_grad_and_step(self.actor_module, self.actor_optimizer,
                                               cfg_get(c, "grad_clip", cfg_get(c, "max_grad_norm")), "actor")
                for k, v in {**sums, **means.means()}.items():
                    metrics[f"actor/{k}"].append(v)
                metrics["actor/grad_norm"].append(grad_norm)
        if self.use_kl_loss:  # inactive KL loss: actor/kl_loss and actor/kl_coef are not logged
            metrics["actor/kl_coef"] = float(cfg_get(c, "kl_loss_coef", 0.0))
        return dict(metrics)
