"""Inference engines behind one interface (`base.InferenceEngine`): `hf` (our own batched decode
loop with a persistent per-trajectory KV cache; the CPU default) and `vllm` (imported lazily)."""

from verl_arpo.workers.rollout.engines.base import (
    ENGINE_NAMES,
    GenOutput,
    GenRequest,
    InferenceEngine,
    SamplingParams,
    build_engine,
)

__all__ = ["ENGINE_NAMES", "GenOutput", "GenRequest", "InferenceEngine", "SamplingParams",
           "build_engine"]
