"""Grouped-query attention for one-token decode steps: the HF engine's attention on CPU.

Why: transformers' `sdpa` attention, given a padding mask (which a batched rollout always has),
first repeats every key/value head to the number of query heads (`repeat_kv`, a full copy of
the cache per layer per step) and then calls `scaled_dot_product_attention`, whose CPU kernel
is slow for a single query row in bf16. Measured on the quickstart's shape (150 rows, 300 cached
tokens, 9 query / 3 key-value heads, bf16, 2 threads): 57 ms per layer for repeat + sdpa against
2.4 ms for the grouped matmuls below (benchmarks/README.md, "rollout engine").

What it computes, per row b and query head h of group g = h // (H / H_kv):

    out[b, h] = softmax(q[b, h] · K[b, g]^T · scale + mask[b]) · V[b, g]

with masked positions at -inf, scores and softmax in float32, the two matmuls in the model's
dtype (as sdpa does). Prefill (more than one query token) goes to transformers' own sdpa
function unchanged: its kernel is the faster one there.

Registered under `NAME` in transformers' attention and mask registries, so a model loaded with
`attn_implementation=NAME` uses it; the HF engine picks it on CPU when no implementation is asked
for (docs/gpu.md: on GPUs the engine keeps sdpa or flash-attention).
"""

from __future__ import annotations

import torch

NAME = "verl_arpo_decode"


def grouped_decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-interface signature: query `[B, H, L, D]`, key/value
    `[B, H_kv, T, D]`, boolean or additive mask broadcastable to `[B, 1, L, T]`; returns
    `([B, L, H, D], None)`. Falls back to sdpa unless L == 1 and no dropout."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, L, D = query.shape
    H_kv = key.shape[1]
    if L != 1 or dropout or H % H_kv or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    r = H // H_kv
    scale = D ** -0.5 if scaling is None else scaling
    if key.dtype == torch.bfloat16:
        # The decode cache hands its keys and values as views of a buffer with room to grow (kv_room.py):
        # batch stride capacity·D, not T·D. The CPU's bf16 batched matmul runs such strides on a slower
        # path; copying them contiguous first costs less and gives the same bits. In fp32 the strided
        # matmul is the faster one (benchmarks/bench_decode_kernels.py, "the cache's layout";
        # docs/performance.md, "The decode attention's keys and values copied contiguous in bf16").
        key, value = key.contiguous(), value.contiguous()
    q = query.reshape(B, H_kv, r, D)                                   # heads of one group together
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, H_kv, r, T]
    if attention_mask is not None:
        m = attention_mask[:, :, -1:, :]                               # the one query row: [B, 1, 1, T]
        if m.dtype == torch.bool:
            scores = scores.masked_fill(~m, float("-inf"))
        else:
            scores = scores + m.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)                                   # [B, H_kv, r, D]
    return out.reshape(B, 1, H, D), None


def register() -> str:
    """Make `NAME` a valid `attn_implementation` (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, grouped_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
