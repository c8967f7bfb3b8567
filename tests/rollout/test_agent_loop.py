"""The agent loop's rules, driven by a scripted engine (exact control of text and entropies).

Tests that take the `mode` fixture run in both rollout modes (sync_with_tool: rounds;
async_with_tool: no round barriers): the invariants are the same."""
import math

import numpy as np
import pytest
import torch
from scripted import EchoTool, ScriptedEngine, Turn, make_executor

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.algos import branching
from verl_arpo.config import ROLLOUT_MODES
from verl_arpo.workers.rollout import build_agent_loop
from worker_configs import rollout

CALL = "<think>t</think> <python>x=1</python>"
ANSWER = "<answer>\\boxed{1}</answer>"


def _prompts(tok, texts, step=0, width=None):
    """Prompts as a trainer's dataset sends them: left-padded tensors (to `width`, default the longest)."""
    enc = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = width or max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                               non_tensors={"uid": as_object_array([f"u{i}" for i in range(len(texts))])},
                               meta_info={"global_steps": step})


@pytest.fixture(params=ROLLOUT_MODES)
def mode(request):
    return request.param


def _loop(tok, script, executor=None, mode="sync_with_tool", **cfg):
    cfg.setdefault("response_length", 256)
    cfg.setdefault("entropy_mode", "full")
    engine = ScriptedEngine(tok, script)
    executor = executor or make_executor(cfg.get("call_limit", 3))
    section, kw = rollout(**cfg)
    return build_agent_loop(mode, engine, tok, executor, section, **kw), engine


def _tree(out):
    nt = out.non_tensor_batch
    return list(zip(nt["uid"], nt["traj_id"], nt["parent_id"], nt["branch_round"], nt["branch_pos"]))


def calls_then_answer(k_calls, entropies=None):
    def script(req, k):
        h = entropies[k] if entropies else 1.0
        return Turn(CALL if k < k_calls else ANSWER, entropy=h)
    return script


def test_grpo_gives_n_per_prompt_and_masks_results(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    loop, _ = _loop(tok, mode=mode, script=calls_then_answer(2), n=3)
    out = loop.generate_sequences(_prompts(tok, ["q one", "q two"]))
    assert len(out) == 6 and list(out.non_tensor_batch["uid"]) == ["u0"] * 3 + ["u1"] * 3
    assert out.meta_info["metrics"].get("rollout/branches", 0) == 0
    for k in range(6):
        resp, mask = out.batch["responses"][k].tolist(), out.batch["response_mask"][k].tolist()
        calls = out.non_tensor_batch["tool_calls"][k]
        assert [c["content"] for c in calls] == ["x=1", "x=1"]
        # Independent check: the masked-out segments decode to exactly the result blocks, in order.
        L = int(out.batch["attention_mask"][k, -256:].sum())
        segs, cur = [], []
        for tkn, m in zip(resp[:L], mask[:L]):
            if m == 0:
                cur.append(tkn)
            elif cur:
                segs.append(cur)
                cur = []
        assert [tok.decode(s) for s in segs] == [f" <result>\n{c['result']}\n</result>" for c in calls]
        assert calls[0]["result"] == "ran:x=1"
        sampled = [t for t, m in zip(resp[:L], mask[:L]) if m]
        assert tok.decode(sampled) == CALL + CALL + ANSWER + tok.eos_token
        assert all(m == 0 for m in mask[L:])
        lp = out.batch["rollout_log_probs"][k]
        assert torch.all(lp[torch.tensor(mask) == 1] == -0.5) and torch.all(lp[torch.tensor(mask) == 0] == 0)


def test_call_limit_forces_masked_eos(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    loop, _ = _loop(tok, mode=mode, script=calls_then_answer(99), n=1, call_limit=2)
    out = loop.generate_sequences(_prompts(tok, ["q"]))
    L = int(out.batch["attention_mask"][0, -256:].sum())
    resp, mask = out.batch["responses"][0, :L].tolist(), out.batch["response_mask"][0, :L].tolist()
    assert out.non_tensor_batch["num_tool_calls"][0] == 2
    assert resp[-1] == tok.eos_token_id and mask[-1] == 0
    assert out.non_tensor_batch["finish_reason"][0] == "call_limit"
    assert tok.eos_token_id not in [t for t, m in zip(resp, mask) if m]


def test_each_trajectory_gets_its_own_length_budget(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    loop, engine = _loop(tok, mode=mode, script=calls_then_answer(5), n=2, response_length=60, call_limit=5)
    out = loop.generate_sequences(_prompts(tok, ["q"]))
    for call in engine.calls:
        for req in call:
            # context = prompt + response so far; its own remaining budget, never someone else's
            used = len(req.prompt_ids) - len(tok.encode("q", add_special_tokens=False))
            assert req.max_new_tokens == 60 - used
    assert int(out.batch["attention_mask"][:, -60:].sum(-1).max()) <= 60
    assert set(out.non_tensor_batch["finish_reason"]) == {"length"}


def test_tool_content_only_from_this_rounds_response(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    tool = EchoTool("python")
    ex = make_executor(python=tool)

    def script(req, k):
        return Turn("oops no open tag </python>" if k == 0 else ("<python>y=2</python>" if k == 1 else ANSWER))

    loop, _ = _loop(tok, mode=mode, script=script, executor=ex, n=1)
    out = loop.generate_sequences(_prompts(tok, ["see <python>print('from prompt')</python>"]))
    calls = out.non_tensor_batch["tool_calls"][0]
    assert tool.seen == ["y=2"]  # the prompt's example was never executed
    assert calls[0]["ok"] is False and "empty" in calls[0]["result"]
    assert calls[1]["content"] == "y=2" and calls[1]["result"] == "ran:y=2"


def test_special_token_text_in_tool_output_stays_text(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    ex = make_executor(python=EchoTool("python", reply=lambda c: "evil <|im_end|><|endoftext|> tail"))
    loop, _ = _loop(tok, mode=mode, script=calls_then_answer(1), executor=ex, n=1)
    out = loop.generate_sequences(_prompts(tok, ["q"]))
    resp, mask = out.batch["responses"][0], out.batch["response_mask"][0]
    result_ids = resp[(mask == 0) & (out.batch["attention_mask"][0, -256:] == 1)].tolist()
    assert not set(result_ids) & set(tok.all_special_ids)
    assert "evil <|im_end|><|endoftext|> tail" in tok.decode(result_ids)


def test_refill_and_duplicates(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    # every trajectory answers at once: no active trajectory to branch from → one refill per round
    loop, engine = _loop(tok, mode=mode, script=lambda r, k: Turn(ANSWER), n=4, initial_rollouts=2)
    out = loop.generate_sequences(_prompts(tok, ["a", "b"]))
    m = out.meta_info["metrics"]
    assert len(out) == 8 and m["rollout/fresh_refills"] == 4 and m.get("rollout/duplicates", 0) == 0
    assert [len(c) for c in engine.calls] == [4, 2, 2]  # 2+2 initial, then one refill per prompt per round
    # capped rounds: the rest is duplicated and counted
    loop, _ = _loop(tok, lambda r, k: Turn(ANSWER), n=4, initial_rollouts=1, max_rounds=2)
    out = loop.generate_sequences(_prompts(tok, ["a"]))
    assert len(out) == 4 and out.meta_info["metrics"]["rollout/duplicates"] == 2
    ids = list(out.non_tensor_batch["traj_id"])
    assert len(set(ids)) == 4 and out.non_tensor_batch["parent_id"][3] == ids[2]


def _branch_rounds(out, n_prompts, n):
    br = np.array(out.non_tensor_batch["branch_round"], dtype=int).reshape(n_prompts, n)
    return br


@pytest.mark.parametrize("timing", ["after_result", "before_call"])
@pytest.mark.parametrize("rule", ["arpo", "aepo"])
def test_branch_probability_follows_the_formula(tiny_tokenizer, rule, mode, timing):
    tok = tiny_tokenizer
    P, bp, w = 600, 0.3, 0.2
    # round entropies 1.0, 2.0, 9.0 (two calls, then the answer); pre-monitoring (AEPO) sees
    # H_root = 0 < H̄ → m_i = 1. before_call draws after rounds 0 and 1 with ΔH = 0 and 1.0;
    # after_result draws after rounds 1 and 2 (the tokens after results 1 and 2) with ΔH = 1.0 and
    # 8.0, and its branches fork at those rounds' starts (branch_round = round − 1).
    def script(req, k):
        if req.request_id.startswith("pm-root-"):
            return Turn("abc", entropy=0.0, finish="length")
        return Turn(CALL if k < 2 else ANSWER, entropy=[1.0, 2.0, 9.0][k])

    cfg = dict(n=2, initial_rollouts=1, beam_size=2, branch_probability=bp, entropy_weight=w, seed=7,
               entropy_timing=timing)
    if rule == "aepo":
        cfg.update(branch_rule="aepo", enable_dynamic_rollouts=True, branch_penalty_gamma=0.0)
    loop, _ = _loop(tok, mode=mode, script=script, **cfg)
    out = loop.generate_sequences(_prompts(tok, [f"q{i}" for i in range(P)]))
    br = _branch_rounds(out, P, 2)[:, 1]  # the second trajectory of each prompt: a branch or a refill
    dh = (0.0, 1.0) if timing == "before_call" else (1.0, 8.0)
    if rule == "arpo":   # U < clip(bp + w·ΔH)
        p0, p1 = (min(1.0, bp + w * d) for d in dh)
    else:                # U ≥ bp − w·ΔH (γ = 0)
        p0, p1 = (min(1.0, 1 - (bp - w * d)) for d in dh)
        assert out.meta_info["metrics"]["rollout/pre_monitor_tool_calls"] == 2 * P
    want = {0: p0, 1: (1 - p0) * p1}
    for r, p in want.items():
        freq = float(np.mean(br == r))
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / P), (r, freq, p)
    assert len(out) == 2 * P


def test_aepo_consecutive_branch_penalty(tiny_tokenizer):
    tok = tiny_tokenizer
    P = 300

    def script(req, k):
        if req.request_id.startswith("pm-root-"):
            return Turn("abc", entropy=0.0, finish="length")
        return Turn(CALL if k < 3 else ANSWER, entropy=1.0 + k)

    # γ = 1: a prompt that gained a trajectory last round cannot branch this round
    loop, _ = _loop(tok, script, n=4, initial_rollouts=1, beam_size=2, branch_probability=0.5,
                    entropy_weight=0.0, branch_rule="aepo", enable_dynamic_rollouts=True, branch_penalty_gamma=1.0,
                    dynamic_rollout_beta=50.0, seed=3, entropy_timing="before_call")
    out = loop.generate_sequences(_prompts(tok, [f"q{i}" for i in range(P)]))
    br = np.array(out.non_tensor_batch["branch_round"], dtype=int).reshape(P, 4)
    parents = np.array(out.non_tensor_batch["parent_id"], dtype=object).reshape(P, 4)
    ids = np.array(out.non_tensor_batch["traj_id"], dtype=object).reshape(P, 4)
    saw_unpenalised_round1 = False
    for i in range(P):
        parent_of = dict(zip(ids[i], parents[i]))

        def root(t):
            while parent_of.get(t) is not None:
                t = parent_of[t]
            return t
        # branch_round is the parent's own round index; for the first trajectory's lineage (started
        # in loop round 0) that is also the loop round in which the prompt gained the branch
        rounds = {int(r) for t, r, par in zip(ids[i], br[i], parents[i])
                  if par is not None and root(t) == f"p{i}-t0"}
        assert not ({0, 1} <= rounds or {1, 2} <= rounds), rounds
        saw_unpenalised_round1 |= 1 in rounds
    assert saw_unpenalised_round1


@pytest.mark.parametrize("timing", ["after_result", "before_call"])
def test_slot_budget_never_exceeded_and_same_seed_same_tree(tiny_tokenizer, mode, timing):
    tok = tiny_tokenizer
    script = calls_then_answer(3, entropies=[1.0, 3.0, 5.0, 5.0])
    cfg = dict(n=5, initial_rollouts=2, beam_size=3, branch_probability=0.9, entropy_weight=0.5, seed=11,
               entropy_timing=timing)
    loop, _ = _loop(tok, mode=mode, script=script, **cfg)
    a = loop.generate_sequences(_prompts(tok, ["a", "b", "c"], step=4))
    assert list(a.non_tensor_batch["uid"]) == ["u0"] * 5 + ["u1"] * 5 + ["u2"] * 5
    m = a.meta_info["metrics"]
    # every slot is an initial trajectory, a branch, a refill or a duplicate
    assert 3 * 2 + m["rollout/branches"] + m.get("rollout/fresh_refills", 0) + m.get("rollout/duplicates", 0) == 15
    if mode == "sync_with_tool":
        assert m["rollout/branches"] == 9   # this seed's draws fill all 3 × 3 free slots
    else:
        # async: siblings may race for a prompt's last slot (docs/algorithms.md, "Asynchronous
        # rollout"); with 2 calls and one branch per result, 2 trajectories can reach 8 = n, so no
        # race can happen and the tree must be the same twice
        script = calls_then_answer(2, entropies=[1.0, 3.0, 5.0])
        cfg = dict(n=8, initial_rollouts=2, beam_size=2, branch_probability=0.9, entropy_weight=0.5, seed=11,
                   entropy_timing=timing)
        loop, _ = _loop(tok, mode=mode, script=script, **cfg)
        a = loop.generate_sequences(_prompts(tok, ["a", "b", "c"], step=4))
        assert a.meta_info["metrics"]["rollout/branches"] > 0
    b = loop.generate_sequences(_prompts(tok, ["a", "b", "c"], step=4))
    assert _tree(a) == _tree(b)
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    loop2, _ = _loop(tok, mode=mode, script=script, **{**cfg, "branch_probability": 0.3, "entropy_weight": 0.0})
    trees = {tuple(_tree(loop2.generate_sequences(_prompts(tok, ["a", "b", "c"], step=s)))) for s in range(6)}
    assert len(trees) > 1  # the step enters the seed


def test_base_entropy_resets_between_calls(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    state = {"h": 0.0}
    # bp = 0, w = 1: p = ΔH. Call 1's first round has H = 0, call 2's has H = 1: a base carried over
    # from call 1 would give ΔH = 1 (always branch); the per-call base gives ΔH = 0 (never).
    loop, _ = _loop(tok, mode=mode, script=lambda r, k: Turn(CALL if k == 0 else ANSWER, entropy=state["h"]),
                    n=2, initial_rollouts=1, branch_probability=0.0, entropy_weight=1.0)
    loop.generate_sequences(_prompts(tok, ["a"] * 20))
    state["h"] = 1.0
    out = loop.generate_sequences(_prompts(tok, ["a"] * 20))
    assert out.meta_info["metrics"].get("rollout/branches", 0) == 0
    assert out.meta_info["metrics"]["rollout/fresh_refills"] == 20


def test_topk_proxy_entropy_matches_reference_definition():
    rows = [[-0.1, -2.5], [-0.7, -0.7]]
    want = sum(-(math.exp(a) * a + math.exp(b) * b) for a, b in rows) / math.log(600)
    assert branching.topk_proxy_entropy(rows, 600, window=20) == pytest.approx(want)
    assert branching.topk_proxy_entropy(rows, 600, window=1) == pytest.approx(
        -(math.exp(-0.1) * -0.1 + math.exp(-2.5) * -2.5) / math.log(600))
    assert branching.dynamic_initial_rollouts(16, 1.0, 1.0) == 9  # floor(16·0.5)+1
    assert branching.dynamic_initial_rollouts(16, -100.0, 0.0) == 1
    assert branching.dynamic_initial_rollouts(16, 100.0, 0.0) == 16  # floor(16)+1 clamped
    assert branching.aepo_branch_score(0.5, 1.0, 2, 0.2, 0.1) == pytest.approx(0.7 * 0.8)
    with pytest.raises(ValueError, match="entropy_mode"):
        branching.round_entropy(None, "mean", 10)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_outcome_reward_survives_masked_endings(tiny_tokenizer, estimator, mode):
    """[issue 15] Two trajectories whose last attended token has loss mask 0 — the forced EOS at
    call_limit, and a tool result cut by the length budget — keep their whole score: with γ = λ = 1
    and zero values, the return at the first response token equals the score."""
    from verl_arpo.algos.core_algos import (compute_gae_advantage_return,
                                            compute_reinforce_plus_plus_outcome_advantage)
    from verl_arpo.workers.reward_manager import NaiveRewardManager

    tok = tiny_tokenizer
    n_call = len(tok.encode(CALL, add_special_tokens=False))
    long_result = EchoTool("python", reply=lambda c: "word " * 200)
    cases = {  # name: (loop, expected finish reason)
        "call_limit": (_loop(tok, mode=mode, script=calls_then_answer(99), n=1, call_limit=1)[0], "call_limit"),
        "budget_cut": (_loop(tok, mode=mode, script=calls_then_answer(99), executor=make_executor(3, python=long_result),
                             n=1, response_length=n_call + 5)[0], "length"),
    }
    for name, (loop, reason) in cases.items():
        out = loop.generate_sequences(_prompts(tok, ["q"]))
        assert out.non_tensor_batch["finish_reason"][0] == reason, name
        mask = out.batch["response_mask"]
        attended = out.batch["attention_mask"][:, -mask.shape[1]:]
        last_attended = int(attended[0].nonzero().max())
        assert mask[0, last_attended] == 0, name  # the case under test: a masked ending
        out.non_tensor_batch["data_source"] = as_object_array(["x"])
        out.non_tensor_batch["reward_model"] = as_object_array([{"ground_truth": "1"}])
        score = 0.8
        rewards = NaiveRewardManager(tok, compute_score=lambda **kw: score, num_workers=0)(out)
        if estimator == "gae":
            _, returns = compute_gae_advantage_return(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
        else:
            _, returns = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=1.0)
        assert mask[0, 0] == 1
        assert returns[0, 0].item() == pytest.approx(score), name


@pytest.mark.parametrize("branch_rule", ["arpo", "aepo"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_branch_rule_and_pre_monitoring_are_separate_switches(tiny_tokenizer, branch_rule, dynamic, mode):
    """[issue 15] rollout.branch_rule picks the decision, enable_dynamic_rollouts only adds the
    pre-monitoring budget; all four combinations. With ΔH = 0 and γ = 0 the first-round branch
    frequency is bp under arpo (U < bp) and 1 − bp under aepo (U ≥ bp)."""
    tok = tiny_tokenizer
    P, bp = 400, 0.15

    def script(req, k):
        if req.request_id.startswith("pm-root-"):
            return Turn("abc", entropy=0.0, finish="length")
        return Turn(CALL if k < 1 else ANSWER, entropy=1.0)  # H̄ = 1 > H_root = 0 → m_i = 1

    loop, engine = _loop(tok, mode=mode, script=script, n=2, initial_rollouts=1, beam_size=2, branch_probability=bp,
                         entropy_weight=0.0, branch_rule=branch_rule, enable_dynamic_rollouts=dynamic,
                         branch_penalty_gamma=0.0, dynamic_rollout_beta=50.0, seed=1)
    out = loop.generate_sequences(_prompts(tok, [f"q{i}" for i in range(P)]))
    pre_monitored = any(r.request_id.startswith("pm-") for call in engine.calls for r in call)
    assert pre_monitored == dynamic
    assert ("rollout/pre_monitor_tool_calls" in out.meta_info["metrics"]) == dynamic
    freq = float(np.mean(_branch_rounds(out, P, 2)[:, 1] == 0))
    p = bp if branch_rule == "arpo" else 1 - bp
    assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / P), (freq, p)


def test_unknown_branch_rule_names_the_choices():
    with pytest.raises(ValueError, match="aepo"):
        section, kw = rollout(branch_rule="beam")
        build_agent_loop("sync_with_tool", None, None, None, section, **kw)


def test_progress_lines_count_finished_trajectories_tool_calls_and_tokens(tiny_tokenizer, monkeypatch, capsys):
    """One plain line per round (VERL_ARPO_PROGRESS_S=0), from rank 0 only; the counts match the
    batch the loop returns (2 prompts × n=2, two tool calls each, then the answer)."""
    tok = tiny_tokenizer
    monkeypatch.setenv("VERL_ARPO_PROGRESS_S", "0")
    monkeypatch.setenv("RANK", "0")
    loop, _ = _loop(tok, calls_then_answer(2), n=2)
    out = loop.generate_sequences(_prompts(tok, ["q one", "q two"]))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[rollout]")]
    assert [ln.split(":")[0] for ln in lines] == ["[rollout] round 1", "[rollout] round 2", "[rollout] round 3"]
    generated = int(out.meta_info["metrics"]["rollout/tokens_generated"])
    assert lines[-1].startswith(f"[rollout] round 3: 4/4 trajectories finished, 8 tool calls, {generated} tokens generated")
    assert lines[0].startswith("[rollout] round 1: 0/4 trajectories finished, 4 tool calls")
    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet
    loop.generate_sequences(_prompts(tok, ["q one"]))
    assert "[rollout]" not in capsys.readouterr().out


@pytest.mark.parametrize("p, fires", [(1.0, True), (0.0, False)])
def test_branch_draws_count_the_rules_chances(tiny_tokenizer, mode, p, fires):
    """rollout/branch_draws counts every draw of the branch rule (a trajectory's tool result while its
    prompt has a free slot), so branches / draws is how often the rule fires: always at p = 1, never
    at p = 0 (entropy weight 0), with draws made either way."""
    loop, _ = _loop(tiny_tokenizer, mode=mode, script=calls_then_answer(2), n=4, initial_rollouts=2, beam_size=2,
                    branch_probability=p, entropy_weight=0.0, seed=3)
    m = loop.generate_sequences(_prompts(tiny_tokenizer, ["a", "b"])).meta_info["metrics"]
    assert m["rollout/branch_draws"] >= 2 * 2  # each prompt's first two tool results at least
    assert m.get("rollout/branches", 0) == (m["rollout/branch_draws"] if fires else 0)


def test_the_driver_reports_the_fire_rate_over_ranks():
    from verl_arpo.trainer.ppo.ray_trainer import reduce_metrics

    out = reduce_metrics({"rollout/branches": [3.0, 1.0], "rollout/branch_draws": [8.0, 8.0]})
    assert out["rollout/branch_draws"] == 16.0 and out["rollout/branch_fire_rate"] == 4 / 16
    assert "rollout/branch_fire_rate" not in reduce_metrics({"rollout/branches": [0.0]})  # GRPO: no draws


def test_unpadded_prompt_ids_give_the_padded_layout(tiny_tokenizer, mode):
    """[issue 50] The trainer sends the dataset's unpadded `raw_prompt_ids` (no padded tensors): the
    rollout left-pads them once, to rollout.prompt_length, and its output is exactly what the same
    prompts sent as tensors padded to that width give (verl's callers still send tensors)."""
    tok = tiny_tokenizer
    texts, width = ["q one", "a longer question two"], 12
    enc = [tok.encode(t, add_special_tokens=False) for t in texts]
    padded = _prompts(tok, texts, width=width)   # the dataset's width: data.max_prompt_length
    raw = DataProto.from_dict(non_tensors={"uid": as_object_array(["u0", "u1"]), "raw_prompt_ids": as_object_array(enc)},
                              meta_info={"global_steps": 0})
    outs = []
    for prompts in (padded, raw):
        loop, _ = _loop(tok, mode=mode, script=calls_then_answer(1), n=2, prompt_length=width, seed=3)
        outs.append(loop.generate_sequences(prompts))
    assert outs[0].batch["input_ids"].shape[1] == width + 256
    for key in ("prompts", "input_ids", "attention_mask", "position_ids", "responses", "response_mask"):
        assert torch.equal(outs[0].batch[key], outs[1].batch[key]), key
    assert outs[1].batch["prompts"][2, width - len(enc[1]):].tolist() == enc[1]   # rows 2, 3: the second prompt
