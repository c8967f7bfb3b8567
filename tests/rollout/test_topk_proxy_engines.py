"""[issue 15] The top-k entropy proxy sees the same numbers on both engines: the top-k log-probs plus
the sampled token's when it is outside them (the reference's definition, docs/algorithms.md).

One sampled generation of the HF engine gives the tokens; an independent full re-forward of the
model gives the log-probs at every position. From those logits the test builds (a) the expected
row by hand and (b) the log-prob dicts vLLM returns for `logprobs=k` (top k plus the sampled token,
keyed by token id), converted by VLLMEngine's own code. All three must agree.
"""
import math
from types import SimpleNamespace

import pytest
import torch

from verl_arpo.algos import branching
from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
from verl_arpo.workers.rollout.engines.vllm_engine import VLLMEngine

K = 2


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _vllm_convert(req, tokens, logp_rows):
    """VLLMEngine._convert on the structure vLLM returns, built from the re-forward's log-probs."""
    dicts = []
    for t, row in zip(tokens, logp_rows):
        ids = row.topk(K).indices.tolist()
        if t not in ids:
            ids.append(t)
        dicts.append({i: SimpleNamespace(logprob=float(row[i]), rank=None, decoded_token=None) for i in ids})
    completion = SimpleNamespace(token_ids=tokens, logprobs=dicts, finish_reason="length", stop_reason=None)
    engine = VLLMEngine.__new__(VLLMEngine)  # only _convert's inputs matter: no vLLM process is started
    engine.full_entropy = False
    return engine._convert(req, completion)


def test_topk_rows_include_the_sampled_token_on_both_engines(model, tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = tok.encode("Who founded the town of Veltmoor?")
    sampling = SamplingParams(temperature=3.0, logprobs_topk=K, full_entropy=False)  # flat: often outside top-2
    req = GenRequest("r0", list(prompt), 24, [], sampling, seed=5)
    hf_out = HFEngine(model, tok).generate([req])[0]
    tokens = hf_out.token_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / 3.0, dim=-1)

    expected, outside = [], 0
    for t, row in zip(tokens, logp):
        top = row.topk(K)
        vals = top.values.tolist()
        if t not in top.indices.tolist():
            vals.append(float(row[t]))
            outside += 1
        expected.append(vals)
    assert outside >= 3, "the sample never left the top-k: the case under test did not occur"

    vllm_out = _vllm_convert(req, tokens, logp)
    for got_hf, got_vllm, want in zip(hf_out.topk_logprobs, vllm_out.topk_logprobs, expected):
        assert len(got_hf) == len(got_vllm) == len(want)
        assert got_hf == pytest.approx(want, abs=1e-4) and got_vllm == pytest.approx(want, abs=1e-5)
    vocab = len(tok)
    want_h = sum(-sum(math.exp(v) * v for v in row) for row in expected[:20]) / math.log(vocab)
    for out in (hf_out, vllm_out):
        assert branching.topk_proxy_entropy(out.topk_logprobs, vocab, window=20) == pytest.approx(want_h, rel=1e-4)


def test_vllm_runs_in_process_on_every_device():
    """[issue 17, item 5] One code path: the engine is in-process on GPU as on CPU; the CPU recipe
    (KV cache size, thread binding) only on CPU. Read without starting vLLM."""
    from verl_arpo.workers.rollout.engines.vllm_engine import ENGINE_ENV, engine_env_defaults

    gpu, cpu = engine_env_defaults(on_cpu=False), engine_env_defaults(on_cpu=True)
    # forced, not defaulted: an image that exports 1 would get the multiprocess engine (issue 31)
    assert ENGINE_ENV == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} and "VLLM_ENABLE_V1_MULTIPROCESSING" not in cpu
    assert gpu == {}  # nothing is serialised across processes: no VLLM_ALLOW_INSECURE_SERIALIZATION
    assert {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"} <= cpu.keys()
