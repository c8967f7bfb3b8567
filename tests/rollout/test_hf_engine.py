"""HFEngine invariants on the offline tiny model: it must agree with a plain full re-forward."""

import pytest
import torch

from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams, build_engine
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine, _why_no_kv_reuse

TOL = 1e-4
GREEDY = SamplingParams(greedy=True, logprobs_topk=5)
TOOL_RESULT = " <result>\n7006652\n</result>"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["<think> I need to compute 1234 * 5678 with python. </think> <python>",
             "Who founded the town of Veltmoor?",
             "print(sum(x))",
             "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris."]
    return [tiny_tokenizer.encode(t) for t in texts]


def engine(model, tok, **kw):
    return HFEngine(model, tok, **kw)


def req(rid, ids, n, sampling=GREEDY, stop=(), **kw):
    return GenRequest(rid, list(ids), n, list(stop), sampling, **kw)


@torch.no_grad()
def reforward_logp(model, prompt, gen, temperature=1.0):
    """log softmax(logits / T) at the positions that predicted `gen`, from one full forward."""
    ids = torch.tensor([list(prompt) + list(gen)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


@torch.no_grad()
def reference_greedy(model, prompt, n):
    """Argmax with a full re-forward of the whole sequence every step (no cache, no padding)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_equals_reference_loop(model, tiny_tokenizer, prompts):
    out = engine(model, tiny_tokenizer).generate([req("a", prompts[0], 12)])[0]
    assert out.token_ids == reference_greedy(model, prompts[0], 12)
    assert out.finish_reason == "length" and out.stop_str is None
    logp = reforward_logp(model, prompts[0], out.token_ids)
    want = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=TOL)
    assert torch.allclose(torch.tensor(out.topk_logprobs), logp.topk(5).values, atol=TOL)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 20, 0.9)])
def test_sampled_logprobs_and_entropy_equal_reforward(model, tiny_tokenizer, prompts,
                                                      temperature, top_k, top_p):
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, logprobs_topk=3)
    out = engine(model, tiny_tokenizer).generate([req("a", prompts[1], 16, sp, seed=5)])[0]
    logp = reforward_logp(model, prompts[1], out.token_ids, temperature)
    tok = torch.tensor(out.token_ids)
    assert torch.allclose(torch.tensor(out.logprobs), logp.gather(1, tok[:, None])[:, 0], atol=TOL)
    ent = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(torch.tensor(out.entropy), ent, atol=TOL)
    top = logp.topk(3)
    for row, vals, ids, t, lp in zip(out.topk_logprobs, top.values, top.indices, out.token_ids, out.logprobs):
        # the top 3, then the sampled token's log-prob when it is not among them
        want = vals.tolist() + ([] if t in ids.tolist() else [lp])
        assert row == pytest.approx(want, abs=TOL)
    if top_k > 0:  # every drawn token lies inside the truncated support
        ranks = (logp > logp.gather(1, tok[:, None])).sum(-1)
        assert int(ranks.max()) < top_k


def _first_hit(tok, gen, stop):
    """Index of the token whose decoding first contains `stop` (a plain reference)."""
    for j in range(len(gen)):
        if stop in tok.decode(gen[:j + 1]):
            return j
    return None


def test_stop_strings_truncate_after_completing_token(model, tiny_tokenizer, prompts):
    tok = tiny_tokenizer
    sp = SamplingParams(temperature=1.0)
    eng = engine(model, tok)
    free = eng.generate([req("a", prompts[0], 40, sp, seed=11)])[0].token_ids
    pieces = [tok.decode([t]) for t in free]
    # A stop string straddling two tokens: the last 2 chars of token 5 + first 2 chars of token 6.
    j = next(i for i in range(5, 30) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    straddle = pieces[j][-2:] + pieces[j + 1][:2]
    for stop in [straddle, pieces[j + 1]]:
        out = eng.generate([req("a", prompts[0], 40, sp, stop=["</never>", stop], seed=11)])[0]
        hit = _first_hit(tok, free, stop)
        assert out.finish_reason == "stop" and out.stop_str == stop
        assert out.token_ids == free[:hit + 1]
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
        assert len(out.logprobs) == len(out.topk_logprobs) == len(out.entropy) == hit + 1


def test_per_sequence_max_new_tokens(model, tiny_tokenizer, prompts):
    budgets = [3, 9, 1, 0]
    outs = engine(model, tiny_tokenizer).generate(
        [req(str(i), prompts[i], n) for i, n in enumerate(budgets)])
    assert [len(o.token_ids) for o in outs] == budgets
    assert all(o.finish_reason == "length" for o in outs)


def test_eos_finish_includes_eos(model, tiny_tokenizer, prompts):
    eng = engine(model, tiny_tokenizer)
    assert tiny_tokenizer.eos_token_id in eng.eos_token_ids
    free = eng.generate([req("a", prompts[2], 20, SamplingParams(), seed=3)])[0]
    eng.eos_token_ids = [free.token_ids[6]]   # pretend this token is EOS
    out = eng.generate([req("a", prompts[2], 20, SamplingParams(), seed=3)])[0]
    k = free.token_ids.index(free.token_ids[6])
    assert out.finish_reason == "eos" and out.stop_str is None
    assert out.token_ids == free.token_ids[:k + 1]
    assert out.logprobs == pytest.approx(free.logprobs[:k + 1], abs=TOL)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_batched_equals_unbatched_greedy(model, tiny_tokenizer, prompts, kv_cache):
    eng = engine(model, tiny_tokenizer, kv_cache=kv_cache)
    budgets = [10, 4, 14, 7]
    batched = eng.generate([req(str(i), p, n) for i, (p, n) in enumerate(zip(prompts, budgets))])
    eng.release()
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        alone = eng.generate([req(str(i), p, n)])[0]
        assert batched[i].token_ids == alone.token_ids
        assert batched[i].logprobs == pytest.approx(alone.logprobs, abs=TOL)
        assert batched[i].entropy == pytest.approx(alone.entropy, abs=TOL)


def _three_rounds(eng, tok, prompts, budgets, tool_texts, sampling=GREEDY):
    """generate -> append tool result -> generate -> ... ; returns every round's outputs."""
    ctx = {str(i): list(p) for i, p in enumerate(prompts)}
    rounds = []
    for rnd in range(3):
        outs = eng.generate([req(rid, ids, budgets[int(rid)], sampling, seed=100 + int(rid))
                             for rid, ids in ctx.items()])
        rounds.append(outs)
        for (rid, ids), o in zip(ctx.items(), outs):
            ids += o.token_ids + tok.encode(tool_texts[(int(rid) + rnd) % len(tool_texts)])
    return rounds, ctx


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, logprobs_topk=2)])
def test_kv_cache_equals_reencode_over_three_rounds(model, tiny_tokenizer, prompts, sampling):
    tools = [TOOL_RESULT, " <result>\nPage 1: Veltmoor: founded in 1832 by Ada Quill.\n</result>",
             " <result>\nError: timeout\n</result>"]
    budgets = [8, 13, 5, 10]   # rows leave the batch at different steps
    kv = engine(model, tiny_tokenizer, kv_cache=True)
    ref = engine(model, tiny_tokenizer, kv_cache=False)
    got, ctx_kv = _three_rounds(kv, tiny_tokenizer, prompts, budgets, tools, sampling)
    want, ctx_ref = _three_rounds(ref, tiny_tokenizer, prompts, budgets, tools, sampling)
    assert ctx_kv == ctx_ref
    for g_round, w_round in zip(got, want):
        for g, w in zip(g_round, w_round):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)
            assert [len(r) for r in g.topk_logprobs] == [len(r) for r in w.topk_logprobs]
            for g_row, w_row in zip(g.topk_logprobs, w.topk_logprobs):
                assert g_row == pytest.approx(w_row, abs=TOL)
    assert kv.stats["reused_tokens"] > 0 and ref.stats["reused_tokens"] == 0
    assert kv.stats["prefill_tokens"] < ref.stats["prefill_tokens"] / 2
    assert kv.cached_tokens() > 0
    kv.release(["0", "1"])
    kv.release()
    assert kv.cached_tokens() == 0


def test_the_kv_cache_goes_by_the_name_the_model_forward_takes(model, tiny_tokenizer, prompts):
    """transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, and is removed in
    5.40): the engine passes the name this model's forward declares, so three rounds of cached
    decoding raise no deprecation warning and still reuse the cache."""
    import inspect
    import warnings

    declared = inspect.signature(model.forward).parameters
    want = "cache" if "cache" in declared else "past_key_values"
    eng = engine(model, tiny_tokenizer, kv_cache=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _three_rounds(eng, tiny_tokenizer, prompts, [6, 9, 4, 7], [TOOL_RESULT])
    renamed = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert renamed == []
    assert eng._cache_arg == want and eng.stats["reused_tokens"] > 0


def test_branch_from_parent_equals_fresh(model, tiny_tokenizer, prompts):
    eng = engine(model, tiny_tokenizer)
    first = eng.generate([req("p", prompts[0], 9)])[0]
    ctx = list(prompts[0]) + first.token_ids + tiny_tokenizer.encode(TOOL_RESULT)
    eng.reset_stats()
    # parent and branch continue in the same call, the branch from the parent's cache
    sp = SamplingParams(temperature=1.0)
    parent, child = eng.generate([req("p", ctx, 8, sp, seed=1), req("c", ctx, 8, sp, seed=2,
                                                                    parent_id="p")])
    assert eng.stats["reused_tokens"] == 2 * (len(prompts[0]) + len(first.token_ids) - 1)
    fresh = engine(model, tiny_tokenizer)
    want_p, want_c = fresh.generate([req("x", ctx, 8, sp, seed=1), req("y", ctx, 8, sp, seed=2)])
    assert parent.token_ids == want_p.token_ids and child.token_ids == want_c.token_ids
    assert child.logprobs == pytest.approx(want_c.logprobs, abs=TOL)


def test_mixed_fresh_continuing_and_branch_rows(model, tiny_tokenizer, prompts):
    """The ARPO round shape: continuing rows (short suffix), a branch, and a fresh long prompt in
    one call; prefill is split by suffix length and the rows are re-padded for decoding."""
    tok = tiny_tokenizer
    kv, ref = engine(model, tok), engine(model, tok, kv_cache=False)
    sp = SamplingParams(temperature=1.0, logprobs_topk=0)
    first = [kv.generate([req(str(i), prompts[i], 6 + i, sp, seed=i)])[0] for i in range(3)]
    ctx = [list(prompts[i]) + first[i].token_ids + tok.encode(TOOL_RESULT) for i in range(3)]
    long_prompt = prompts[3] * 4
    reqs = [req(str(i), ctx[i], 9, sp, seed=10 + i) for i in range(3)]
    reqs += [req("b1", ctx[1], 7, sp, seed=20, parent_id="1"), req("new", long_prompt, 5, sp, seed=3)]
    got = kv.generate(reqs)
    want = ref.generate(reqs)
    assert kv.stats["prefill_calls"] >= 2
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.topk_logprobs == [[]] * len(g.token_ids)
        assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)
        assert g.entropy == pytest.approx(w.entropy, abs=TOL)


def test_wrong_prefix_falls_back(model, tiny_tokenizer, prompts):
    eng = engine(model, tiny_tokenizer)
    first = eng.generate([req("a", prompts[3], 6)])[0]
    ctx = list(prompts[3]) + first.token_ids
    ctx[4] = (ctx[4] + 1) % len(tiny_tokenizer)   # the "same" trajectory, edited in the middle
    eng.reset_stats()
    out = eng.generate([req("a", ctx, 10)])[0]
    assert eng.stats["prefix_mismatches"] == 1 and eng.stats["reused_tokens"] == 4
    assert out.token_ids == reference_greedy(model, ctx, 10)
    # A different trajectory id with no parent never reuses anything.
    eng.reset_stats()
    eng.generate([req("b", ctx, 2)])
    assert eng.stats["reused_tokens"] == 0


def test_update_weights(tiny_model_dir, tiny_tokenizer, prompts):
    eng = HFEngine(tiny_model_dir, tiny_tokenizer)
    before = eng.generate([req("a", prompts[0], 8)])[0]
    assert eng.cached_tokens() > 0
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    new = [(k, v + 0.5 * torch.randn(v.shape, generator=g)) for k, v in state.items()
           if k.endswith("mlp.down_proj.weight") or k == "model.norm.weight"]
    eng.update_weights(iter(new))
    assert eng.cached_tokens() == 0
    after = eng.generate([req("a", prompts[0], 8)])[0]
    assert after.token_ids != before.token_ids or after.logprobs != pytest.approx(before.logprobs)
    assert after.token_ids == reference_greedy(eng.model, prompts[0], 8)
    with pytest.raises(KeyError, match="unknown parameter"):
        eng.update_weights([("model.nope.weight", torch.zeros(1))] + new)
    with pytest.raises(ValueError, match="shape mismatch"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))])
    eng.update_weights(state.items())   # strict names are the model's own state_dict keys
    assert eng.generate([req("a", prompts[0], 8)])[0].token_ids == before.token_ids


def test_seeded_sampling_reproducible(model, tiny_tokenizer, prompts):
    eng = engine(model, tiny_tokenizer)
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    alone = eng.generate([req("a", prompts[1], 15, sp, seed=42)])[0]
    eng.release()
    crowd = eng.generate([req("x", prompts[0], 7, sp, seed=1), req("a", prompts[1], 15, sp, seed=42),
                          req("y", prompts[2], 20, sp)])
    assert crowd[1].token_ids == alone.token_ids
    other = eng.generate([req("b", prompts[1], 15, sp, seed=43)])[0]
    assert other.token_ids != alone.token_ids


def test_bf16_runs_and_kv_matches(tiny_model_dir, tiny_tokenizer, prompts):
    kv = HFEngine(tiny_model_dir, tiny_tokenizer, dtype="bfloat16")
    assert next(kv.model.parameters()).dtype == torch.bfloat16
    re = HFEngine(kv.model, tiny_tokenizer, kv_cache=False)
    budgets = [6, 6, 6, 6]
    got, _ = _three_rounds(kv, tiny_tokenizer, prompts, budgets, [TOOL_RESULT])
    want, _ = _three_rounds(re, tiny_tokenizer, prompts, budgets, [TOOL_RESULT])
    for g, w in zip(got[0], want[0]):   # first round: identical computation
        assert g.token_ids == w.token_ids
    diffs = [abs(a - b) for gr, wr in zip(got, want) for g, w in zip(gr, wr)
             for a, b in zip(g.logprobs, w.logprobs)]
    assert max(diffs) < 0.1 and all(torch.isfinite(torch.tensor(o.entropy)).all()
                                    for r in got for o in r)


def test_build_engine_and_cache_support(tiny_model_dir, tiny_tokenizer):
    with pytest.raises(ValueError, match=r"rollout\.name.*'hf', 'vllm'"):
        build_engine("sglang", tiny_model_dir, tiny_tokenizer)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=4, max_window_layers=0))
    assert _why_no_kv_reuse(sliding) is not None


def test_kv_store_cap_and_shared_module_mode(model, tiny_tokenizer, prompts):
    eng = engine(model, tiny_tokenizer, max_cached_tokens=40)
    model.train()   # a module shared with the trainer: generate runs in eval, then restores
    try:
        eng.generate([req(str(i), p, 6) for i, p in enumerate(prompts)])
        assert model.training
    finally:
        model.eval()
    kept = [len(kv.tokens) for kv in eng._store.values()]
    assert eng.cached_tokens() == sum(kept) and (sum(kept) <= 40 or len(kept) == 1)
    assert len(kept) < len(prompts)


def test_statistics_window(tiny_model_dir, tiny_tokenizer, prompts):
    """Top-k and entropies for the first stats_window positions only; sampling is unchanged."""
    import dataclasses

    eng = HFEngine(tiny_model_dir, tiny_tokenizer, dtype="float32")
    sp = SamplingParams(temperature=1.0, logprobs_topk=3, full_entropy=True)
    reqs = [GenRequest(f"r{i}", list(p), 12, [], sp, seed=i) for i, p in enumerate(prompts)]
    full = eng.generate(reqs)
    eng.release()
    win = eng.generate([dataclasses.replace(r, sampling=dataclasses.replace(sp, stats_window=4)) for r in reqs])
    for a, b in zip(full, win):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert b.topk_logprobs[:4] == a.topk_logprobs[:4] and all(x == [] for x in b.topk_logprobs[4:])
        assert b.entropy == a.entropy[:4]


def test_requests_at_any_time_match_generate(model, tiny_tokenizer, prompts):
    """Continuous batching (add_requests/step): rows join while others decode (their caches
    merged) and leave when done; a later round and a branch reuse the stored KV. Every output
    equals `generate`'s for the same requests (greedy and seeded sampling)."""
    tok = tiny_tokenizer
    sp = SamplingParams(temperature=1.0, logprobs_topk=3)
    reqs = [req("a", prompts[0], 9, sp, seed=1), req("b", prompts[1], 14, GREEDY),
            req("c", prompts[2], 5, sp, seed=3), req("z", prompts[3], 0)]
    ref = engine(model, tok)
    want = ref.generate(reqs)
    eng = engine(model, tok)
    eng.add_requests(reqs[:1])
    got, steps = {}, 0
    while eng.has_unfinished():
        got.update((r.request_id, o) for r, o in eng.step())
        steps += 1
        if steps == 4:
            eng.add_requests(reqs[1:])   # joins a batch that is 4 tokens into its decoding
        assert steps < 100
    assert set(got) == {"a", "b", "c", "z"}
    for r, w in zip(reqs, want):
        g = got[r.request_id]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=TOL)
        for g_row, w_row in zip(g.topk_logprobs, w.topk_logprobs):
            assert g_row == pytest.approx(w_row, abs=TOL)
    # the next round of "a" and a branch of it prefill only their new tokens
    ctx = list(prompts[0]) + got["a"].token_ids + tok.encode(TOOL_RESULT)
    nxt = [req("a", ctx, 6, sp, seed=4), req("a2", ctx, 6, sp, seed=5, parent_id="a")]
    want2 = ref.generate(nxt)
    eng.reset_stats()
    eng.add_requests(nxt)
    got2 = {}
    while eng.has_unfinished():
        got2.update((r.request_id, o) for r, o in eng.step())
    assert eng.stats["reused_tokens"] == 2 * (len(prompts[0]) + len(got["a"].token_ids) - 1)
    for r, w in zip(nxt, want2):
        assert got2[r.request_id].token_ids == w.token_ids


def test_discard_weights_frees_them_and_a_full_sync_refills(tiny_model_dir, tiny_tokenizer, prompts):
    """discard_weights (free_cache_engine's hf counterpart of vLLM's sleep level 2) leaves no weight
    storage; generating then fails clearly; a sync missing a parameter is refused; a full sync
    gives back the same outputs, with the tied embedding still one tensor and buffers untouched."""
    eng = HFEngine(tiny_model_dir, tiny_tokenizer)
    before = eng.generate([req("a", prompts[0], 8)])[0]
    weights = {n: p.detach().clone() for n, p in eng.model.named_parameters()}   # unique names, as the actor's sync
    buffers = {n: b.clone() for n, b in eng.model.named_buffers()}
    assert eng.model.get_output_embeddings().weight is eng.model.get_input_embeddings().weight
    assert eng.discard_weights() and eng.weights_discarded
    assert sum(p.numel() for p in eng.model.parameters()) == 0 and eng.cached_tokens() == 0
    with pytest.raises(RuntimeError, match="discarded"):
        eng.generate([req("a", prompts[0], 8)])
    with pytest.raises(RuntimeError, match="discarded"):
        eng.add_requests([req("a", prompts[0], 8)])
    first = next(iter(weights))
    with pytest.raises(ValueError, match=f"must carry every parameter; missing 1, e.g. \\['{first}'\\]"):
        eng.update_weights((n, w) for n, w in weights.items() if n != first)
    eng.update_weights(weights.items())
    assert not eng.weights_discarded
    assert eng.model.get_output_embeddings().weight is eng.model.get_input_embeddings().weight
    for n, b in eng.model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    after = eng.generate([req("a", prompts[0], 8)])[0]
    assert after.token_ids == before.token_ids   # equal weights; float sums may round apart at 1e-7 (alignment)
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    # a module handed in may be the trainer's own: it is never discarded
    shared = HFEngine(eng.model, tiny_tokenizer)
    assert not shared.discard_weights() and not shared.weights_discarded
    assert sum(p.numel() for p in eng.model.parameters()) == sum(w.numel() for w in weights.values())


@pytest.fixture(scope="module")
def padded_vocab_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny model with 64 padding rows past the tokenizer's ids (as Qwen2.5 pads 151665 to 152064)."""
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("padded_vocab"), vocab_size=len(tiny_tokenizer) + 64)


def test_no_padding_id_is_ever_sampled(padded_vocab_dir, tiny_tokenizer, prompts):
    """[issue 31, item 3] At temperature 5 the distribution is nearly flat: without the mask about one
    draw in ten would be a padding id (the control below shows it); with it, none of 4 x 48 draws is,
    and the reported log-probs are those of softmax over the tokenizer's ids alone."""
    from transformers import AutoModelForCausalLM

    n_ids = len(tiny_tokenizer)
    hot = SamplingParams(temperature=5.0, logprobs_topk=0)
    eng = HFEngine(padded_vocab_dir, tiny_tokenizer, seed=3)
    outs = eng.generate([req(f"r{i}", p, 48, hot, seed=100 + i) for i, p in enumerate(prompts)])
    drawn = [t for o in outs for t in o.token_ids]
    assert len(drawn) == 4 * 48 - sum(48 - len(o.token_ids) for o in outs) and max(drawn) < n_ids
    model = AutoModelForCausalLM.from_pretrained(padded_vocab_dir, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(p) + o.token_ids])).logits[0, len(p) - 1:-1]
        want = torch.log_softmax(logits[:, :n_ids] / 5.0, dim=-1)  # the padding rows carry no mass
        got = torch.tensor(o.logprobs)
        assert torch.allclose(got, want.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0], atol=TOL)
    control = HFEngine(padded_vocab_dir, tiny_tokenizer, seed=3)
    control.n_token_ids = model.config.vocab_size  # the mask off: padding ids do get drawn
    outs = control.generate([req(f"r{i}", p, 48, hot, seed=100 + i) for i, p in enumerate(prompts)])
    assert max(t for o in outs for t in o.token_ids) >= n_ids


def test_every_decoding_forward_runs_without_cudnn_attention_on_cuda(model, tiny_tokenizer, prompts, monkeypatch):
    """On an H200 cuDNN attention planned every new decode shape (67% of a call's CPU time, docs/gpu.md,
    "Verify on your GPU"). Every model call of a generate runs with cuDNN's SDPA kernel off and the
    other kernels as they were, and the flags are back afterwards. The guard is the engine's own, run as
    it runs on CUDA (it only sets flags, which a CPU build has too); on the CPU it changes nothing."""
    from verl_arpo.workers.rollout.engines import hf_engine

    flags = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = [f() for f in flags]
    assert before[0], "cuDNN attention is on by default (the case the engine guards against)"
    with hf_engine.without_cudnn_attention(torch.device("cpu")):
        assert [f() for f in flags] == before
    torch.backends.cuda.enable_flash_sdp(False)   # a user's own choice stays as it is
    try:
        seen = []
        handle = model.register_forward_pre_hook(lambda *_: seen.append([f() for f in flags]))
        real = hf_engine.without_cudnn_attention
        monkeypatch.setattr(hf_engine, "without_cudnn_attention", lambda device: real(torch.device("cuda")))
        eng = engine(model, tiny_tokenizer)
        try:
            outs = eng.generate([req(f"r{i}", p, 6) for i, p in enumerate(prompts[:3])])
        finally:
            handle.remove()
        assert len(seen) == eng.stats["forward_calls"] >= max(len(o.token_ids) for o in outs) > 0
        assert all(s == [False, False, True, True] for s in seen), seen
        assert [f() for f in flags] == [True, False, True, True]
    finally:
        torch.backends.cuda.enable_flash_sdp(before[1])
    assert [f() for f in flags] == before
