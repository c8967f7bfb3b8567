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
    """Write `state_dict` as HF safetensors (`model.safetensors`, or shards + index); return files.

    Shards are written one at a time, so at most one shard is copied in memory.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    nbytes = {k: t.numel() * t.element_size() for k, t in state_dict.items()}
    groups, size = [[]], 0
    for key in state_dict:
        if groups[-1] and size + nbytes[key] > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes[key]
    n = len(groups)
    names = [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    names = names if n > 1 else ["model.safetensors"]
    for name, keys in zip(names, groups):
        shard, seen = {}, set()
        for k in keys:  # safetensors refuses tensors sharing storage: copy those
            t = state_dict[k].detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            shard[k] = t.clone() if ptr in seen else t
            seen.add(ptr)
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {k: name for name, keys in zip(names, groups) for k in sorted(keys)}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names
