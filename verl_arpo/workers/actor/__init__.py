"""PPO actor: log-probs and the policy update over a (possibly FSDP2-wrapped) HF causal LM."""

from verl_arpo.workers.actor.dp_actor import DataParallelPPOActor

__all__ = ["DataParallelPPOActor"]
