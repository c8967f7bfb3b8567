"""verl_arpo: VERL-style distributed RL for tool-using LLM agents (ARPO, AEPO on GRPO/PPO).

Dependencies run one way: protocol/utils <- config <- algos <- tools, rewards, data <- rollout <- workers
<- trainer (tests/layers checks it; README.md, "Layout").
"""

import os as _os

__version__ = "0.1.0"

# transformers >= 5.25 requires the `kernels` package and, unless USE_HUB_KERNELS says otherwise,
# "kernelizes" every model it loads: on a GPU that fetches layer kernels from the Hugging Face Hub at
# run time (a download, and numerics that are no longer the ones the parity tests pin), and
# model.train() re-kernelizes for the model's device (it refuses the fake devices of
# tests/workers/test_device_placement.py). Off unless the user turns it on (USE_HUB_KERNELS=YES, also
# through ray_init.runtime_env.env_vars): docs/environment.md, `USE_HUB_KERNELS`.
_os.environ.setdefault("USE_HUB_KERNELS", "NO")
