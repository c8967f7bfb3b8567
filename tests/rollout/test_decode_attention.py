"""The HF engine's decode attention against transformers' sdpa (repeat_kv + scaled_dot_product_attention),
and the shared-prefix prefill against an engine that re-encodes everything."""

import pytest
import torch

from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
from verl_arpo.workers.rollout.engines import decode_attention
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine


class _Attn(torch.nn.Module):
    """What transformers' attention functions read from the module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _reference(q, k, v, mask):
    """Plain loop over heads: head h attends with key/value head h // (H / H_kv)."""
    B, H, L, D = q.shape
    r = H // k.shape[1]
    out = torch.empty(B, L, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = q[b, h].double() @ k[b, h // r].double().T / D ** 0.5
            if mask is not None:
                s = s.masked_fill(~mask[b, 0], float("-inf"))
            out[b, :, h] = torch.softmax(s, -1) @ v[b, h // r].double()
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_decode_step_matches_reference(dtype, tol, mask_kind):
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, T, D = 5, 6, 2, 23, 16
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k = torch.randn(B, H_kv, T, D, generator=g).to(dtype)
    v = torch.randn(B, H_kv, T, D, generator=g).to(dtype)
    keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
    for b, pad in enumerate([0, 3, 7, 1, 22]):      # left padding of each row
        keep[b, ..., :pad] = False
    mask = {"bool": keep, "none": None,
            "additive": torch.zeros(B, 1, 1, T).masked_fill(~keep, float("-inf")).to(dtype)}[mask_kind]
    got, _ = decode_attention.grouped_decode_attention(_Attn(H // H_kv), q, k, v, mask)
    want = _reference(q, k, v, keep if mask is not None else None)
    assert got.shape == (B, 1, H, D)
    assert torch.allclose(got.double(), want, atol=tol)


def test_prefill_is_transformers_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    got, _ = decode_attention.grouped_decode_attention(_Attn(2), q, k, v, mask)
    want, _ = sdpa_attention_forward(_Attn(2), q, k, v, mask)
    assert torch.equal(got, want)


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_on_cpu_uses_it_and_matches_a_full_reforward(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    eng = HFEngine(tiny_model_dir, tiny_tokenizer)
    assert eng.model.config._attn_implementation == decode_attention.NAME
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    prompts = [tiny_tokenizer.encode(t) for t in ["Who founded the town of Veltmoor?", "print(1)"]]
    outs = eng.generate([GenRequest(str(i), p, 10, [], SamplingParams(greedy=True))
                         for i, p in enumerate(prompts)])  # two rows: padded, masked decode steps
    for p, o in zip(prompts, outs):
        assert o.token_ids == _greedy(ref, p, 10)


def test_shared_prefix_is_encoded_once(tiny_model_dir, tiny_tokenizer):
    tok = tiny_tokenizer
    system = tok.encode("You are a careful assistant. Use <python> for arithmetic and <search> for facts. " * 2)
    questions = ["What is 12 * 13?", "Who founded Veltmoor?", "How tall is the tower of Brask?"]
    prompts = [system + tok.encode(q) for q in questions]
    sp = SamplingParams(temperature=1.0, logprobs_topk=2)
    reqs = [GenRequest(str(i), p, 12, [], sp, seed=i) for i, p in enumerate(prompts)]
    shared = HFEngine(tiny_model_dir, tok)
    plain = HFEngine(tiny_model_dir, tok, kv_cache=False)     # re-encodes every prompt in full
    got, want = shared.generate(reqs), plain.generate(reqs)
    from verl_arpo.workers.rollout.engines.base import common_prefix_len

    n = min(common_prefix_len(prompts[0], p) for p in prompts[1:])
    assert shared.stats["shared_prefix_tokens"] == n * (len(prompts) - 1)
    assert shared.stats["prefill_tokens"] == sum(len(p) for p in prompts) - n * (len(prompts) - 1)
    assert plain.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        for g_row, w_row in zip(g.topk_logprobs, w.topk_logprobs):
            assert g_row == pytest.approx(w_row, abs=1e-4)
    # a single fresh request has nobody to share with
    shared.reset_stats()
    shared.generate([GenRequest("x", prompts[0], 3, [], sp, seed=0)])
    assert shared.stats["shared_prefix_tokens"] == 0
