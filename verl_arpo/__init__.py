"""verl_arpo: VERL-style distributed RL for tool-using LLM agents (ARPO, AEPO on GRPO/PPO).

Dependencies run one way: protocol/utils <- config <- algos <- tools, rewards, data <- rollout <- workers
<- trainer (tests/layers checks it; README.md, "Layout").
"""

__version__ = "0.1.0"
