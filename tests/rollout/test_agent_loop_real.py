"""The agent loop with a real (tiny) model, the HF engine and real tools (sandboxed Python, BM25).

The random tiny model is first over-fitted for a few seconds on two tool-using trajectories, so
that sampling really emits `<python>`/`<search>` calls: the loop then runs the sandbox and the
search engine, appends results, and continues from the persistent KV cache. We check the output
contract and that a plain re-forward of each trajectory reproduces `rollout_log_probs` on every
sampled token — across tool-result boundaries, branches and cache reuse.
"""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.utils.torch_functional import logprobs_from_logits
from verl_arpo.config import ROLLOUT_MODES
from verl_arpo.workers.rollout import build_agent_loop
from worker_configs import rollout
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool
from verl_arpo.workers.rollout.tools.python_tool import PythonTool
from verl_arpo.workers.rollout.tools.registry import ToolExecutor

PROMPT = "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n"  # = conftest's chat prompt


@pytest.fixture(scope="module")
def tool_model(tool_model_dir):
    return tool_model_dir


def _prompts(tok, k):
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)] * k)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               non_tensors={"uid": as_object_array([f"u{i}" for i in range(k)])},
                               meta_info={"global_steps": 1})


@pytest.mark.parametrize("mode", ROLLOUT_MODES)
@pytest.mark.parametrize("kv_cache", [True, False])
def test_real_model_real_tools(tool_model, tiny_tokenizer, kv_cache, mode):
    tok = tiny_tokenizer
    engine = HFEngine(tool_model, tok, dtype="float32", kv_cache=kv_cache, seed=0)
    executor = ToolExecutor({"python": PythonTool(timeout=10), "search": LocalSearchTool(max_results=1, result_length=120)},
                            max_workers=4, timeout=30, retry_count=0, call_limit=2)
    cfg, kw = rollout(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.7, entropy_weight=0.2,
                        response_length=96, temperature=1.0, call_limit=2, seed=3)
    out = build_agent_loop(mode, engine, tok, executor, cfg, **kw).generate_sequences(_prompts(tok, 2))
    nt, b = out.non_tensor_batch, out.batch
    assert len(out) == 8 and list(nt["uid"]) == ["u0"] * 4 + ["u1"] * 4
    calls = [c for cs in nt["tool_calls"] for c in cs]
    assert calls, "the over-fitted model should call tools"
    py = [c for c in calls if c["tag"] == "python" and c["content"] == "print(12 * 34)"]
    assert all(c["result"].strip() == "408" for c in py)  # the sandbox really ran it
    if mode == "sync_with_tool":   # this seed's draws (async draws from per-trajectory streams)
        assert py
    srch = [c for c in calls if c["tag"] == "search"]
    for c in srch:  # BM25 answered (or the sampled query was empty / matched nothing)
        assert c["result"].startswith(("Page 1:", "No search results", "Error: the <search> call was empty")), c

    # contract: masks, attention and a re-forward of the log-probs of every sampled token
    model = AutoModelForCausalLM.from_pretrained(tool_model).eval()
    R = b["responses"].shape[-1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    lp = logprobs_from_logits(logits[:, -R - 1:-1], b["responses"])
    mask = b["response_mask"].bool()
    assert torch.all(b["attention_mask"][:, -R:][mask] == 1)
    assert torch.allclose(lp[mask], b["rollout_log_probs"][mask], atol=2e-4), (lp[mask] - b["rollout_log_probs"][mask]).abs().max()
    for k in range(len(out)):
        L = int(b["attention_mask"][k, -R:].sum())
        text = tok.decode(b["responses"][k, :L][b["response_mask"][k, :L] == 0].tolist())
        assert text.count("<result>") == len(nt["tool_calls"][k])
    assert out.meta_info["metrics"]["rollout/tokens_generated"] > 0
    assert np.all(np.asarray(nt["num_tool_calls"], dtype=int) <= 2)


class _FixedLatency(PythonTool):
    """The sandboxed Python tool, answering after a fixed delay (a remote API's latency)."""

    def __init__(self, delay: float, **kw):
        super().__init__(**kw)
        self.delay = delay

    def run(self, content):
        import time

        time.sleep(self.delay)
        return super().run(content)


def _tree_of(out):
    nt = out.non_tensor_batch
    return [(t, p, int(r), int(c), tuple(x["content"] for x in calls))
            for t, p, r, c, calls in zip(nt["traj_id"], nt["parent_id"], nt["branch_round"], nt["num_tool_calls"],
                                         nt["tool_calls"])]


def test_async_same_tree_twice_with_fixed_latency_tools(tool_model, tiny_tokenizer):
    """async_with_tool, the HF engine's continuous batching and a tool of fixed latency: the same
    seed gives the same tree, tokens and log-probs twice. n = 8 is what 2 initial trajectories can
    reach with one branch per tool result and 2 calls each, so no two siblings ever race for a
    prompt's last slot (the one thing async mode leaves to timing: docs/algorithms.md)."""
    tok = tiny_tokenizer
    cfg, kw = rollout(n=8, initial_rollouts=2, beam_size=2, branch_probability=0.7, entropy_weight=0.2,
                        response_length=96, temperature=1.0, call_limit=2, seed=9)
    outs = []
    for _ in range(2):
        engine = HFEngine(tool_model, tok, dtype="float32", seed=0)
        executor = ToolExecutor({"python": _FixedLatency(0.05, timeout=10),
                                 "search": LocalSearchTool(max_results=1, result_length=120)},
                                max_workers=8, timeout=30, retry_count=0, call_limit=2)
        outs.append(build_agent_loop("async_with_tool", engine, tok, executor, cfg, **kw).generate_sequences(_prompts(tok, 3)))
    a, b = outs
    assert len(a) == 24 and list(a.non_tensor_batch["uid"]) == ["u0"] * 8 + ["u1"] * 8 + ["u2"] * 8
    assert sum(len(c) for c in a.non_tensor_batch["tool_calls"]) > 0
    assert _tree_of(a) == _tree_of(b)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    assert torch.allclose(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5)
    m = a.meta_info["metrics"]
    assert 0 < m["rollout/engine_busy_fraction"] <= 1


@pytest.mark.parametrize("mode", ROLLOUT_MODES)
def test_calculate_log_probs_off_keeps_the_tree_and_drops_rollout_log_probs(tool_model, tiny_tokenizer, mode):
    """[issue 31, item 5] verl's `rollout.calculate_log_probs=False`: the same seed grows the same tree
    with the same tokens (the sampled token's log-prob feeds nothing in the rollout), and the batch has
    no `rollout_log_probs`, so the actor records no mismatch metrics and TIS is refused by validation."""
    tok = tiny_tokenizer
    outs = {}
    for on in (True, False):
        engine = HFEngine(tool_model, tok, dtype="float32", seed=0)
        executor = ToolExecutor({"python": PythonTool(timeout=10),
                                 "search": LocalSearchTool(max_results=1, result_length=120)},
                                max_workers=4, timeout=30, retry_count=0, call_limit=2)
        cfg, kw = rollout(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.7, entropy_weight=0.2,
                            response_length=64, temperature=1.0, call_limit=2, seed=5, calculate_log_probs=on)
        outs[on] = build_agent_loop(mode, engine, tok, executor, cfg, **kw).generate_sequences(_prompts(tok, 2))
    with_lp, without = outs[True], outs[False]
    assert "rollout_log_probs" in with_lp.batch.keys() and "rollout_log_probs" not in without.batch.keys()
    assert torch.equal(with_lp.batch["responses"], without.batch["responses"])
    assert torch.equal(with_lp.batch["response_mask"], without.batch["response_mask"])
    assert list(with_lp.non_tensor_batch["traj_id"]) == list(without.non_tensor_batch["traj_id"])
