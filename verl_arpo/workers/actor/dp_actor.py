"""The data-parallel PPO actor: log-probs of responses and the policy update (verl's DataParallelPPOActor).

Data layout (from the rollout; P prompt slots left-padded, R response slots right-padded):
`input_ids`, `attention_mask`, `position_ids` [B, P+R]; `responses`, `response_mask` [B, R]
(loss mask m: 0 on tool results, forced tokens, padding); for the update also `old_log_probs`,
`advantages` and, with an active KL loss (use_kl_loss and kl_loss_coef ≠ 0), `ref_log_prob` [B, R]. logits[:, −R−1:−1] score the responses.
An actor built with `on_policy=True` (JobConfig.derived.on_policy: ppo_epochs=1, one mini-batch,
nothing else reading π_old) takes π_old from the update's own forward, detached (ratio 1, same
gradient), so the trainer skips the old-log-prob pass; it then also reports `actor/entropy`, the
entropy of that π_old. The settings that come from the config (the rollout temperature, on-policy,
the rollout correction) are constructor arguments: a batch carries data only.

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

Packed sequences (use_remove_padding) and the loss normalisation helpers live in
verl_arpo/workers/training_core.py, shared with the critic and SFT.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from verl_arpo.algos.core_algos import agg_loss, compute_entropy_aware_advantage, get_policy_loss_fn, kl_penalty
from verl_arpo.algos.rollout_mismatch import mismatch_metrics, rollout_is_weights
from verl_arpo.utils.device import without_cudnn_attention
from verl_arpo.config import ActorConfig, Batching, RolloutCorrection
from verl_arpo.utils.seqlen_balancing import get_reverse_idx, split_micro_batches
from verl_arpo.utils.torch_functional import (
    entropy_from_logits,
    entropy_from_logits_with_chunking,
    logprobs_from_logits,
)
from verl_arpo.utils.progress import Progress
from verl_arpo.utils.ulysses import SequenceParallel
from verl_arpo.workers.host_memory import HOST_MEMORY
from verl_arpo.workers.optim_step import clip_grad_and_step
from verl_arpo.workers.sequence_parallel import use_sequence_parallel
from verl_arpo.workers.sharded_model import (keep_gathered_after_backward, maybe_reshard, module_device, sync_gradients,
                                             to_device)
from verl_arpo.workers.training_core import (TokenWeightedMeans,
    check_trainable_attention,
    global_loss_counts,
    packing_supported,
    prefix_sharing_supported,
    response_forward,
    warn_if_dense_packing,
    warn_once)

__all__ = ["DataParallelPPOActor"]

# --------------------------------------------------------------------------------------------
# The actor
# --------------------------------------------------------------------------------------------
class DataParallelPPOActor:
    """PPO actor over a (possibly FSDP2-wrapped) HF causal LM.

    config: the typed `actor_rollout_ref.actor` section (`ActorConfig`, or a mapping of its keys;
    absent keys take the YAML defaults), its keys in the user's units. update: how this rank splits
    its share of an update (`Batching`, from `JobConfig.derived.actor_update`: trajectories per rank
    per optimizer step, micro-batches); needed by `update_policy` only. use_kl_loss: whether the KL
    loss is active (`JobConfig.derived.kl_loss_active`: on and with a non-zero weight).
    use_remove_padding: packed sequences (the worker passes `model.use_remove_padding`).
    use_prefix_sharing: the packed rows as a prefix tree, and token budgets that keep a prompt's rows
    together (`model.use_prefix_sharing`). shuffle_seed: seeds the mini-batch shuffle (actor.shuffle).
    temperature: the rollout temperature (`JobConfig.derived.temperature`); every log-prob and entropy
    is of logits / temperature, the distribution the engine sampled from. on_policy: π_old is the
    update's own forward (`JobConfig.derived.on_policy`; the batch then has no `old_log_probs`).
    rollout_correction: the rollout–training importance weights (`JobConfig.derived.rollout_correction`;
    None: off; the batch must then carry the engine's `rollout_log_probs`).
    dp_group: the data-parallel process group for loss counts and micro-batch counts (None = the
    default group; with `sp`, its dp group). sp: Ulysses sequence parallelism (`ulysses_sequence_parallel_size`,
    verl_arpo.utils.ulysses; needs use_remove_padding): every rank of an sp group holds the same batch,
    runs 1/S of each packed micro-batch and gets every slot's log-prob back. device: where the forward runs (the worker's device; default: the device of the
    module's parameters). Batches arrive and results leave on the host; each micro-batch moves to
    `device` just before its forward (`to_device`, the worker's device boundary). The reference
    policy is this class too, with no config and no update: it only runs compute_log_prob, which
    takes its micro-batching as an argument.
    """

    def __init__(self, config: ActorConfig | None, actor_module: torch.nn.Module, actor_optimizer=None, *,
                 update: Batching | None = None, use_kl_loss: bool = False, use_remove_padding: bool = False,
                 use_prefix_sharing: bool = False, shuffle_seed: int = 0, dp_group=None,
                 sp: SequenceParallel | None = None, device: torch.device | None = None,
                 temperature: float = 1.0, on_policy: bool = False,
                 rollout_correction: RolloutCorrection | None = None, gather_once: bool = False):
        self.config: ActorConfig = config if config is not None else ActorConfig()  # None: a reference policy
        self.update = update
        if not (float(temperature) > 0):
            raise ValueError(f"actor_rollout_ref.rollout.temperature must be > 0 for log-probs, got {temperature}")
        self.temperature = float(temperature)
        self.on_policy = bool(on_policy)
        self.rollout_correction = rollout_correction
        self.actor_module = actor_module
        # fsdp_config.reshard_after_forward=false: parameters stay gathered from a mini-batch's first
        # forward to its last backward (one all-gather a mini-batch; sharded_model.keep_gathered_after_backward)
        self.gather_once = bool(gather_once)
        # fsdp_config.grad_sync_once: one gradient reduce-scatter a mini-batch (sharded_model.sync_gradients)
        self.grad_sync_once = bool(self.config.fsdp_config.grad_sync_once)
        self.device = device if device is not None else module_device(actor_module)
        self.actor_optimizer = actor_optimizer
        if actor_optimizer is not None:
            check_trainable_attention(actor_module, self.device, "actor_rollout_ref.model")
        self.use_remove_padding = bool(use_remove_padding)
        self.sp = use_sequence_parallel(actor_module, sp, self.use_remove_padding, "actor_rollout_ref.actor",
                                        "actor_rollout_ref.model")
        self.dp_group = self.sp.dp_group if self.sp is not None else dp_group
        if self.sp is None and self.use_remove_padding:
            ok, why = packing_supported(actor_module)
            if not ok:
                warn_once("actor_pack", f"use_remove_padding disabled: {why}; using padded batches")
                self.use_remove_padding = False
        if self.use_remove_padding:
            warn_if_dense_packing(actor_module, self.device)
        self.share_prefix = bool(use_prefix_sharing)
        if self.share_prefix:
            ok, why = prefix_sharing_supported(actor_module)
            if not ok:
                raise ValueError(f"actor_rollout_ref.model.use_prefix_sharing: {why}; set "
                                 "actor_rollout_ref.model.attn_implementation=sdpa or use_prefix_sharing=false")
            if not self.use_remove_padding:
                raise ValueError("actor_rollout_ref.model.use_prefix_sharing needs packed sequences: set "
                                 "actor_rollout_ref.model.use_remove_padding=true or use_prefix_sharing=false")
        self._shuffle_gen = torch.Generator().manual_seed(int(shuffle_seed))
        self.use_kl_loss = bool(use_kl_loss)

    # -- forward ------------------------------------------------------------------------------
    def _forward_micro_batch(self, micro, temperature: float, calculate_entropy: bool = False,
                             entropy_grad: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(entropy [B, R] or None, log_probs [B, R]) of the response tokens under logits/temperature.

        Entropy is the full-vocabulary H; with `entropy_grad` it stays in the graph (entropy
        bonus), else it is computed without grad in float32 chunks. Slots past the response are 0.
        """
        r = micro["responses"].shape[-1]
        out = response_forward(self.actor_module, micro, r, self.use_remove_padding, share_prefix=self.share_prefix,
                               sp=self.sp)
        logits = out.logits
        # the temperature is applied chunk by chunk inside: no scaled copy of the logits
        log_probs = out.to_slots(logprobs_from_logits(logits, out.labels(micro["responses"]), temperature=temperature))
        entropy = None
        if calculate_entropy:
            if entropy_grad:
                entropy = entropy_from_logits(logits / temperature if temperature != 1.0 else logits)
            else:
                with torch.no_grad():
                    entropy = entropy_from_logits_with_chunking(logits.detach(), temperature=temperature)
            entropy = out.to_slots(entropy.to(log_probs.dtype))
        return entropy, log_probs

    def compute_log_prob(self, data, batching: Batching,
                         calculate_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log π(response token) [B, R] (and entropy [B, R] or None), in the input row order, of the
        logits divided by the actor's temperature. batching: this pass's micro-batches
        (`JobConfig.derived.actor_log_prob` or `.ref_log_prob`).
        """
        self._check_batch_temperature(data.meta_info, "compute_log_prob")
        use_dynamic, micro_size, max_len = batching.use_dynamic_bsz, batching.micro_batch, batching.max_token_len
        self.actor_module.eval()
        batch = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]).batch
        micro_batches, groups = split_micro_batches(batch, bool(use_dynamic), micro_size, max_len,
                                                    dp_group=self.dp_group, share_prefix=self.share_prefix)
        log_probs, entropies = [], []
        with torch.no_grad():
            for micro in micro_batches:
                ent, lp = self._forward_micro_batch(to_device(micro, self.device), self.temperature,
                                                    calculate_entropy)
                log_probs.append(lp.cpu())
                entropies.append(ent.cpu() if ent is not None else None)
        maybe_reshard(self.actor_module)
        log_probs = torch.cat(log_probs, dim=0)
        entropy = torch.cat(entropies, dim=0) if calculate_entropy else None
        order = [i for g in groups for i in g]
        if order != list(range(len(order))):
            rev = torch.tensor(get_reverse_idx(order), device=log_probs.device)
            log_probs = log_probs[rev]
            entropy = entropy[rev] if entropy is not None else None
        return log_probs, entropy

    def _check_batch_temperature(self, meta: dict, caller: str) -> None:
        """verl's actor reads the temperature from each batch; ours is set when the actor is built.
        A batch that still carries one must agree, so a caller written for verl cannot silently
        score tokens at another temperature than it meant."""
        if "temperature" in meta and float(meta["temperature"]) != self.temperature:
            raise ValueError(f"{caller}: the batch's meta_info['temperature']={meta['temperature']} differs from the "
                             f"actor's temperature {self.temperature}; the temperature is set when the actor is "
                             "built (DataParallelPPOActor(temperature=...), from actor_rollout_ref.rollout."
                             "temperature): drop it from meta_info")

    # -- update -------------------------------------------------------------------------------
    def _policy_loss_fn(self):
        mode = self.config.policy_loss.loss_mode
        if self.config.enable_entropy_balanced_clipping:
            if mode not in ("vanilla", "entropy_balanced"):
                raise ValueError(f"enable_entropy_balanced_clipping selects the 'entropy_balanced' loss but "
                                 f"policy_loss.loss_mode is {mode!r}; set one of them")
            mode = "entropy_balanced"
        return get_policy_loss_fn(mode)

    def _micro_loss(self, micro, agg: dict, policy_loss_fn) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (already scaled to the mini-batch objective) and its metrics.

        With the engine's `rollout_log_probs` in the batch, the rollout–training mismatch metrics
        are recorded; with a rollout correction the capped importance weights too, applied to the
        policy loss when its `apply` is on."""
        c = self.config
        mode = c.loss_agg_mode
        entropy_coeff = float(c.entropy_coeff)
        aepo_adv = bool(c.enable_entropy_balanced_advantage)
        mask = micro["response_mask"]
        # [fix] H is computed whenever the AEPO advantage needs it, not only when entropy_coeff != 0.
        on_policy = self.on_policy
        entropy, log_prob = self._forward_micro_batch(
            micro, self.temperature, calculate_entropy=aepo_adv or entropy_coeff != 0 or on_policy,
            entropy_grad=entropy_coeff != 0)
        # Strictly on-policy (one epoch, one mini-batch): π_old is the current policy, so its
        # log-probs are this forward's, detached — the separate old-log-prob pass is skipped.
        old_log_prob = log_prob.detach() if on_policy else micro["old_log_probs"]
        advantages = micro["advantages"]
        if aepo_adv:
            advantages = compute_entropy_aware_advantage(advantages, entropy.detach(), mask,
                                                         alpha=float(c.entropy_advantage_alpha))
        stats, loss_kwargs = {}, dict(agg)
        if "rollout_log_probs" in micro.keys():
            stats.update(mismatch_metrics(old_log_prob, micro["rollout_log_probs"], mask))
            rc = self.rollout_correction
            if rc is not None:
                weights, is_stats = rollout_is_weights(old_log_prob, micro["rollout_log_probs"], mask,
                                                       rc.threshold, rc.level, rc.mode)
                stats.update(is_stats)
                if rc.apply:
                    loss_kwargs["rollout_is_weights"] = weights
        pg_loss, clipfrac, ppo_kl, clipfrac_lower = policy_loss_fn(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask,
            loss_agg_mode=mode, config=c, **loss_kwargs)
        loss = pg_loss
        stats.update(pg_loss=pg_loss.item(), pg_clipfrac=clipfrac.item(), ppo_kl=ppo_kl.item(),
                     pg_clipfrac_lower=clipfrac_lower.item())
        if entropy is not None:  # H of the policy being updated ("actor/entropy" is the rollout policy's)
            n = mask.sum().clamp(min=1)
            stats["update_entropy"] = ((entropy.detach() * mask).sum() / n).item()
        if entropy_coeff != 0:
            loss = loss - entropy_coeff * agg_loss(entropy, mask, mode, **agg)
        if self.use_kl_loss:
            kld = kl_penalty(log_prob, micro["ref_log_prob"], c.kl_loss_type)
            kl_loss = agg_loss(kld, mask, mode, **agg)
            loss = loss + float(c.kl_loss_coef) * kl_loss
            stats["kl_loss"] = kl_loss.item()
        return loss, stats

    def update_policy(self, data) -> dict[str, list | float]:
        """`ppo_epochs` passes of PPO over `data`; one optimizer step per mini-batch of
        `update.mini_batch` rows (actor.ppo_mini_batch_size prompts × rollout.n ÷ ranks). Returns
        verl-named metrics (lists: one entry per mini-batch;
        losses are the mini-batch objective terms — under DP each rank's share × dp_size, so the
        mean over ranks is the objective —, fractions/entropy are this rank's token means), and the
        update's counts: actor/optimizer_steps, actor/skipped_optimizer_steps (a non-finite gradient
        norm skips the step) and actor/non_finite_losses (micro-batches)."""
        c = self.config
        if self.actor_optimizer is None:
            raise ValueError("update_policy needs an optimizer (actor_optimizer=None)")
        self._check_batch_temperature(data.meta_info, "update_policy")
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "advantages"]
        if self.update is None:
            raise ValueError("update_policy needs the update's batching (DataParallelPPOActor(update=...): "
                             "JobConfig.derived.actor_update)")
        mini_size = int(self.update.mini_batch)
        if self.on_policy:
            if int(c.ppo_epochs) != 1 or mini_size < len(data):
                raise ValueError("the actor was built on-policy (π_old = the update's own forward) but this update "
                                 f"is not: ppo_epochs={c.ppo_epochs}, mini-batches of {mini_size} trajectories for "
                                 f"{len(data)} rows; build it with on_policy=False and pass 'old_log_probs'")
        elif "old_log_probs" in data.batch.keys():
            keys.append("old_log_probs")
        else:
            raise KeyError("update_policy needs 'old_log_probs' (compute_log_prob first), or an actor built with "
                           "on_policy=True (JobConfig.derived.on_policy: ppo_epochs=1, one mini-batch)")
        if self.use_kl_loss:
            if "ref_log_prob" not in data.batch.keys():
                raise KeyError("use_kl_loss is on with kl_loss_coef != 0 but the batch has no 'ref_log_prob': "
                               "run compute_ref_log_prob first")
            keys.append("ref_log_prob")
        if "rollout_log_probs" in data.batch.keys():  # the engine's own log-probs: mismatch metrics
            keys.append("rollout_log_probs")
        if self.rollout_correction is not None and "rollout_log_probs" not in data.batch.keys():
            raise KeyError("algorithm.rollout_is_threshold is set but the batch has no 'rollout_log_probs' "
                           "(the engine's log-probs): the rollout must record them")
        batch = data.select(batch_keys=keys).batch
        if "response_mask" in data.batch.keys():
            batch["response_mask"] = data.batch["response_mask"]
        else:  # verl fallback: every real response token counts
            batch["response_mask"] = batch["attention_mask"][:, -batch["responses"].shape[-1]:]
        use_dynamic = bool(self.update.use_dynamic_bsz)
        policy_loss_fn = self._policy_loss_fn()
        metrics: dict[str, list | float] = defaultdict(list)
        optimizer_steps = skipped = non_finite_losses = 0
        progress = Progress("update")
        self.actor_module.train()
        for epoch in range(int(c.ppo_epochs)):
            epoch_batch = batch
            if c.shuffle:
                epoch_batch = batch[torch.randperm(batch.batch_size[0], generator=self._shuffle_gen)]
            minis = epoch_batch.split(mini_size)
            for mini_idx, mini in enumerate(minis):
                agg = global_loss_counts(mini["response_mask"], self.dp_group)
                micro_batches, _ = split_micro_batches(
                    mini, use_dynamic, self.update.micro_batch, self.update.max_token_len,
                    dp_group=self.dp_group, share_prefix=self.share_prefix)
                self.actor_optimizer.zero_grad(set_to_none=True)
                means, sums = TokenWeightedMeans(), defaultdict(float)
                for micro_idx, micro in enumerate(micro_batches):
                    progress(lambda: f"epoch {epoch + 1}/{c.ppo_epochs}, mini-batch {mini_idx + 1}/{len(minis)}, "
                                     f"micro-batch {micro_idx + 1}/{len(micro_batches)}")
                    micro = to_device(micro, self.device)
                    with HOST_MEMORY.phase("update/forward"):
                        loss, stats = self._micro_loss(micro, agg, policy_loss_fn)
                    non_finite_losses += not math.isfinite(loss.item())
                    last = micro_idx == len(micro_batches) - 1
                    if self.gather_once:   # resharded after the mini-batch's last backward, before the step
                        keep_gathered_after_backward(self.actor_module, not last)
                    if self.grad_sync_once:   # every rank has the same number of micro-batches (split_micro_batches)
                        sync_gradients(self.actor_module, last)
                    # activation checkpointing re-runs the forward here: same attention kernels
                    with HOST_MEMORY.phase("update/backward"), without_cudnn_attention(self.device):
                        loss.backward()
                    sums["pg_loss"] += stats.pop("pg_loss")
                    if "kl_loss" in stats:
                        sums["kl_loss"] += stats.pop("kl_loss")
                    means.add(micro["response_mask"].sum().item(), **stats)
                with HOST_MEMORY.phase("update/optimizer"):
                    grad_norm = clip_grad_and_step(self.actor_module, self.actor_optimizer, c.clip_norm, "actor")
                for k, v in {**sums, **means.means()}.items():
                    metrics[k if "/" in k else f"actor/{k}"].append(v)  # mismatch/* keep their prefix
                metrics["actor/grad_norm"].append(grad_norm)
                optimizer_steps += 1
                skipped += not math.isfinite(grad_norm)  # clip_grad_and_step skipped it
        # counts of this update (the same on every rank: the skip decision uses the global norm)
        metrics["actor/optimizer_steps"] = float(optimizer_steps)
        metrics["actor/skipped_optimizer_steps"] = float(skipped)
        metrics["actor/non_finite_losses"] = float(non_finite_losses)
        if self.use_kl_loss:  # inactive KL loss: actor/kl_loss and actor/kl_coef are not logged
            metrics["actor/kl_coef"] = float(c.kl_loss_coef)
        if self.on_policy and "actor/update_entropy" in metrics:
            # one mini-batch, one epoch: the update's only forward is π_old, so its entropy is the
            # rollout policy's (what the skipped old-log-prob pass would have reported)
            metrics["actor/entropy"] = list(metrics["actor/update_entropy"])
        return dict(metrics)
