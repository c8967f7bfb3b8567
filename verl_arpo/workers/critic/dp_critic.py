"""The data-parallel PPO critic: values of response positions and the clipped value update.

The critic module is an HF `AutoModelForTokenClassification` with num_labels=1 (Qwen2, Llama and
most decoder LMs provide it via transformers' GenericForTokenClassification: the base model plus a
`score` Linear head). V(s_t) of response slot t is logits[..., 0] at position −R−1+t, i.e. the
value of the state *before* the response token is emitted. Note that head applies a dropout
(config.classifier_dropout, default 0.1 for Qwen2) in train mode; the worker should load the
critic with classifier_dropout=0 as verl does, or value targets become noisy.

Micro-batching and loss scaling follow the actor (see dp_actor): the mini-batch's global counts,
summed over the data-parallel group, normalise every micro-batch, so fixed, token-budget and
data-parallel splits give the gradient of the same mini-batch objective
    vf_loss = ½ · agg_loss(max((V − R)², (clip(V, V_old ± c) − R)²), m).
core_algos.compute_value_loss aggregates with local counts; we rescale its result by
local_count / global_count · dp_size (exact, since agg_loss divides by that count).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

from verl_arpo.algos.core_algos import compute_value_loss
from verl_arpo.utils.device import without_cudnn_attention
from verl_arpo.config import Batching, CriticConfig
from verl_arpo.utils.seqlen_balancing import get_reverse_idx, split_micro_batches
from verl_arpo.utils.ulysses import SequenceParallel
from verl_arpo.workers.optim_step import clip_grad_and_step
from verl_arpo.workers.sharded_model import maybe_reshard, module_device, sync_gradients, to_device
from verl_arpo.workers.training_core import (TokenWeightedMeans,
    check_trainable_attention,
    global_loss_counts,
    packing_supported,
    response_forward,
    warn_if_dense_packing)
from verl_arpo.workers.sequence_parallel import use_sequence_parallel

__all__ = ["DataParallelPPOCritic"]

logger = logging.getLogger(__name__)


class DataParallelPPOCritic:
    """PPO critic over a (possibly FSDP2-wrapped) HF token-classification model (num_labels=1).

    config: the typed `critic` section (`CriticConfig`, or a mapping of its keys; absent keys take
    the YAML defaults), its keys in the user's units; packing follows `model.use_remove_padding`.
    update, values: how this rank splits its share of an update and of the value pass (`Batching`,
    from `JobConfig.derived.critic_update` / `.critic_values`). shuffle_seed seeds the mini-batch
    shuffle. dp_group: the data-parallel group of the loss and micro-batch counts (None = the default
    group; with `sp`, its dp group). sp: Ulysses sequence parallelism (critic.ulysses_sequence_parallel_size,
    as in the actor; needs model.use_remove_padding). device:
    where the forward runs (default: the module's); data comes and values go on the host, each
    micro-batch crossing to `device` just before its forward (`to_device`).
    """

    def __init__(self, config: CriticConfig | None, critic_module: torch.nn.Module, critic_optimizer=None,
                 *, update: Batching | None = None, values: Batching, shuffle_seed: int = 0, dp_group=None,
                 sp: SequenceParallel | None = None, device: torch.device | None = None):
        self.config: CriticConfig = config if config is not None else CriticConfig()
        self.update, self.values = update, values
        self.critic_module = critic_module
        self.device = device if device is not None else module_device(critic_module)
        self.critic_optimizer = critic_optimizer
        if critic_optimizer is not None:
            check_trainable_attention(critic_module, self.device, "critic.model")
        self.use_remove_padding = bool(self.config.model.use_remove_padding)
        # fsdp_config.grad_sync_once: one gradient reduce-scatter a mini-batch (sharded_model.sync_gradients)
        self.grad_sync_once = bool(self.config.model.fsdp_config.grad_sync_once)
        self.sp = use_sequence_parallel(critic_module, sp, self.use_remove_padding, "critic", "critic.model")
        self.dp_group = self.sp.dp_group if self.sp is not None else dp_group
        if self.sp is None and self.use_remove_padding:
            ok, why = packing_supported(critic_module)
            if not ok:
                logger.warning("critic use_remove_padding disabled: %s; using padded batches", why)
                self.use_remove_padding = False
        if self.use_remove_padding:
            warn_if_dense_packing(critic_module, self.device)
        self._shuffle_gen = torch.Generator().manual_seed(int(shuffle_seed))

    def _forward_micro_batch(self, micro) -> torch.Tensor:
        """V at the response slots [B, R] (0 at slots without a real token)."""
        r = micro["responses"].shape[-1]
        out = response_forward(self.critic_module, micro, r, self.use_remove_padding, causal_lm=False, sp=self.sp)
        return out.to_slots(out.logits[..., 0])

    def compute_values(self, data) -> torch.Tensor:
        """Values [B, R] × response_mask, in the input row order.

        Micro-batches as `values` says (the critic's micro size, forward_max_token_len_per_gpu).
        """
        use_dynamic, micro_size, max_len = self.values.use_dynamic_bsz, self.values.micro_batch, self.values.max_token_len
        batch = data.select(batch_keys=["responses", "input_ids", "attention_mask", "position_ids"]).batch
        micro_batches, groups = split_micro_batches(batch, use_dynamic, micro_size, max_len, dp_group=self.dp_group)
        self.critic_module.eval()
        with torch.no_grad():
            values = torch.cat([self._forward_micro_batch(to_device(m, self.device)).cpu() for m in micro_batches], dim=0)
        maybe_reshard(self.critic_module)
        order = [i for g in groups for i in g]
        if order != list(range(len(order))):
            values = values[torch.tensor(get_reverse_idx(order), device=values.device)]
        r = values.shape[-1]
        keys = data.batch.keys()
        mask = data.batch["response_mask"] if "response_mask" in keys else data.batch["attention_mask"][:, -r:]
        return values * mask.to(values.dtype)

    def update_critic(self, data) -> dict[str, list]:
        """`ppo_epochs` passes; one optimizer step per mini-batch. Metrics (one entry per
        mini-batch): critic/vf_loss (the mini-batch objective; under DP each rank's share × dp_size,
        whose mean over ranks is the objective), critic/vf_clipfrac and
        critic/vpred_mean (token means over the mini-batch), critic/grad_norm."""
        c = self.config
        if self.critic_optimizer is None or self.update is None:
            raise ValueError("update_critic needs an optimizer and the update's batching (DataParallelPPOCritic("
                             "critic_optimizer=..., update=JobConfig.derived.critic_update))")
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "values", "returns"]
        batch = data.select(batch_keys=keys).batch
        r = batch["responses"].shape[-1]
        batch["response_mask"] = (data.batch["response_mask"] if "response_mask" in data.batch.keys()
                                  else batch["attention_mask"][:, -r:])
        mode = c.loss_agg_mode
        cliprange_value = float(c.cliprange_value)
        use_dynamic = bool(self.update.use_dynamic_bsz)
        metrics: dict[str, list] = defaultdict(list)
        self.critic_module.train()
        for _ in range(int(c.ppo_epochs)):
            epoch_batch = batch
            if c.shuffle:
                epoch_batch = batch[torch.randperm(batch.batch_size[0], generator=self._shuffle_gen)]
            for mini in epoch_batch.split(int(self.update.mini_batch)):
                agg = global_loss_counts(mini["response_mask"], self.dp_group)
                micro_batches, _ = split_micro_batches(mini, use_dynamic, self.update.micro_batch,
                                                       self.update.max_token_len, dp_group=self.dp_group)
                self.critic_optimizer.zero_grad(set_to_none=True)
                means, vf_total = TokenWeightedMeans(), 0.0
                for micro_idx, micro in enumerate(micro_batches):
                    micro = to_device(micro, self.device)
                    if self.grad_sync_once:   # every rank has the same number of micro-batches (split_micro_batches)
                        sync_gradients(self.critic_module, micro_idx == len(micro_batches) - 1)
                    mask = micro["response_mask"]
                    vpreds = self._forward_micro_batch(micro)
                    vf_loss, clipfrac = compute_value_loss(vpreds, micro["returns"], micro["values"], mask,
                                                           cliprange_value=cliprange_value, loss_agg_mode=mode, **agg)
                    with without_cudnn_attention(self.device):   # checkpointing re-runs the forward here
                        vf_loss.backward()
                    vf_total += vf_loss.item()
                    n = mask.sum().clamp(min=1)
                    means.add(mask.sum().item(), vf_clipfrac=clipfrac.item(),
                              vpred_mean=((vpreds.detach() * mask).sum() / n).item())
                grad_norm = clip_grad_and_step(self.critic_module, self.critic_optimizer, c.grad_clip,
                                               "critic")
                metrics["critic/vf_loss"].append(vf_total)
                for k, v in means.means().items():
                    metrics[f"critic/{k}"].append(v)
                metrics["critic/grad_norm"].append(grad_norm)
        return dict(metrics)
