"""The decode step's fused projections (engines/fused_projections.py): the stacked matmul's columns
equal each projection's own product, the engine generates the same tokens, log-probs and entropies
with and without them, the weight sync reaches the stacked buffer (in place, and after a discard and
a refill), and an engine on the trainer's own module refuses them."""

import pytest
import torch
import torch.nn.functional as F

from verl_arpo.workers.rollout.engines import GenRequest, SamplingParams
from verl_arpo.workers.rollout.engines import fused_projections
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine

GREEDY = SamplingParams(greedy=True, logprobs_topk=3)
SAMPLED = SamplingParams(temperature=1.0, logprobs_topk=3)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["<think> I need to compute 1234 * 5678 with python. </think> <python>",
             "Who founded the town of Veltmoor?", "print(sum(x))", "What is the capital of France?"]
    return [tiny_tokenizer.encode(t) for t in texts]


def _outputs(eng, prompts, sampling, n=10):
    reqs = [GenRequest(f"r{i}", list(p), n, [], sampling, seed=7 + i) for i, p in enumerate(prompts)]
    outs = eng.generate(reqs)
    return [(o.token_ids, o.logprobs, o.topk_logprobs, o.entropy) for o in outs]


def _members(model):
    layer = model.model.layers[0]
    return [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], [layer.mlp.gate_proj, layer.mlp.up_proj]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stacked_product_is_each_projection_s_own(tiny_model_dir, tiny_tokenizer, dtype):
    eng = HFEngine(tiny_model_dir, tiny_tokenizer, dtype=dtype, fuse_projections=True)
    assert eng.fused_groups == 2 * len(eng.model.model.layers)
    default = HFEngine(tiny_model_dir, tiny_tokenizer, dtype=dtype).fused_groups
    assert default == (eng.fused_groups if dtype == "bfloat16" else 0)   # by default on the CPU in bf16 only
    for members in _members(eng.model):
        group = members[0]._fused_group
        start = 0
        for m in members:   # each weight is a view of the group's buffer, in order
            assert m.weight.data_ptr() == group.weight[start].data_ptr()
            start += m.weight.shape[0]
        x = torch.randn(6, 1, members[0].in_features).to(eng.model.dtype)   # a decode step: one token a row
        together = [m(x) for m in members]
        alone = [F.linear(x, m.weight, m.bias) for m in members]
        for a, b in zip(together, alone):
            assert torch.equal(a, b)
        assert group._out is None   # every member took its part: no activation held between steps
        prefill = torch.randn(2, 5, members[0].in_features).to(eng.model.dtype)
        assert all(torch.equal(m(prefill), F.linear(prefill, m.weight, m.bias)) for m in members)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_the_engine_generates_the_same_with_and_without(tiny_model_dir, tiny_tokenizer, prompts, dtype, sampling):
    fused = HFEngine(tiny_model_dir, tiny_tokenizer, dtype=dtype, fuse_projections=True)
    plain = HFEngine(tiny_model_dir, tiny_tokenizer, dtype=dtype, fuse_projections=False)
    assert plain.fused_groups == 0 and not hasattr(plain.model.model.layers[0].self_attn.q_proj, "_fused_group")
    assert _outputs(fused, prompts, sampling) == _outputs(plain, prompts, sampling)


def test_the_weight_sync_reaches_the_stacked_buffer(tiny_model_dir, tiny_tokenizer, prompts):
    """In place (update_weights), and after discard_weights and a full refill (new storage: the group
    binds again); each time the same outputs as an engine without fusion given the same weights."""
    fused = HFEngine(tiny_model_dir, tiny_tokenizer, fuse_projections=True)
    plain = HFEngine(tiny_model_dir, tiny_tokenizer, fuse_projections=False)
    g = torch.Generator().manual_seed(0)
    new = [(n, p.detach() + 0.3 * torch.randn(p.shape, generator=g)) for n, p in fused.model.named_parameters()
           if any(k in n for k in ("q_proj", "v_proj", "up_proj"))]
    before = _outputs(fused, prompts, GREEDY)
    for eng in (fused, plain):
        eng.update_weights(iter(new))
    after = _outputs(fused, prompts, GREEDY)
    assert after != before and after == _outputs(plain, prompts, GREEDY)
    weights = {n: p.detach().clone() for n, p in fused.model.named_parameters()}
    assert fused.discard_weights() and sum(p.numel() for p in fused.model.parameters()) == 0
    assert all(m._fused_group.weight is None for ms in _members(fused.model) for m in ms)   # buffers freed too
    fused.update_weights(weights.items())
    assert _outputs(fused, prompts, GREEDY) == after
    q = fused.model.model.layers[0].self_attn.q_proj
    assert q.weight.data_ptr() == q._fused_group.weight.data_ptr()   # bound again to the refilled weights


def test_a_shared_module_refuses_fusion(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert HFEngine(model, tiny_tokenizer).fused_groups == 0   # the default leaves the trainer's module alone
    with pytest.raises(ValueError, match="fuse_projections=True needs weights of its own"):
        HFEngine(model, tiny_tokenizer, fuse_projections=True)
    assert fused_projections.fuse(torch.nn.Linear(3, 3)) == 0   # no decoder layers: nothing to fuse
