"""verl_arpo: VERL-style distributed RL for tool-using LLM agents (ARPO, AEPO on GRPO/PPO).

Dependencies run one way: protocol/utils <- algos (trainer/ppo/core_algos) <- tools, rewards, data
<- rollout <- workers <- trainer.
"""

__version__ = "0.1.0"
