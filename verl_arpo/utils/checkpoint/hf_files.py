"""Hugging Face weight files: the keys a tied model stores twice, and sharded safetensors."""

from __future__ import annotations

import json
import os

import torch

def tied_duplicate_keys(state_dict: dict, config) -> list[str]:
    """Keys HF does not store because they are tied to another (the LM head of tied models)."""
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (getattr(text_cfg, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)):
        return []
    out = []
    for head in [k for k in state_dict if k.endswith("lm_head.weight")]:
        emb = head[: -len("lm_head.weight")] + "model.embed_tokens.weight"
        if emb in state_dict and torch.equal(state_dict[head], state_dict[emb]):
            out.append(head)
    return out


def save_hf_safetensors(state_dict: dict, out_dir: str, max_shard_size: int = 5 * 1024**3) -> list[str]:
    """Write `state_dict` as HF safetensors (`model.safetensors`, or shards + index); return the
    weight files. `huggingface_hub.save_torch_state_dict` does the work: shards written one at a
    time (at most one shard copied in memory), tensors that share storage stored once."""
    from huggingface_hub import save_torch_state_dict

    os.makedirs(out_dir, exist_ok=True)
    state = {k: t.detach().to("cpu") for k, t in state_dict.items()}
    save_torch_state_dict(state, out_dir, max_shard_size=max_shard_size, metadata={"format": "pt"})
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]
