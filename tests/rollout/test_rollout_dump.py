"""Rollout dumps round-trip, and the tree drawn from them has one edge per branch at its branch point."""
import torch
from scripted import ScriptedEngine, Turn, make_executor
from test_agent_loop import CALL, ANSWER, _prompts

from verl_arpo.utils.rollout_dump import dump_rollout, read_dump, run_length_decode, run_length_encode
from verl_arpo.utils.rollout_tree import main as tree_main, tree_layout
from verl_arpo.workers.rollout.agent_loop import AgentLoop
from worker_configs import rollout


def test_rle():
    assert run_length_encode([1, 1, 0, 0, 0, 1]) == [[1, 2], [0, 3], [1, 1]]
    assert run_length_decode([[1, 2], [0, 3], [1, 1]]) == [1, 1, 0, 0, 0, 1]
    assert run_length_encode([]) == []


def test_dump_and_tree(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tok, lambda r, k: Turn(CALL if k < 2 else ANSWER, entropy=1.0 + k))
    cfg, kw = rollout(n=4, initial_rollouts=1, beam_size=2, branch_probability=0.9, entropy_weight=0.0,
                      response_length=200, entropy_mode="full", seed=1)
    loop = AgentLoop(engine, tok, make_executor(), cfg, **kw)
    out = loop.generate_sequences(_prompts(tok, ["q"]))
    R = out.batch["responses"].shape[-1]
    scores = torch.zeros(len(out), R)
    scores[:, 0] = torch.arange(len(out), dtype=torch.float)
    out.batch["token_level_scores"] = scores
    out.batch["advantages"] = out.batch["response_mask"].float() * 0.5
    path = dump_rollout(out, tok, step=3, out_dir=tmp_path)
    recs = read_dump(path)
    assert [r["traj_id"] for r in recs] == list(out.non_tensor_batch["traj_id"])
    for k, r in enumerate(recs):
        L = int(out.batch["attention_mask"][k, -R:].sum())
        assert run_length_decode(r["response_mask"]) == out.batch["response_mask"][k, :L].tolist()
        assert r["reward"] == float(k) and r["advantage"] == 0.5 and r["step"] == 3
        assert r["response"].startswith(CALL)
    nodes, edges = tree_layout(recs)
    branches = [r for r in recs if r["parent_id"] is not None]
    assert branches  # p = 0.9 per draw over several rounds
    for b in branches:
        assert ((b["parent_id"], b["branch_round"]), (b["traj_id"], b["branch_round"] + 1)) in edges
    owned = sum(len(r["round_entropies"]) - (r["branch_round"] + 1 if r["parent_id"] else 0) for r in recs)
    assert len(nodes) == owned
    html_path = tmp_path / "t.html"
    tree_main([str(path), "-o", str(html_path)])
    page = html_path.read_text()
    assert page.startswith("<!doctype html>") and all(r["traj_id"] in page for r in recs)


def test_a_tool_result_that_echoes_a_key_is_masked_in_the_dump(tiny_tokenizer, tmp_path, monkeypatch):
    """[issue 34, item 6] Rollout dumps were never masked: a search result echoing the API key (an
    error page, a debug reply) reached the file in clear. The rest of the line stays readable."""
    tok = tiny_tokenizer
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "bd-secret-value-4242")
    engine = ScriptedEngine(tok, lambda r, k: Turn(CALL if k < 1 else ANSWER, entropy=1.0))
    cfg, kw = rollout(n=1, response_length=200, entropy_mode="full", seed=1)
    out = AgentLoop(engine, tok, make_executor(), cfg, **kw).generate_sequences(_prompts(tok, ["q"]))
    out.non_tensor_batch["tool_calls"][0][0]["result"] = "denied for key bd-secret-value-4242 (Authorization: Bearer tok-777)"
    text = dump_rollout(out, tok, step=1, out_dir=tmp_path).read_text()
    assert "bd-secret-value-4242" not in text and "tok-777" not in text
    assert read_dump(tmp_path / "rollout_1.jsonl")[0]["tool_calls"][0]["result"] == \
        "denied for key *** (Authorization: Bearer ***)"
