"""PPO critic: values and the clipped value update over an HF token-classification model."""

from verl_arpo.workers.critic.dp_critic import DataParallelPPOCritic

__all__ = ["DataParallelPPOCritic"]
