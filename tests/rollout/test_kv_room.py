"""The decode cache that appends into room set aside in advance (engines/kv_room.py).

It must hold exactly what concatenation holds (a plain `torch.cat` list in the test), reallocate
rarely, and leave the HF engine's outputs bit-identical to a cache that concatenates every step
(`kv_room=0`): tokens, log-probs, top-k and entropies, over rounds, branches and continuous batching.
"""

import pytest
import torch

from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
from verl_arpo.workers.rollout.engines.kv_room import PreallocatedLayer, preallocated_cache, select_cache_rows

TOOL_RESULT = " <result>\n7006652\n</result>"


def _kv(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)


def test_layer_holds_what_concatenation_holds_and_reallocates_once_per_room():
    layer = PreallocatedLayer(room=5)
    want_k, want_v = _kv(3, 7, 0)                   # a prefill of 7 positions
    layer.update(want_k, want_v)
    buffers = [layer._key_buf]                      # kept alive: no address is reused
    for step in range(12):                          # 12 decode steps of one position
        k, v = _kv(3, 1, step + 1)
        got_k, got_v = layer.update(k, v)
        want_k, want_v = torch.cat([want_k, k], -2), torch.cat([want_v, v], -2)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if layer._key_buf is not buffers[-1]:
            buffers.append(layer._key_buf)
    # 7 + 5 room fills after 5 steps, 12 + 5 after 10: two reallocations for 12 steps, not 12
    assert len(buffers) == 3
    assert layer.get_seq_length() == 19 and layer.keys.shape == (3, 2, 19, 4)

    # keep rows 2 and 0, drop the first 3 positions: one copy that keeps the spare room
    select_cache_rows(preallocated_cache([layer]), torch.tensor([2, 0]), first=3)
    assert torch.equal(layer.keys, want_k[[2, 0], :, 3:]) and torch.equal(layer.values, want_v[[2, 0], :, 3:])
    k, v = _kv(2, 1, 99)
    before = layer._key_buf
    layer.update(k, v)
    assert layer._key_buf is before                 # written into the room it kept
    assert torch.equal(layer.keys, torch.cat([want_k[[2, 0], :, 3:], k], -2))


def test_fill_left_pads_with_zeros_and_room_zero_concatenates_each_step():
    a_k, a_v = _kv(1, 3, 1)
    b_k, b_v = _kv(2, 5, 2)
    layer = PreallocatedLayer(room=0).fill([(a_k, a_v), None, (b_k, b_v)], length=5, extra=0,
                                           device=torch.device("cpu"))
    assert layer.keys.shape == (4, 2, 5, 4)
    assert torch.equal(layer.keys[0, :, 2:], a_k[0]) and not layer.keys[0, :, :2].any()
    assert not layer.keys[1].any() and not layer.values[1].any()      # the empty row: all padding
    assert torch.equal(layer.values[2:], b_v)
    buffers = [layer._key_buf]
    for step in range(3):
        layer.update(*_kv(4, 1, 10 + step))
        buffers.append(layer._key_buf)
    assert len({id(b) for b in buffers}) == 4        # room 0: a new buffer every step, as torch.cat


def test_a_replaced_keys_tensor_is_taken_over():
    """Code that assigns `keys` itself (transformers' batch_select_indices) leaves the buffer stale:
    the next update starts from the assigned tensor."""
    layer = PreallocatedLayer(room=4)
    k, v = _kv(3, 4, 0)
    layer.update(k, v)
    layer.batch_select_indices(torch.tensor([1]))
    k2, v2 = _kv(1, 1, 1)
    got_k, _ = layer.update(k2, v2)
    assert torch.equal(got_k, torch.cat([k[[1]], k2], -2))


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _rounds(eng, tok, prompts, continuous: bool):
    """Three rounds: fresh prompts (shared prefix), then each continues after a tool result with a
    branch of it; round 2 runs through continuous batching when asked (rows join mid-decode)."""
    sp = SamplingParams(temperature=1.0, logprobs_topk=4, full_entropy=True)
    reqs = [GenRequest(str(i), list(p), 10 + 3 * i, [], sp, seed=i) for i, p in enumerate(prompts)]
    outs = eng.generate(reqs)
    nxt = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ctx = list(p) + o.token_ids + tok.encode(TOOL_RESULT)
        nxt += [GenRequest(str(i), ctx, 8, [], sp, seed=10 + i),
                GenRequest(f"{i}b", ctx, 8, [], sp, seed=20 + i, parent_id=str(i))]
    if continuous:
        eng.add_requests(nxt[:2])
        got, steps = {}, 0
        while eng.has_unfinished():
            got.update((r.request_id, o) for r, o in eng.step())
            steps += 1
            if steps == 3:
                eng.add_requests(nxt[2:])
        outs2 = [got[r.request_id] for r in nxt]
    else:
        outs2 = eng.generate(nxt)
    return [(o.token_ids, o.logprobs, o.topk_logprobs, o.entropy) for o in outs + outs2]


@pytest.mark.parametrize("continuous", [False, True])
def test_engine_outputs_are_bit_identical_to_a_concatenating_cache(model, tiny_tokenizer, continuous):
    system = "You answer with tools: <python> code </python> runs Python, <search> q </search> searches. "
    texts = [system + "<think> I need to compute 1234 * 5678 with python. </think> <python>",
             system + "Who founded the town of Veltmoor?",
             system + "print(sum(x))"]
    prompts = [tiny_tokenizer.encode(t) for t in texts]
    plain = _rounds(HFEngine(model, tiny_tokenizer, kv_room=0), tiny_tokenizer, prompts, continuous)
    roomy = HFEngine(model, tiny_tokenizer)
    got = _rounds(roomy, tiny_tokenizer, prompts, continuous)
    assert roomy.kv_room > 0 and roomy.stats["shared_prefix_tokens"] > 0
    assert got == plain            # exact: the same values reach the same kernels


@pytest.mark.parametrize("mask_row", [[0, 0, 1, 1, 1, 1, 1],    # one run of real positions
                                      [0, 1, 1, 0, 0, 1, 1],    # padding in the middle (merged prefills)
                                      [1, 1, 1, 1, 1, 1, 1]])
def test_a_finished_rows_kv_is_a_copy_of_its_real_positions(model, tiny_tokenizer, mask_row):
    """`_extract` against the boolean selection of the row's real positions (a plain reference), and
    a copy: the stored entry neither changes with the batch's buffer nor keeps it alive."""
    from types import SimpleNamespace

    from verl_arpo.workers.rollout.engines.hf_requests import Batch

    layers = [SimpleNamespace(keys=_kv(3, 7, s)[0], values=_kv(3, 7, s)[1]) for s in (1, 2)]
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1], mask_row, [1, 0, 1, 0, 1, 0, 1]])
    batch = Batch([], SimpleNamespace(layers=layers), mask, torch.zeros(3, dtype=torch.long))
    eng = HFEngine(model, tiny_tokenizer)
    n = sum(mask_row)
    kv = eng._extract(batch, 1, list(range(n)))
    for layer, k, v in zip(layers, kv.keys, kv.values):
        sel = mask[1].bool()
        assert torch.equal(k, layer.keys[1][:, sel]) and torch.equal(v, layer.values[1][:, sel])
        assert k.untyped_storage().data_ptr() != layer.keys.untyped_storage().data_ptr()
    want = kv.keys[0].clone()
    layers[0].keys.zero_()
    assert torch.equal(kv.keys[0], want)
    with pytest.raises(RuntimeError, match="internal error"):
        eng._extract(batch, 1, list(range(n + 1)))
