"""torch_functional helpers against direct definitions computed in the test."""
import math

import pytest
import torch

from verl_arpo.utils import torch_functional as F


def test_logprobs_and_entropy_match_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    lp = F.logprobs_from_logits(logits, labels)
    for b in range(3):
        for t in range(5):
            z = logits[b, t].tolist()
            lse = math.log(sum(math.exp(x) for x in z))
            assert lp[b, t].item() == pytest.approx(z[labels[b, t]] - lse, abs=1e-5)
            p = [math.exp(x - lse) for x in z]
            h = -sum(pi * math.log(pi) for pi in p)
            assert F.entropy_from_logits(logits)[b, t].item() == pytest.approx(h, abs=1e-5)
    chunked = F.entropy_from_logits_with_chunking(logits, chunk_size=4)
    assert torch.allclose(chunked, F.entropy_from_logits(logits), atol=1e-6)
    hot = F.entropy_from_logits_with_chunking(logits, chunk_size=4, temperature=0.5)
    assert torch.allclose(hot, F.entropy_from_logits(logits / 0.5), atol=1e-6)
    with pytest.raises(ValueError, match="labels"):
        F.logprobs_from_logits(logits, labels[:, :2])


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float32, 0.7),
                                               (torch.bfloat16, 1.3)])
def test_chunked_logprobs_value_and_gradient_equal_log_softmax(dtype, temperature):
    """The chunked custom backward against autograd through a plain float32 log_softmax(z / T)."""
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(7, 13, 37, generator=g)).to(dtype)
    labels = torch.randint(0, 37, (7, 13), generator=g)
    weights = torch.randn(7, 13, generator=g)
    ours = logits.clone().requires_grad_(True)
    ref = logits.clone().requires_grad_(True)
    lp = F.logprobs_from_logits(ours, labels, chunk_size=5, temperature=temperature)  # 19 chunks, the last short
    want = torch.log_softmax(ref.float() / temperature, dim=-1).gather(-1, labels[..., None])[..., 0]
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)
    (lp * weights).sum().backward()
    (want * weights).sum().backward()
    assert ours.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.grad.float(), ref.grad.float(), rtol=0, atol=tol)


def test_masked_stats():
    v = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert F.masked_sum(v, m).item() == 10.0  # the NaN is masked out
    assert F.masked_mean(v, m).item() == 2.5
    assert F.masked_mean(v, m, axis=-1).tolist() == [1.5, 3.5]
    assert F.masked_var(v, m).item() == pytest.approx(((1.5 ** 2) * 2 + 0.25 * 2) / 3)
    assert F.masked_var(v, m, unbiased=False).item() == pytest.approx(((1.5 ** 2) * 2 + 0.25 * 2) / 4)
    w = F.masked_whiten(v, m)
    sel = w[m.bool()]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert sel.std().item() == pytest.approx(1.0, abs=1e-4)
    assert F.masked_mean(v, torch.zeros_like(m)).item() == 0.0
    with pytest.raises(ValueError, match="mask"):
        F.masked_var(v, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="mask"):
        F.masked_whiten(v, torch.zeros_like(m))
    with pytest.raises(ValueError, match="shape mismatch"):
        F.masked_mean(v, m[:, :2])


def test_get_response_mask():
    r = torch.tensor([[5, 7, 2, 0, 2], [2, 5, 5, 5, 5], [5, 5, 5, 5, 5], [5, 9, 5, 2, 0]])
    assert F.get_response_mask(r, eos_token=2).tolist() == [
        [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert F.get_response_mask(r, eos_token=[2, 9]).tolist()[3] == [1, 1, 0, 0, 0]


def test_position_ids_and_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert F.compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]
    assert F.pad_sequence_to_length(torch.tensor([[1, 2]]), 4, 0, left_pad=True).tolist() == [[0, 0, 1, 2]]
    assert F.pad_2d_list_to_length([[1], [2, 3]], 0, max_length=3).tolist() == [[1, 0, 0], [2, 3, 0]]
