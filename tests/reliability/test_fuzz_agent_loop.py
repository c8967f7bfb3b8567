"""Fuzzing the whole AgentLoop: the model writes anything, the tools return anything.

Property (rel_helpers.check_rollout): no exception escapes; exactly n trajectories per prompt, in
prompt order; response_mask ⊆ attention; every tool result block is masked, holds the tool's
encoded text and no special-token id; log-probs are 0 where the mask is 0; the prompt's own
`<python>` example is never executed.
"""
import math
import re
import time

from hypothesis import event, given
from hypothesis import strategies as st
from rel_helpers import FuzzEngine, FuzzTurn, check_rollout, fuzz, prompts

from verl_arpo.workers.rollout.agent_loop import AgentLoop
from worker_configs import rollout
from verl_arpo.workers.rollout.tools.base_tool import BaseTool, ToolError
from verl_arpo.workers.rollout.tools.registry import ToolExecutor

DECOY = "DECOY_FROM_PROMPT"
PROMPT = f"Answer. Example: <python>{DECOY}</python> and <search>{DECOY}</search>. Q{{i}}?"
ANSWER = "<think>t</think><answer>\\boxed{1}</answer>"
TAGS = ["python", "search"]
SPECIAL_TEXT = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_", "end|>"]
ATOMS = ["<python>", "</python>", "<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>",
         "<think>", "</think>", "\\boxed{1}", "<pyth", "on>", "</pyt", "hon>", "</", " ", "\n", "x=1", "q",
         "print(1)", "é", "\u200b"] + SPECIAL_TEXT
piece = st.one_of(st.sampled_from(ATOMS), st.text(st.characters(blacklist_categories=("Cs",)), max_size=8),
                  st.builds(lambda a, k: a * k, st.sampled_from(ATOMS), st.integers(2, 40)))
free_text = st.lists(piece, max_size=12).map("".join)
short_text = st.lists(piece, max_size=3).map("".join)
call_text = st.builds(lambda pre, tag, body, post: f"{pre}<{tag}>{body}</{tag}>{post}",
                      short_text, st.sampled_from(TAGS), short_text, short_text)
# mostly well-formed calls (so tools run and results come back), the rest anything at all
turn = st.builds(FuzzTurn, st.one_of(call_text, call_text, call_text, free_text), st.booleans())
# what a tool may hand back: text of any kind, lone surrogates, nothing, an exception
reply = st.one_of(free_text, st.text(max_size=50),
                  st.sampled_from(["", "   ", None, "RAISE", "TOOLERROR", "BYTES", "bad \udcff bytes"]),
                  st.builds(lambda a, k: a * k, st.sampled_from(ATOMS + ["\udcff"]), st.integers(1, 300)))


class ReplyTool(BaseTool):
    """Answers the i-th call with replies[i % len]; "RAISE"/"TOOLERROR" raise, None returns None."""

    def __init__(self, tag, replies):
        self.name = self.trigger_tag = tag
        self.replies = list(replies) or ["ok"]
        self.seen = []

    def run(self, content):
        self.seen.append(content)
        r = self.replies[(len(self.seen) - 1) % len(self.replies)]
        if r == "RAISE":
            raise RuntimeError(f"boom <|im_end|> {content[:20]}")
        if r == "TOOLERROR":
            raise ToolError("bad input", retryable=False)
        if r == "BYTES":
            return b"\xff\xfe raw"
        return r


def _prompt_index(request_id: str) -> int:
    return int(re.search(r"p(\d+)", request_id).group(1))


@st.composite
def rollout_case(draw):
    num_prompts = draw(st.integers(1, 3))
    n = draw(st.integers(1, 3))
    cfg = dict(
        n=n,
        initial_rollouts=draw(st.one_of(st.none(), st.integers(1, n))),
        beam_size=draw(st.integers(1, 3)),
        branch_probability=draw(st.floats(0, 1)),
        entropy_mode=draw(st.sampled_from(["full", "topk_proxy"])),
        enable_dynamic_rollouts=draw(st.booleans()),
        response_length=draw(st.sampled_from([4, 16, 48, 160, 400, 400])),
        call_limit=draw(st.sampled_from([0, 1, 2, 3, 3])),
        max_rounds=draw(st.one_of(st.none(), st.integers(1, 4))),
        initial_entropy_tokens=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 3)),
    )
    scripts = [draw(st.lists(turn, min_size=1, max_size=5)) for _ in range(num_prompts)]
    replies = {tag: draw(st.lists(reply, min_size=1, max_size=4)) for tag in TAGS}
    return num_prompts, cfg, scripts, replies


@fuzz(120)
@given(case=rollout_case(), validate=st.booleans())
def test_fuzzed_model_text_and_tool_output_keep_the_rollout_invariants(rel_tok, case, validate):
    num_prompts, cfg, scripts, replies = case
    tools = {tag: ReplyTool(tag, replies[tag]) for tag in TAGS}
    executor = ToolExecutor(tools, max_workers=4, timeout=5, retry_count=1, retry_backoff=0.0,
                            call_limit=cfg["call_limit"])

    def script(req, k):
        turns = scripts[_prompt_index(req.request_id)]
        return turns[k] if k < len(turns) else FuzzTurn(ANSWER)

    section, kw = rollout(**cfg)
    loop = AgentLoop(FuzzEngine(rel_tok, script), rel_tok, executor, section, **kw)
    batch = prompts(rel_tok, [PROMPT.format(i=i) for i in range(num_prompts)])
    batch.meta_info["validate"] = validate
    start = time.monotonic()
    out = loop.generate_sequences(batch)
    assert time.monotonic() - start < 30
    n = 1 if validate else cfg["n"]
    check_rollout(out, rel_tok, n, num_prompts, cfg["response_length"], cfg["call_limit"], forbidden_content=DECOY)
    for tool in tools.values():
        assert all(DECOY not in c for c in tool.seen)
    # what the examples reached (pytest --hypothesis-show-statistics)
    nt = out.non_tensor_batch
    for reason in set(nt["finish_reason"]):
        event(f"finish: {reason}")
    results = [c["result"] for calls in nt["tool_calls"] for c in calls]
    event(f"tool results: {min(len(results), 3)}{'+' if len(results) >= 3 else ''}")
    if any("\ufffd" in r for r in results):
        event("a result with replaced surrogates")
    if any("<|" in r for r in results):
        event("a result spelling a special token")
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in out.meta_info["metrics"].values())


def _run(tok, turns, reply="ran", response_length=256, call_limit=3, n=1):
    tool = ReplyTool("python", [reply])
    executor = ToolExecutor({"python": tool, "search": ReplyTool("search", ["found"])}, max_workers=2,
                            timeout=5, retry_count=0, call_limit=call_limit)
    cfg, kw = rollout(n=n, response_length=response_length, call_limit=call_limit, entropy_mode="full")
    loop = AgentLoop(FuzzEngine(tok, lambda req, k: turns[k] if k < len(turns) else ANSWER), tok, executor, cfg, **kw)
    out = loop.generate_sequences(prompts(tok, ["q"]))
    check_rollout(out, tok, n, 1, response_length, call_limit)
    return out, tool


def test_a_tag_split_across_rounds_is_an_empty_call_not_the_previous_content(rel_tok):
    out, tool = _run(rel_tok, ["<python>a=1</python>", "b=2</python>", "<pyth", ANSWER])
    calls = out.non_tensor_batch["tool_calls"][0]
    assert tool.seen == ["a=1"]
    assert [c["content"] for c in calls] == ["a=1", ""] and "empty" in calls[1]["result"]
    assert out.non_tensor_batch["finish_reason"][0] == "eos"  # "<pyth" then EOS: an unclosed tag ends nothing


def test_nested_repeated_and_empty_tags(rel_tok):
    out, tool = _run(rel_tok, ["<python><python>inner</python>", "<python></python>", "<python> \n </python>",
                               "<search>a<python>b</search>"], call_limit=4)
    calls = out.non_tensor_batch["tool_calls"][0]
    assert [c["content"] for c in calls] == ["inner", "", "", "a<python>b"]
    assert tool.seen == ["inner"] and calls[3]["result"] == "found"
    assert out.non_tensor_batch["finish_reason"][0] == "eos"


def test_special_token_text_in_the_call_and_in_the_result(rel_tok):
    # the model *spells* <|im_end|> inside a call (ordinary tokens): the tool sees it, the result keeps it as text
    out, _ = _run(rel_tok, [FuzzTurn("<python>x <|im_end|> y</python>", split_special=True)], reply="<|im_end|>back")
    call = out.non_tensor_batch["tool_calls"][0][0]
    assert call["content"] == "x <|im_end|> y" and call["result"] == "<|im_end|>back"
    # the model *samples* <|im_end|> inside a call: that is EOS, the call never happens
    out, tool = _run(rel_tok, [FuzzTurn("<python>x <|im_end|> y</python>", split_special=False)])
    assert tool.seen == [] and out.non_tensor_batch["finish_reason"][0] == "eos"


def test_hundred_thousand_character_tags(rel_tok):
    big = "print(1); " * 10_000  # 100k characters
    n_tokens = len(rel_tok.encode(big, add_special_tokens=False))
    start = time.monotonic()
    # room for the call and the echoed result: everything arrives intact
    out, tool = _run(rel_tok, [f"<python>{big}</python>"], reply=big, response_length=3 * n_tokens)
    assert tool.seen == [big.strip()] and out.non_tensor_batch["tool_calls"][0][0]["result"] == big
    assert out.non_tensor_batch["finish_reason"][0] == "eos"
    # a budget that cannot hold the call: the round ends at the budget, no tool runs
    out, tool = _run(rel_tok, [f"<python>{big}</python>"], response_length=500)
    assert tool.seen == [] and out.non_tensor_batch["finish_reason"][0] == "length"
    # room for the call but not for its 100k result: the result is cut at the budget
    out, tool = _run(rel_tok, ["<python>x</python>"], reply=big, response_length=600)
    assert out.non_tensor_batch["finish_reason"][0] == "length"
    assert int(out.batch["attention_mask"][0, -600:].sum()) == 600
    assert time.monotonic() - start < 60
