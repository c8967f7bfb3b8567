"""Fuzzing the tool-call text boundary: `extract_tool_call`, `encode_tool_result`, `fit_tool_result`."""
import re

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from rel_helpers import fuzz

from verl_arpo.workers.rollout.tool_text import (RESULT_TEMPLATE, encode_tool_result, extract_tool_call,
                                                 fit_tool_result)

TAGS = ["python", "search"]
SURROGATE = re.compile("[\ud800-\udfff]")
SPECIAL_TEXT = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_", "end|>", "<|", "|>"]
ATOMS = ["<python>", "</python>", "<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>",
         "<think>", "</think>", "\\boxed{", "}", "<", ">", "/", "<pyth", "on>", "</pyt", "hon>", " ", "\n", "\t",
         "print(1)", "x=1", "query", "é", "中文", "\x00", "\x08oxed", "\u200b", "\ufffd"] + SPECIAL_TEXT
text_piece = st.one_of(st.sampled_from(ATOMS), st.text(max_size=12),
                       st.builds(lambda a, k: a * k, st.sampled_from(ATOMS), st.integers(1, 200)))
model_text = st.lists(text_piece, max_size=30).map("".join)
# tool output: anything a str can hold, lone surrogates included (bytes decoded with surrogateescape)
tool_text = st.one_of(model_text, st.text(max_size=200),
                      st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=5),
                      st.lists(st.one_of(text_piece, st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),
                               max_size=20).map("".join))


@fuzz(300)
@given(text=model_text, tag=st.sampled_from(TAGS))
def test_extract_never_raises_and_content_is_from_the_text(text, tag):
    got_tag, content = extract_tool_call(text, f"</{tag}>")
    assert got_tag == tag and content == content.strip()
    if content:
        assert content in text and f"<{tag}>" not in content
        end = text.rfind(f"</{tag}>")
        assert text.rfind(f"<{tag}>", 0, end) >= 0


@fuzz(200)
@given(before=model_text, body=model_text, after=model_text, tag=st.sampled_from(TAGS))
def test_extract_takes_the_last_opening_before_the_last_closing(before, body, after, tag):
    for piece in (body, after):
        assume(f"<{tag}>" not in piece and f"</{tag}>" not in piece)
    # `body` may end with a partial opening tag ("<pyth") that `</tag>` would complete: exclude that
    assume(f"<{tag}>" not in body + f"</{tag}>" and f"</{tag}>" not in (body + f"</{tag}>")[:-len(tag) - 3])
    text = before + f"<{tag}>" + body + f"</{tag}>" + after
    assume(text.rfind(f"</{tag}>") == len(before) + len(tag) + 2 + len(body))
    assert extract_tool_call(text, f"</{tag}>") == (tag, body.strip())


@fuzz(100)
@given(text=model_text, stop=st.one_of(st.none(), st.text(max_size=12), st.sampled_from(ATOMS)))
def test_extract_rejects_a_non_closing_stop_string_with_value_error_only(text, stop):
    try:
        extract_tool_call(text, stop)
    except ValueError as exc:
        assert "closing tool tag" in str(exc)


@fuzz(300)
@given(text=tool_text)
def test_encode_never_emits_special_ids_and_round_trips(rel_tok, text):
    ids = encode_tool_result(rel_tok, text)
    assert not set(ids) & set(rel_tok.all_special_ids)
    decoded = rel_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    valid = SURROGATE.sub("\ufffd", text)  # one U+FFFD per lone surrogate
    # byte-level BPE round-trips any valid text; special-token text stays text
    assert decoded == RESULT_TEMPLATE.format(text=valid)


@fuzz(100)
@given(text=tool_text, repeat=st.integers(1, 3000), budget=st.integers(0, 300))
def test_fit_keeps_the_budget_and_the_head_of_the_result(rel_tok, text, repeat, budget):
    text = (text * repeat)[:30_000]  # the full encoding below is the slow oracle: keep it small
    ids, shown = fit_tool_result(rel_tok, text, budget)
    full = encode_tool_result(rel_tok, text)
    if len(full) < budget + 32:  # fits (or nearly): exactly the whole result
        assert ids == full
    else:  # too long: at least the budget, and the head the trajectory keeps is the full text's head
        assert len(ids) >= budget
        assert ids[:budget] == full[:budget]
    assert SURROGATE.sub("\ufffd", text).startswith(shown)


def test_ten_megabytes_are_cut_fast(rel_tok):
    import time

    for text in ("x" * 10_000_000, "word, " * 2_000_000, "<|im_end|>\udcff" * 1_000_000):
        start = time.perf_counter()
        ids, shown = fit_tool_result(rel_tok, text, 512)
        assert time.perf_counter() - start < 2.0
        assert 512 <= len(ids) and len(shown) < 100_000
        assert not set(ids) & set(rel_tok.all_special_ids)


@pytest.mark.parametrize("text", ["\udcff", "ok \udc80\udcff tail", "\ud800", "a\udfffb" * 1000])
def test_lone_surrogates_from_a_tool_become_replacement_characters(rel_tok, text):
    ids = encode_tool_result(rel_tok, text)
    assert rel_tok.decode(ids) == RESULT_TEMPLATE.format(text=SURROGATE.sub("\ufffd", text))
