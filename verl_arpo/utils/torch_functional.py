"""Small tensor helpers shared by the algorithms, the actor and the rollout (verl-compatible names).

Conventions: `mask` tensors hold 1 for positions that count and 0 elsewhere (any dtype); masked
statistics ignore masked positions entirely. Functions that cannot give a meaningful answer on an
empty mask (variance, whitening) raise `ValueError`; means return 0 there (a fully padded
micro-batch then contributes nothing instead of crashing a data-parallel step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "check_same_shape",
    "logprobs_from_logits",
    "entropy_from_logits",
    "entropy_from_logits_with_chunking",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "get_response_mask",
    "clip_by_value",
    "compute_position_id_with_mask",
    "pad_sequence_to_length",
    "pad_2d_list_to_length",
]


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the arguments when the given tensors differ in shape."""
    items = list(tensors.items())
    name0, t0 = items[0]
    for name, t in items[1:]:
        if tuple(t.shape) != tuple(t0.shape):
            raise ValueError(
                f"shape mismatch: `{name}` has shape {tuple(t.shape)} but `{name0}` has "
                f"{tuple(t0.shape)}; they must be equal"
            )


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True,
                         chunk_size: int = 2048, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[labels] = z_y − logsumexp(z) with z = logits / T, `chunk_size` rows at a
    time in float32 (T applied per chunk: no scaled copy of the logits either).

    logits: [..., V]; labels: [...] → [...] (float32). Only a chunk × V float32 temporary ever
    exists, forward and backward (`_ChunkedLogProb`): the gradient (onehot(y) − softmax(z))·g is
    written chunk by chunk into a tensor of the logits' dtype. For bf16 logits of 16k tokens over a
    152k vocabulary that is ~1.2 GB of temporaries at chunk 2048 instead of a 9.7 GB float32 copy
    kept for the backward (docs/gpu.md, "Logits memory"). (`inplace_backward` is accepted for verl
    compatibility.)
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"`labels` shape {tuple(labels.shape)} must equal `logits` shape without the vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    if chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be positive, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    out = _ChunkedLogProb.apply(flat, labels.reshape(-1), int(chunk_size), float(temperature))
    return out.view(labels.shape)


class _ChunkedLogProb(torch.autograd.Function):
    """z_y − logsumexp(z) per row, float32 chunks; saves the logits (no copy) and each row's logsumexp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk: int, temperature: float) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for i in range(0, logits.shape[0], chunk):
            z = logits[i:i + chunk].float()
            if temperature != 1.0:
                z = z / temperature
            lse[i:i + chunk] = torch.logsumexp(z, dim=-1)
            out[i:i + chunk] = z.gather(1, labels[i:i + chunk, None])[:, 0] - lse[i:i + chunk]
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk, ctx.temperature = chunk, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        in_place = grad.dtype == torch.float32  # then computed in the gradient's own memory: no temporary
        t = ctx.temperature
        for i in range(0, logits.shape[0], ctx.chunk):
            rows = slice(i, i + ctx.chunk)
            g = grad_out[rows, None].float() / t  # d(z/T)/dz = 1/T
            d = grad[rows] if in_place else torch.empty(grad[rows].shape, device=grad.device)
            if t != 1.0:
                torch.div(logits[rows].float(), t, out=d)
                d.sub_(lse[rows, None])
            else:
                torch.sub(logits[rows].float(), lse[rows, None], out=d)
            d.exp_().mul_(-g).scatter_add_(1, labels[rows, None], g)  # (onehot(y) − p)·g / T
            if not in_place:
                grad[rows] = d
        return grad, None, None, None


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy H = logsumexp(z) − Σ softmax(z)·z over the last dim. [..., V] → [...]."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048,
                                      temperature: float = 1.0) -> torch.Tensor:
    """`entropy_from_logits(logits / temperature)`, computed `chunk_size` rows at a time in float32.

    Bounds the temporary softmax to chunk_size × V floats (a 150k vocabulary over 16k tokens would
    otherwise need ~10 GB at once).
    """
    if chunk_size <= 0:
        raise ValueError(f"`chunk_size` must be positive, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start:start + chunk_size].float()
        out[start:start + chunk_size] = entropy_from_logits(z / temperature if temperature != 1.0 else z)
    return out.view(logits.shape[:-1])


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Σ values·mask (over `axis`, or everything). NaNs at masked positions do not leak in."""
    check_same_shape(values=values, mask=mask)
    valid = mask.bool()
    vals = torch.where(valid, values, torch.zeros_like(values))
    return vals.sum() if axis is None else vals.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask; 0 where the mask is empty (verl adds 1e-8 to the count instead)."""
    count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected when `unbiased`). Needs ≥ 2 valid entries
    when unbiased (≥ 1 otherwise); raises ValueError naming `mask` when there are fewer."""
    n = int(mask.sum().item())
    need = 2 if unbiased else 1
    if n < need:
        raise ValueError(f"`mask` selects {n} element(s); masked_var(unbiased={unbiased}) needs at least {need}")
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return var * n / (n - 1) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values − mean) / sqrt(var + 1e-8) with masked mean and unbiased masked variance.

    With shift_mean=False the mean is added back (scale only). Masked positions are transformed too
    (callers multiply by the mask when they need zeros there).
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def get_response_mask(response_id: torch.Tensor, eos_token: int | Sequence[int] = 2,
                      dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after. `eos_token` may be a list of ids.

    e.g. response [5, 7, EOS, 0, 0] → [1, 1, 1, 0, 0]; a row with no EOS is all ones.
    """
    eos = torch.as_tensor(list(eos_token) if isinstance(eos_token, Iterable) else [eos_token],
                          device=response_id.device)
    is_eos = torch.isin(response_id, eos).long()
    before_or_at_first = (is_eos.cumsum(dim=-1) - is_eos) == 0
    return before_or_at_first.to(dtype)


def clip_by_value(x: torch.Tensor, tensor_min, tensor_max) -> torch.Tensor:
    """Element-wise clamp where the bounds may be tensors (keeps gradient through the chosen side)."""
    return torch.minimum(torch.maximum(x, torch.as_tensor(tensor_min, dtype=x.dtype, device=x.device)),
                         torch.as_tensor(tensor_max, dtype=x.dtype, device=x.device))


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: cumsum(mask) − 1, clamped at 0."""
    return torch.clamp(torch.cumsum(mask, dim=-1) - 1, min=0)


def pad_sequence_to_length(tensors: torch.Tensor, max_seq_len: int, pad_token_id, left_pad: bool = False) -> torch.Tensor:
    """Pad the last dim of a 2-D tensor to `max_seq_len` (no-op when already that long)."""
    if tensors.shape[-1] >= max_seq_len:
        return tensors
    pad = (max_seq_len - tensors.shape[-1], 0) if left_pad else (0, max_seq_len - tensors.shape[-1])
    return F.pad(tensors, pad, "constant", pad_token_id)


def pad_2d_list_to_length(rows: Sequence[Sequence], pad_token_id, max_length: int | None = None,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Right-pad a list of lists to one tensor [len(rows), max(max_length, longest row)]."""
    width = max([len(r) for r in rows] + [0 if max_length is None else max_length])
    out = [list(r) + [pad_token_id] * (width - len(r)) for r in rows]
    return torch.tensor(out, dtype=dtype)
