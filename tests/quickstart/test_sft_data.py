"""The SFT loss mask covers exactly the assistant-written text (tool results and other turns excluded)."""
import pytest

from verl_arpo.trainer.sft_data import (SYSTEM_PROMPT, read_records, split_assistant, to_messages,
                                        tokenize_conversation)

EOS = "<|im_end|>"


def _runs(tok, item):
    """Decoded text of each maximal run of equal mask value: [(mask, text), ...]."""
    runs, cur, ids = [], None, []
    for t, m in zip(item["input_ids"], item["loss_mask"]):
        if m != cur and ids:
            runs.append((cur, tok.decode(ids, skip_special_tokens=False)))
            ids = []
        cur = m
        ids.append(t)
    runs.append((cur, tok.decode(ids, skip_special_tokens=False)))
    return runs


def _trained(tok, item):
    return [text for m, text in _runs(tok, item) if m == 1]


def test_inline_results_are_masked(tiny_tokenizer):
    tok = tiny_tokenizer
    gen1 = "<think> I will compute 12 * 34. </think> <python>print(12 * 34)</python>"
    result = " <result>\n408\n</result>"
    gen2 = " <answer> \\boxed{408} </answer>"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 12 * 34?"},
                {"role": "assistant", "content": gen1 + result + gen2}]
    item = tokenize_conversation(tok, messages)
    # the sequence is the chat template's text, and the trained runs are exactly what the model writes
    assert tok.decode(item["input_ids"], skip_special_tokens=False) == tok.apply_chat_template(messages, tokenize=False)
    assert _trained(tok, item) == [gen1, gen2 + EOS]
    masked = [text for m, text in _runs(tok, item) if m == 0]
    assert masked[1] == result and masked[-1] == "\n"
    assert masked[0].endswith("<|im_start|>assistant\n") and "What is 12 * 34?" in masked[0]


def test_result_tokens_match_the_rollout_encoding(tiny_tokenizer):
    from verl_arpo.workers.rollout.tool_text import encode_tool_result

    tok = tiny_tokenizer
    content = "<python>print(1)</python> <result>\n1\n</result> <answer> \\boxed{1} </answer>"
    item = tokenize_conversation(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}])
    ids, mask = item["input_ids"], item["loss_mask"]
    gen1 = tok.encode("<python>print(1)</python>", add_special_tokens=False)
    start = max(i for i in range(len(ids) - len(gen1) + 1) if ids[i:i + len(gen1)] == gen1) + len(gen1)
    res = encode_tool_result(tok, "1")
    assert ids[start:start + len(res)] == res and set(mask[start:start + len(res)]) == {0}


def test_seeds_format_result_turns_are_masked(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = {"conversations": [
        {"from": "user", "value": "What is 2+2?"},
        {"from": "assistant", "value": "<think>Let me calculate</think><python>print(2+2)</python>"},
        {"from": "user", "value": "<result>4</result>"},
        {"from": "assistant", "value": "The answer is 4"},
    ]}
    item = tokenize_conversation(tok, to_messages(rec))
    assert _trained(tok, item) == ["<think>Let me calculate</think><python>print(2+2)</python>" + EOS,
                                   "The answer is 4" + EOS]


def test_tool_role_and_sharegpt_names(tiny_tokenizer):
    tok = tiny_tokenizer
    rec = {"system": "sys", "conversations": [
        {"from": "human", "value": "find X"}, {"from": "gpt", "value": "<search>X</search>"},
        {"from": "observation", "value": "Page 1: X is Y"}, {"from": "gpt", "value": "<answer> \\boxed{Y} </answer>"},
        {"from": "human", "value": "thanks"}]}
    messages = to_messages(rec)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    item = tokenize_conversation(tok, messages)
    assert _trained(tok, item) == ["<search>X</search>" + EOS, "<answer> \\boxed{Y} </answer>" + EOS]
    assert "thanks" not in tok.decode(item["input_ids"])  # trailing non-assistant turns are dropped


def test_truncation_modes(tiny_tokenizer):
    msgs = [{"role": "user", "content": "q " * 50}, {"role": "assistant", "content": "a " * 50}]
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tiny_tokenizer, msgs, max_length=20)
    assert tokenize_conversation(tiny_tokenizer, msgs, max_length=20, truncation="skip") is None
    cut = tokenize_conversation(tiny_tokenizer, msgs, max_length=20, truncation="right")
    assert len(cut["input_ids"]) == len(cut["loss_mask"]) == 20


def test_split_assistant_and_bad_records():
    assert split_assistant("a <result>\nx\n</result> b") == [("a", 1), (" <result>\nx\n</result>", 0), (" b", 1)]
    with pytest.raises(ValueError, match="no assistant"):
        to_messages({"conversations": [{"from": "user", "value": "q"}]})
    with pytest.raises(ValueError, match="known role"):
        to_messages({"conversations": [{"from": "robot", "value": "q"}]})


def test_bundled_sft_file_masks_every_tool_result(tiny_tokenizer):
    """Every record of rl_datasets/sft_train.jsonl: trained text = the trajectory minus its results."""
    import re
    from pathlib import Path

    tok = tiny_tokenizer
    recs = read_records(Path(__file__).resolve().parents[2] / "rl_datasets" / "sft_train.jsonl")
    for rec in recs[:30]:
        traj = rec["conversations"][-1]["value"]
        item = tokenize_conversation(tok, to_messages(rec))
        expected = re.sub(r" <result>.*?</result>", "", traj, flags=re.S) + EOS
        assert "".join(_trained(tok, item)) == expected


def test_function_calls_train_and_tool_messages_do_not(tiny_tokenizer, tmp_path):
    """A hermes conversation (assistant tool_calls, a role: tool message, the record's schemas):
    trained exactly the two assistant turns up to their EOS, as the template renders them."""
    import json

    from verl_arpo.trainer.main_sft import SFTDataset
    from verl_arpo.workers.rollout.tools.python_tool import PythonTool

    tok = tiny_tokenizer
    tools = PythonTool().functions()
    rec = {"tools": json.dumps(tools), "messages": [
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "python",
                                                                           "arguments": {"code": "print(12 * 34)"}}}]},
        {"role": "tool", "name": "python", "content": "408"},
        {"role": "assistant", "content": "<answer> \\boxed{408} </answer>"}]}
    (tmp_path / "fc.jsonl").write_text(json.dumps(rec) + "\n")
    (item,) = SFTDataset(tmp_path / "fc.jsonl", tok, max_length=2048).items
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12 * 34)"}}</tool_call>'
    assert _trained(tok, item) == [call + EOS, "<answer> \\boxed{408} </answer>" + EOS]
    untrained = [text for m, text in _runs(tok, item) if m == 0]
    assert "<tools>" in untrained[0] and '"name": "python"' in untrained[0]      # the schemas in the prompt
    assert untrained[1] == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="tool_calls belong to an assistant turn"):
        to_messages({"messages": [{"role": "user", "content": "q", "tool_calls": [{"name": "f"}]},
                                  {"role": "assistant", "content": "a"}]})
