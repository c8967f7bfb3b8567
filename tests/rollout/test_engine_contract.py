"""Pieces of the engine contract that need no engine: joining the two calls of a windowed round."""
from verl_arpo.workers.rollout.engines.base import GenOutput
from verl_arpo.workers.rollout.engines.vllm_engine import join_calls


def _out(tokenizer, text, reason="length", stop_str=None, stats=True):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return GenOutput(ids, reason, stop_str, [-0.5] * len(ids), [[-0.1, -0.5]] * len(ids) if stats else [[]] * len(ids),
                     None)


def test_the_second_calls_own_stop_is_kept(tiny_tokenizer):
    tok = tiny_tokenizer
    head = _out(tok, "<think> compute </think> <pyt")
    tail = _out(tok, "hon>print(1)</python>", reason="stop", stop_str="</python>", stats=False)
    got = join_calls(tok, ["</python>", "</search>"], head, tail)
    text = tok.decode(got.token_ids)
    assert got.finish_reason == "stop" and got.stop_str == "</python>"
    # the tail's own stop (after print(1)) is the first stop string completed
    assert text.endswith("</python>") and text.count("</python>") == 1
    assert len(got.logprobs) == len(got.token_ids) == len(got.topk_logprobs)
    assert got.topk_logprobs[:len(head.token_ids)] == head.topk_logprobs
    assert all(x == [] for x in got.topk_logprobs[len(head.token_ids):])


def test_a_straddling_stop_is_cut_at_its_last_token(tiny_tokenizer):
    tok = tiny_tokenizer
    head = _out(tok, "<think> look it up </think> <search> Veltmoor </sea")
    tail = _out(tok, "rch> trailing text that the second call kept", stats=False)
    got = join_calls(tok, ["</python>", "</search>"], head, tail)
    assert got.finish_reason == "stop" and got.stop_str == "</search>"
    assert tok.decode(got.token_ids).endswith("</search>")
    # one token fewer would not contain it: the cut is at the completing token
    assert "</search>" not in tok.decode(got.token_ids[:-1])


def test_no_stop_keeps_the_second_call(tiny_tokenizer):
    tok = tiny_tokenizer
    head, tail = _out(tok, "some words"), _out(tok, " and more", reason="eos", stats=False)
    got = join_calls(tok, ["</python>"], head, tail)
    assert got.token_ids == head.token_ids + tail.token_ids and got.finish_reason == "eos"
