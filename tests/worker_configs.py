"""The one helper for tests that build an actor or critic by hand (no trainer): the typed section from
keyword overrides, and the per-worker batching a run derives (`JobConfig.derived`) for one worker and
rollout.n = 1, so that the section's batch sizes are the worker's own."""
from __future__ import annotations

from verl_arpo.utils.job_config import ActorConfig, Batching, CriticConfig, from_mapping, kl_term_active


def actor_kwargs(**keys) -> dict:
    """`DataParallelPPOActor(**actor_kwargs(...), actor_module=..., ...)`: config, update, use_kl_loss."""
    cfg = from_mapping(ActorConfig, keys, "actor_rollout_ref.actor")
    return dict(config=cfg, update=Batching.for_update(cfg, 1, 1),
                use_kl_loss=kl_term_active(cfg.use_kl_loss, cfg.kl_loss_coef))


def critic_kwargs(**keys) -> dict:
    """`DataParallelPPOCritic(**critic_kwargs(...), critic_module=..., ...)`: config, update, values."""
    cfg = from_mapping(CriticConfig, keys, "critic")
    return dict(config=cfg, update=Batching.for_update(cfg, 1, 1), values=Batching.for_values(cfg, 1))


def log_probs(micro_batch: int = 8, use_dynamic_bsz: bool = False, max_token_len: int = 16384) -> Batching:
    """A log-prob pass's micro-batching (the YAML's log_prob_* defaults)."""
    return Batching(micro_batch=micro_batch, use_dynamic_bsz=use_dynamic_bsz, max_token_len=max_token_len)
