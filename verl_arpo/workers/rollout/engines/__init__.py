"""Inference engines behind one interface (`base.InferenceEngine`): `hf` (our own batched decode
loop with a persistent per-trajectory KV cache; the CPU default) and `vllm` (imported lazily).
`build_engine` lives here, above the engines, so no engine module imports a factory that imports it."""

from verl_arpo.workers.rollout.engines.base import (
    ENGINE_NAMES,
    GenOutput,
    GenRequest,
    InferenceEngine,
    SamplingParams,
)

__all__ = ["ENGINE_NAMES", "GenOutput", "GenRequest", "InferenceEngine", "SamplingParams",
           "build_engine"]


def build_engine(name: str, model_path_or_module, tokenizer, **cfg) -> InferenceEngine:
    """Build the engine selected by `actor_rollout_ref.rollout.name` ("hf" or "vllm").

    `cfg` is passed to the engine's constructor (see `HFEngine` / `VLLMEngine`).
    """
    if name == "hf":
        from verl_arpo.workers.rollout.engines.hf_engine import HFEngine

        return HFEngine(model_path_or_module, tokenizer, **cfg)
    if name == "vllm":
        from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine

        if not isinstance(model_path_or_module, str):
            raise ValueError(
                "actor_rollout_ref.rollout.name=vllm needs a model path (vLLM loads its own copy of "
                f"the weights), got {type(model_path_or_module).__name__}"
            )
        return VLLMEngine(model_path_or_module, tokenizer, **cfg)
    raise ValueError(
        f"unknown inference engine actor_rollout_ref.rollout.name={name!r}; choose one of "
        f"{list(ENGINE_NAMES)}"
    )
