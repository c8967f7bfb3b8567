"""The in-place KV cache (engines/hf_cache.py): the same numbers as transformers' torch.cat cache,
bit for bit, with one position copied per decode step instead of the whole cache."""

import pytest
import torch

from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
from verl_arpo.workers.rollout.engines.hf_cache import MIN_SPARE, grow_in_place
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine, kv_cache_arg as ARG

TOOL = " <result>\n7006652\n</result>"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["<think> I need to compute 1234 * 5678 with python. </think> <python>",
             "Who founded the town of Veltmoor?", "print(sum(x))",
             "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris.",
             "Who founded the town of Veltmoor? Search first."]
    return [tiny_tokenizer.encode(t) for t in texts]


def _engine(model, tok, in_place: bool) -> HFEngine:
    eng = HFEngine(model, tok, max_batch_size=3)   # 5 rows: two groups, rows leave at different steps
    eng.grow_kv_in_place = in_place
    return eng


def _rounds(eng, tok, prompts):
    """Three rounds of generate -> tool result, a branch from row 0 in round 2, sampled and greedy
    rows with different budgets; returns every output's numbers."""
    sp = SamplingParams(temperature=1.0, logprobs_topk=3, full_entropy=True)
    greedy = SamplingParams(greedy=True, logprobs_topk=3)
    ctx = {str(i): list(p) for i, p in enumerate(prompts)}
    out = []
    for rnd in range(3):
        reqs = [GenRequest(rid, ids, 6 + 5 * (int(rid) % 3), [], sp if int(rid) % 2 else greedy,
                           seed=10 * rnd + int(rid)) for rid, ids in ctx.items()]
        if rnd == 1:
            reqs.append(GenRequest("0b", list(ctx["0"]), 9, [], sp, seed=99, parent_id="0"))
        for r, o in zip(reqs, eng.generate(reqs)):
            out.append((r.request_id, o.token_ids, o.logprobs, o.topk_logprobs, o.entropy, o.finish_reason))
            if r.request_id in ctx:
                ctx[r.request_id] += o.token_ids + tok.encode(TOOL)
    return out


def test_generate_is_bit_identical_to_the_cat_cache(model, tiny_tokenizer, prompts):
    got = _rounds(_engine(model, tiny_tokenizer, True), tiny_tokenizer, prompts)
    want = _rounds(_engine(model, tiny_tokenizer, False), tiny_tokenizer, prompts)
    assert len(got) == len(want) == 16
    assert got == want   # exact float equality: the arithmetic is unchanged


def test_continuous_batching_is_bit_identical_to_the_cat_cache(model, tiny_tokenizer, prompts):
    sp = SamplingParams(temperature=1.0, logprobs_topk=2, full_entropy=True)

    def run(in_place):
        eng = _engine(model, tiny_tokenizer, in_place)
        eng.max_batch_size = 8
        reqs = [GenRequest(str(i), list(p), 5 + 4 * i, [], sp, seed=i) for i, p in enumerate(prompts)]
        eng.add_requests(reqs[:2])
        got, steps = {}, 0
        while eng.has_unfinished():
            got.update((r.request_id, (o.token_ids, o.logprobs, o.entropy)) for r, o in eng.step())
            steps += 1
            if steps == 3:
                eng.add_requests(reqs[2:])   # merged into a running batch
        return got

    assert run(True) == run(False)


def test_a_decode_step_writes_in_place_and_the_buffer_grows_by_a_quarter(model, tiny_tokenizer, prompts):
    from transformers import DynamicCache

    cache = grow_in_place(DynamicCache())
    ids = torch.tensor([prompts[1]])
    model(input_ids=ids, use_cache=True, **{ARG(model): cache})
    layer = cache.layers[0]
    n = ids.shape[1]
    assert type(layer).__name__ == "GrowingLayer" and layer.keys.shape[2] == n
    assert layer._kbuf.shape[2] == n + max(MIN_SPARE, n // 4)
    buf_ptr = layer._kbuf.data_ptr()
    keys_before = layer.keys.clone()
    for step in range(MIN_SPARE):   # fills the spare exactly: no reallocation
        model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[n + step]]), use_cache=True,
              **{ARG(model): cache})
    assert layer._kbuf.data_ptr() == buf_ptr and layer.keys.shape[2] == n + MIN_SPARE
    assert torch.equal(layer.keys[:, :, :n], keys_before)   # earlier positions untouched
    model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[n + MIN_SPARE]]), use_cache=True,
          **{ARG(model): cache})   # one past the spare: a new buffer
    m = n + MIN_SPARE + 1
    assert layer._kbuf.data_ptr() != buf_ptr and layer._kbuf.shape[2] == m + max(MIN_SPARE, m // 4)
    assert torch.equal(layer.keys[:, :, :n], keys_before)


def test_row_selection_and_a_column_cut_keep_the_right_numbers():
    """What the engine does between steps (rows leave, all-padding columns are cut) against the same
    operations on plain tensors."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    K, V = torch.randn(4, 2, 7, 3, generator=g), torch.randn(4, 2, 7, 3, generator=g)
    cache = grow_in_place(DynamicCache([(K, V)]))
    step = lambda: (torch.randn(cache.layers[0].keys.shape[0], 2, 1, 3, generator=g),) * 2  # noqa: E731
    k1, v1 = step()
    cache.update(k1, v1, 0)
    ref_k = torch.cat([K, k1], 2)
    layer = cache.layers[0]
    cache.batch_select_indices(torch.tensor([0, 2]))
    ref_k = ref_k[[0, 2]]
    assert torch.equal(layer.keys, ref_k)
    layer.keys, layer.values = layer.keys[:, :, 3:], layer.values[:, :, 3:]   # the engine's column cut
    ref_k = ref_k[:, :, 3:]
    buf = layer._kbuf.data_ptr()
    k2, v2 = step()
    keys, _ = cache.update(k2, v2, 0)
    ref_k = torch.cat([ref_k, k2], 2)
    assert torch.equal(keys, ref_k) and layer._kbuf.data_ptr() == buf   # written at the cut's offset
    layer.keys = layer.keys.clone()   # replaced by another tensor (a merge): adopted again
    k3, v3 = step()
    keys, values = cache.update(k3, v3, 0)
    assert torch.equal(keys, torch.cat([ref_k, k3], 2)) and layer._kbuf.data_ptr() != buf
    assert values.shape == keys.shape
