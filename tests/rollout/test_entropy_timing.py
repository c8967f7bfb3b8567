"""`rollout.entropy_timing`: when ΔH is measured (docs/algorithms.md, "When the entropy is measured").

after_result (the paper, the default): the draw for tool step t reads the entropy of the first k
tokens generated *after* tool result t, against H_initial (the first round's), and its branches
fork at the tool-result boundary. before_call (the reference): the draw reads the round that ended
in call t, so the first call's draw always sees ΔH = 0 and p = branch_probability.

Scripted-engine tests pin the rule exactly; the real-model test recomputes H, ΔH and p by hand from
a re-forward of the tiny tool model and checks that branches fork at the boundary with their
masks and log-probs intact."""
import math

import numpy as np
import pytest
import torch
from scripted import ScriptedEngine, Turn, make_executor
from transformers import AutoModelForCausalLM

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.config import ROLLOUT_MODES
from verl_arpo.utils.rollout_dump import dump_rollout, read_dump
from verl_arpo.utils.rollout_tree import render_html
from verl_arpo.workers.rollout import build_agent_loop
from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
from verl_arpo.workers.rollout.tools.python_tool import PythonTool
from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool
from verl_arpo.workers.rollout.tools.registry import ToolExecutor
from worker_configs import rollout

from test_agent_loop import ANSWER, CALL, _prompts  # noqa: E402  (the same scripted turns and prompt batches)


def _loop(tok, script, mode, **cfg):
    cfg.setdefault("response_length", 256)
    cfg.setdefault("entropy_mode", "full")
    section, kw = rollout(**cfg)
    return build_agent_loop(mode, ScriptedEngine(tok, script), tok, make_executor(3), section, **kw)


def _round_starts(mask_row: list[int]) -> list[int]:
    """Response positions where each round begins: 0, then the end of each tool result (0 → 1)."""
    return [0] + [i for i in range(1, len(mask_row)) if mask_row[i] == 1 and mask_row[i - 1] == 0]


@pytest.mark.parametrize("mode", ROLLOUT_MODES)
def test_first_call_draw_sees_the_entropy_after_the_result(tiny_tokenizer, mode):
    """H = 1.0 in round 0, 2.5 after tool result 1: after_result's first draw has ΔH = 1.5 and
    p = 0.5 + 0.2·1.5 = 0.8 ≠ branch_probability; before_call's first draw has ΔH = 0, p = 0.5."""
    tok, bp, w = tiny_tokenizer, 0.5, 0.2
    script = lambda req, k: Turn(CALL if k < 2 else ANSWER, entropy=[1.0, 2.5, 0.5][k])  # noqa: E731
    prompts = _prompts(tok, [f"q{i}" for i in range(40)])
    cfg = dict(n=3, initial_rollouts=1, beam_size=2, branch_probability=bp, entropy_weight=w, seed=2)

    out = _loop(tok, script, mode, entropy_timing="after_result", **cfg).generate_sequences(prompts)
    nt = out.non_tensor_batch
    roots = [k for k, t in enumerate(nt["traj_id"]) if t.endswith("-t0")]   # the initial trajectory of each prompt
    first = [nt["branch_decisions"][k][0] for k in roots]
    assert {d["step"] for d in first} == {1} and {d["round"] for d in first} == {1}
    for d in first:
        assert d["h"] == pytest.approx(2.5) and d["h_initial"] == pytest.approx(1.0)
        assert d["delta_h"] == pytest.approx(1.5)
        assert d["p"] == pytest.approx(bp + w * 1.5) and d["p"] != pytest.approx(bp)
        assert d["branched"] == (d["u"] < d["p"])
    fired = sum(d["branched"] for d in first)
    assert abs(fired / len(first) - 0.8) < 4 * math.sqrt(0.8 * 0.2 / len(first))

    # every branch forks at a tool-result boundary: its parent's tokens and masks up to there, then its own
    R = out.batch["responses"].shape[1]
    by_id = {t: k for k, t in enumerate(nt["traj_id"])}
    children = [k for k, p in enumerate(nt["parent_id"]) if p is not None and p in by_id]
    assert children
    for k in children:
        par, pos, r = by_id[nt["parent_id"][k]], int(nt["branch_pos"][k]), int(nt["branch_round"][k])
        pmask = out.batch["response_mask"][par].tolist()
        assert pos == _round_starts(pmask)[r + 1]      # right after the parent's tool result r + 1
        assert pmask[pos - 1] == 0 and pmask[pos] == 1
        assert torch.equal(out.batch["responses"][k, :pos], out.batch["responses"][par, :pos])
        assert torch.equal(out.batch["response_mask"][k, :pos], out.batch["response_mask"][par, :pos])
        assert torch.equal(out.batch["rollout_log_probs"][k, :pos], out.batch["rollout_log_probs"][par, :pos])
        assert len(nt["tool_calls"][k]) == nt["num_tool_calls"][k] <= 2 and pos < R
        assert all(d["round"] > r for d in nt["branch_decisions"][k])   # no draw is inherited or repeated

    before = _loop(tok, script, mode, entropy_timing="before_call", **cfg).generate_sequences(prompts)
    first_before = [before.non_tensor_batch["branch_decisions"][k][0] for k in roots]
    assert {d["step"] for d in first_before} == {1} and {d["round"] for d in first_before} == {0}
    assert all(d["delta_h"] == 0.0 and d["p"] == bp for d in first_before)

    m = out.meta_info["metrics"]
    assert m["rollout/branch_p_mean"] > bp and before.meta_info["metrics"]["rollout/branch_draws_zero_dh"] >= len(roots)


def test_fire_rate_from_the_dump_and_the_tree_viewer(tiny_tokenizer, tmp_path):
    """Each draw is written once, on the trajectory that made it, so the dump alone gives the
    rule's fire rate; the viewer shows each draw's ΔH and p."""
    tok = tiny_tokenizer
    script = lambda req, k: Turn(CALL if k < 2 else ANSWER, entropy=[1.0, 1.8, 3.0][k])  # noqa: E731
    out = _loop(tok, script, "sync_with_tool", n=4, initial_rollouts=1, beam_size=3, branch_probability=0.3,
                entropy_weight=0.3, seed=5).generate_sequences(_prompts(tok, [f"q{i}" for i in range(12)]))
    m = out.meta_info["metrics"]
    path = dump_rollout(out, tok, step=1, out_dir=tmp_path)
    records = read_dump(path)
    draws = [d for r in records for d in r["branch_decisions"]]
    assert len(draws) == m["rollout/branch_draws"] and sum(d["branched"] for d in draws) == m["rollout/branches"]
    children = {d["child"] for d in draws if d["branched"]}
    with_parent = {r["traj_id"] for r in records if r["parent_id"]}
    assert children <= with_parent and len(with_parent - children) == m.get("rollout/duplicates", 0)
    assert 0 < m["rollout/branches"] < m["rollout/branch_draws"]
    page = render_html([r for r in records if r["uid"] == "u0"])
    assert "ΔH=" in page and "H_initial=" in page


def test_real_model_draws_match_a_reforward(tool_model_dir, tiny_tokenizer):
    """The tiny tool model, the HF engine and real tools, entropy_mode=full: each recorded draw's H
    is the mean full-vocabulary entropy of the first `entropy_window` tokens after the tool result
    (recomputed here from a plain forward), H_initial that of the response's first tokens,
    p = clip(bp + w·ΔH, 0, 1); branches fork at the boundary and their log-probs re-forward exactly."""
    tok, bp, w, win = tiny_tokenizer, 0.5, 0.5, 6
    engine = HFEngine(tool_model_dir, tok, dtype="float32", seed=0)
    executor = ToolExecutor({"python": PythonTool(timeout=10), "search": LocalSearchTool(max_results=1, result_length=80)},
                            max_workers=4, timeout=30, retry_count=0, call_limit=2)
    cfg, kw = rollout(n=4, initial_rollouts=2, beam_size=2, branch_probability=bp, entropy_weight=w, response_length=96,
                      temperature=1.0, call_limit=2, seed=5, entropy_mode="full", entropy_window=win)
    prompt = "<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)] * 3)
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                non_tensors={"uid": as_object_array(["a", "b", "c"])}, meta_info={"global_steps": 1})
    out = build_agent_loop("sync_with_tool", engine, tok, executor, cfg, **kw).generate_sequences(batch)
    b, nt = out.batch, out.non_tensor_batch
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    R = b["responses"].shape[-1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, -R - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)                       # [rows, R]: entropy at each response position
    mask = b["response_mask"].bool()
    lp = torch.gather(logp, -1, b["responses"].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(lp[mask], b["rollout_log_probs"][mask], atol=2e-4)

    checked = 0
    for k in range(len(out)):
        starts = _round_starts(b["response_mask"][k].tolist())
        h_initial = float(ent[k, starts[0]:starts[0] + win].mean())
        for d in nt["branch_decisions"][k]:
            s = starts[d["round"]]
            end = min(s + win, int(b["attention_mask"][k, -R:].sum()))
            run = b["response_mask"][k, s:end].tolist()
            end = s + (run.index(0) if 0 in run else len(run))   # the round may end (tool call) inside the window
            h = float(ent[k, s:end].mean())
            assert d["step"] == d["round"] >= 1
            assert d["h"] == pytest.approx(h, abs=2e-4) and d["h_initial"] == pytest.approx(h_initial, abs=2e-4)
            assert d["delta_h"] == pytest.approx(h - h_initial, abs=4e-4)
            assert d["p"] == pytest.approx(min(1.0, max(0.0, bp + w * (h - h_initial))), abs=3e-4)
            checked += 1
    assert checked, "the over-fitted model should call a tool and draw after its result"
    assert any(abs(d["p"] - bp) > 1e-3 for ds in nt["branch_decisions"] for d in ds if d["step"] == 1)
    by_id = {t: k for k, t in enumerate(nt["traj_id"])}
    for k, par in enumerate(nt["parent_id"]):
        if par in by_id:
            pos = int(nt["branch_pos"][k])
            assert b["response_mask"][by_id[par], pos - 1] == 0     # the boundary: the end of a tool result
            assert torch.equal(b["responses"][k, :pos], b["responses"][by_id[par], :pos])
    assert np.all(np.asarray(nt["num_tool_calls"], dtype=int) <= 2)
