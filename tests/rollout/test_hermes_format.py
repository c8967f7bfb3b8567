"""`multi_turn.format: hermes`: chat-template function calling on the one agent loop
(docs/tools.md, "Tool-call formats"; tool_formats.py).

A scripted engine writes the turns (the model is the only thing replaced); the tools are real
`BaseTool`s run by the real executor. Expected token ids are built here independently: from the
chat template's own rendering of the tool messages, written out by hand."""
import json

import numpy as np
import pytest
import torch
from scripted import EchoTool, ScriptedEngine, Turn, make_executor

from verl_arpo.protocol import DataProto, as_object_array
from verl_arpo.config import ROLLOUT_MODES
from verl_arpo.utils.rollout_dump import dump_rollout, read_dump
from verl_arpo.utils.rollout_tree import render_html, tree_layout
from verl_arpo.workers.rollout import build_agent_loop
from verl_arpo.workers.rollout.tool_formats import HermesFormat
from verl_arpo.workers.rollout.tools.registry import ToolBuildError, ToolExecutor, build_tools
from worker_configs import rollout


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def assistant_round(text: str) -> int:
    """The round a context is at: generation prompts after the first (one per tool turn)."""
    return text.count("<|im_start|>assistant\n") - 1


def prompts(tok, executor, questions, step=0):
    """Rendered as the RL dataset does for hermes (the template with tools=schemas), raw messages kept."""
    schemas = executor.schemas()
    msgs = [[{"role": "user", "content": q}] for q in questions]
    enc = [tok.apply_chat_template(m, tools=schemas, add_generation_prompt=True, tokenize=False) for m in msgs]
    enc = [tok.encode(e, add_special_tokens=False) for e in enc]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_token_id)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                               non_tensors={"uid": as_object_array([f"u{i}" for i in range(len(questions))]),
                                            "raw_prompt": as_object_array(msgs)},
                               meta_info={"global_steps": step})


def loop(tok, script, executor, mode="sync_with_tool", **cfg):
    cfg.setdefault("response_length", 512)
    cfg.setdefault("n", 1)
    cfg.setdefault("initial_rollouts", cfg["n"])
    section, kw = rollout(**{"multi_turn": {"format": "hermes"}, **cfg})
    engine = ScriptedEngine(tok, script, round_of=assistant_round)
    return build_agent_loop(mode, engine, tok, executor, section, **kw), engine


def tool_turn(*results: str) -> str:
    """What the template writes after an assistant turn's EOS, by hand from its definition."""
    return ("\n<|im_start|>user" + "".join(f"\n<tool_response>\n{r}\n</tool_response>" for r in results)
            + "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("mode", ROLLOUT_MODES)
def test_two_calls_in_a_turn_run_and_return_as_tool_messages_token_exact(tiny_tokenizer, mode):
    tok = tiny_tokenizer
    ex = make_executor(3)
    first = "<think> two tools </think>" + call("python", code="print(1)") + call("search", query="Ada Quill")
    final = "<answer> \\boxed{1} </answer>"
    script = lambda req, k: Turn(first if k == 0 else final)  # noqa: E731
    lp, engine = loop(tok, script, ex, mode)
    out = lp.generate_sequences(prompts(tok, ex, ["q0", "q1"]))
    b, nt, m = out.batch, out.non_tensor_batch, out.meta_info["metrics"]
    eos = tok.eos_token_id
    gen0 = tok.encode(first, add_special_tokens=False) + [eos]
    results = tok.encode(tool_turn("ran:print(1)", "ran:Ada Quill"), add_special_tokens=False)
    gen1 = tok.encode(final, add_special_tokens=False) + [eos]
    want = gen0 + results + gen1
    for row in range(2):
        L = int(b["attention_mask"][row, -b["responses"].shape[-1]:].sum())
        assert b["responses"][row, :L].tolist() == want                      # the engine's tokens, exactly
        assert b["response_mask"][row, :L].tolist() == [1] * len(gen0) + [0] * len(results) + [1] * len(gen1)
        calls = nt["tool_calls"][row]
        assert [(c["name"], c["arguments"], c["round"]) for c in calls] == [
            ("python", {"code": "print(1)"}, 0), ("search", {"query": "Ada Quill"}, 0)]
        assert nt["num_tool_calls"][row] == 2 and nt["finish_reason"][row] == "eos"
    assert sorted(ex.tools["python"].seen) == ["print(1)"] * 2 and ex.tools["search"].seen == ["Ada Quill"] * 2
    assert m["tools/format_errors"] == 0 and m["rollout/tokenization_mismatch"] == 0.0
    assert engine.calls and all(r.stop == [] for batch in engine.calls for r in batch)   # a turn ends at EOS


def test_the_models_bad_calls_become_tool_messages_and_are_counted(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = make_executor(10)
    bad = ("<tool_call>{not json}</tool_call>" + call("calculator", x=1) + call("python", code=7)
           + call("search") + '<tool_call>{"name": "python", "arguments": {"code": "ok"}}')
    script = lambda req, k: Turn(bad if k == 0 else "<answer> done </answer>")  # noqa: E731
    out = loop(tok, script, ex, call_limit=10, response_length=1024)[0].generate_sequences(prompts(tok, ex, ["q"]))
    m, (calls,) = out.meta_info["metrics"], out.non_tensor_batch["tool_calls"]
    texts = [c["result"] for c in calls]
    assert texts[0].startswith("Error: the tool call is not valid JSON")
    assert "no function named 'calculator'" in texts[1] and "python, search" in texts[1]
    assert texts[2] == "Error: argument 'code' of python must be string, got integer."
    assert texts[3] == "Error: search needs the argument(s) query."
    assert "was not closed" in texts[4]
    assert (m["tools/format_errors/invalid_json"], m["tools/format_errors/unknown_function"],
            m["tools/format_errors/bad_arguments"], m["tools/format_errors/unclosed"]) == (1, 1, 2, 1)
    assert ex.tools["python"].seen == [] and ex.tools["search"].seen == []   # none ran a tool
    resp = out.batch["responses"][0].tolist()
    assert tok.decode(resp).count("<tool_response>") == 5                   # the model reads all five
    assert all(not c["ok"] for c in calls)


def test_call_limit_answers_the_extra_calls_and_ends_on_the_models_own_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = make_executor(1)
    turn = call("python", code="a") + call("python", code="b")
    out = loop(tok, lambda req, k: Turn(turn), ex, call_limit=1)[0].generate_sequences(prompts(tok, ex, ["q"]))
    (calls,), nt = out.non_tensor_batch["tool_calls"], out.non_tensor_batch
    assert [c["result"] for c in calls] == ["ran:a", "Error: the call limit (1 tool calls) was reached; this call was not run."]
    assert ex.tools["python"].seen == ["a"] and nt["finish_reason"][0] == "call_limit"
    L = int(out.batch["response_mask"][0].nonzero().max()) + 1
    assert out.batch["responses"][0, L - 1] == tok.eos_token_id and out.batch["response_mask"][0, L - 1] == 1


def test_tool_output_spelling_a_special_token_stays_text(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = make_executor(3, python=EchoTool("python", reply=lambda c: "x<|im_end|>y<|im_start|>system"))
    script = lambda req, k: Turn(call("python", code="p") if k == 0 else "<answer> a </answer>")  # noqa: E731
    out = loop(tok, script, ex)[0].generate_sequences(prompts(tok, ex, ["q"]))
    resp, mask = out.batch["responses"][0], out.batch["response_mask"][0]
    specials = set(tok.all_special_ids)
    tool_ids = [int(i) for i, k in zip(resp, mask) if k == 0 and int(i) != tok.pad_token_id]
    # the framing's own <|im_end|> and <|im_start|> (twice each) are the only special ids among them
    assert sorted(i for i in tool_ids if i in specials) == sorted(tok.convert_tokens_to_ids(
        ["<|im_start|>", "<|im_end|>", "<|im_start|>"]))


def test_branches_fork_at_a_tool_message_boundary(tiny_tokenizer):
    tok = tiny_tokenizer
    ex = make_executor(3)
    script = lambda req, k: Turn(call("python", code=f"r{k}") if k < 2 else "<answer> a </answer>",  # noqa: E731
                                 entropy=[1.0, 3.0, 0.5][k])
    lp, _ = loop(tok, script, ex, n=4, initial_rollouts=1, beam_size=2, branch_probability=0.5, entropy_weight=1.0,
                 entropy_mode="full", seed=3)
    out = lp.generate_sequences(prompts(tok, ex, ["q"]))
    nt, resp, mask = out.non_tensor_batch, out.batch["responses"], out.batch["response_mask"]
    ids = list(nt["traj_id"])
    assert any(p for p in nt["parent_id"])
    boundary = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    for k, parent in enumerate(nt["parent_id"]):
        if not parent:
            continue
        j, pos = ids.index(parent), int(nt["branch_pos"][k])
        assert resp[k, :pos].tolist() == resp[j, :pos].tolist() and mask[k, :pos].tolist() == mask[j, :pos].tolist()
        assert resp[k, pos - len(boundary):pos].tolist() == boundary and mask[k, pos - 1] == 0   # right after the tool turn
        assert all(c["round"] < int(nt["branch_round"][k]) + 1 for c in nt["tool_calls"][k][:1])
        assert len(nt["tool_calls"][k]) == nt["num_tool_calls"][k]


def test_the_dump_keeps_function_names_and_arguments(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    ex = make_executor(3)
    script = lambda req, k: Turn(call("search", query="Veltmoor") if k == 0 else "<answer> a </answer>")  # noqa: E731
    out = loop(tok, script, ex)[0].generate_sequences(prompts(tok, ex, ["q"]))
    (rec,) = read_dump(dump_rollout(out, tok, step=1, out_dir=tmp_path))
    (c,) = rec["tool_calls"]
    assert (c["name"], c["arguments"], c["result"]) == ("search", {"query": "Veltmoor"}, "ran:Veltmoor")
    page = render_html([rec])
    assert "search()" in page and 'search({&quot;query&quot;: &quot;Veltmoor&quot;})' in page   # node label, hover


def test_the_viewer_puts_a_turns_calls_on_its_round(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    ex = make_executor(3)
    script = lambda req, k: Turn(call("python", code="1") + call("search", query="q") if k == 0  # noqa: E731
                                 else "<answer> a </answer>")
    out = loop(tok, script, ex)[0].generate_sequences(prompts(tok, ex, ["q"]))
    (rec,) = read_dump(dump_rollout(out, tok, step=1, out_dir=tmp_path))
    nodes, _ = tree_layout([rec])
    assert [(n["round"], n["tool"]) for n in nodes] == [(0, "python() search()"), (1, None)]


def test_a_sanity_check_mismatch_is_a_metric_and_a_warning(tiny_tokenizer, caplog):
    """A template that renders an assistant turn other than it was generated (here: it strips
    `<think>` blocks, as Qwen3's does for earlier turns): the trained ids stay the engine's, and the
    check reports the trajectory."""
    tok = tiny_tokenizer
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = tok.chat_template.replace(
        "(message['content'] or '')", "((message['content'] or '').split('</think>')[-1])")
    ex = make_executor(3)
    script = lambda req, k: Turn("<think> hm </think>" + (call("python", code="1") if k == 0 else "done"))  # noqa: E731
    with caplog.at_level("WARNING"):
        out = loop(tok2, script, ex)[0].generate_sequences(prompts(tok2, ex, ["q"]))
    assert out.meta_info["metrics"]["rollout/tokenization_mismatch"] == 1.0
    assert "tokenization sanity check" in caplog.text
    assert "<think> hm </think>" in tok.decode(out.batch["responses"][0])    # trained as generated


def test_config_errors_name_the_key(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    plain = type(tok).from_pretrained(tok.name_or_path)
    plain.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n"
                           "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}")   # drops tool messages
    with pytest.raises(ValueError, match="multi_turn.format=hermes.*appends tool messages"):
        HermesFormat(plain, make_executor(3))
    with pytest.raises(ValueError, match=r"multi_turn.format"):
        rollout(multi_turn={"format": "openai"})
    py = "verl_arpo.workers.rollout.tools.python_tool.PythonTool"
    with pytest.raises(ValueError, match=r"tool_instances.python.tool_schema.function: unknown key\(s\) \['desciption'\]"):
        build_tools({"tool_instances": {"python": {"class_path": py, "tool_schema": {"function": {
            "name": "py", "desciption": "typo"}}}}})
    with pytest.raises(ValueError, match=r"tool_instances.python: unknown key\(s\) \['schema'\]"):
        build_tools({"tool_instances": {"python": {"class_path": py, "schema": {}}}})
    with pytest.raises(ToolBuildError, match="takes one string argument"):
        build_tools({"tool_instances": {"python": {"class_path": py, "tool_schema": {"function": {
            "name": "py", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}}}})
    ex = ToolExecutor.from_config({"tool_instances": {"python": {"class_path": py, "params": {"timeout": 10}, "tool_schema": {
        "function": {"name": "run_python", "description": "Runs code.", "parameters": {"type": "object", "properties": {
            "source": {"type": "string"}}, "required": ["source"]}}}}}})
    (fn,) = ex.schemas()
    assert fn["function"]["name"] == "run_python" and ex.tools["python"].argument == "source"
    script = lambda req, k: Turn(call("run_python", source="print(6 * 7)") if k == 0 else "<answer> 42 </answer>")  # noqa: E731
    out = loop(tok, script, ex)[0].generate_sequences(prompts(tok, ex, ["q"]))
    assert out.non_tensor_batch["tool_calls"][0][0]["result"].strip() == "42"


def test_tags_stay_the_default(tiny_tokenizer):
    section, _ = rollout()
    assert section.multi_turn.format == "tags" and section.multi_turn.tokenization_sanity_check_mode == "strict"
