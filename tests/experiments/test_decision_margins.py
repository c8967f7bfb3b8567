"""experiments/decision_margins.py: its probabilities against a token-by-token reference loop on a
tiny model, its flip counts against counts made by hand from reports written here, and its errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import decision_margins as dm  # noqa: E402

N = 6  # the first six test questions: multi, math, search, math, search, multi


def test_band_of_puts_each_probability_in_one_band():
    assert dm.band_of(0.0) == "0.00-0.05"
    assert dm.band_of(0.05) == "0.05-0.20"  # a lower edge belongs to the band above it
    assert dm.band_of(0.4999) == "0.35-0.50"
    assert dm.band_of(1.0) == "0.95-1.00"  # the last band is closed
    with pytest.raises(ValueError, match="outside"):
        dm.band_of(1.5)


def test_common_prefix_leaves_every_sequence_a_token():
    assert dm.common_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == [1, 2]
    assert dm.common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2]  # the shorter one keeps its last token
    assert dm.common_prefix([[7, 1], [8, 1]]) == [] and dm.common_prefix([]) == []


def _reference_prob(model, tok, prefix: str, choice: str) -> float:
    """P(choice | prefix) one token at a time: a forward pass per token, the last position's softmax."""
    import torch

    ids, p = tok.encode(prefix, add_special_tokens=False), 1.0
    for t in tok.encode(choice, add_special_tokens=False):
        with torch.no_grad():
            p *= float(torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)[t])
        ids = ids + [t]
    return p


def _report(rows, samples) -> dict:
    return {"samples": [{"index": i, "data_source": r["data_source"], "question": r["question"], "samples": [s]}
                        for i, (r, s) in enumerate(zip(rows, samples))]}


def _sample(text: str, tools: list[str], correct: bool) -> dict:
    return {"text": text, "tool_tags": tools, "correct": correct}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from verl_arpo.utils.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_probe_matches_a_reference_loop_and_counts_flips_by_hand(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_arpo.trainer.main_eval import load_eval_rows
    from verl_arpo.utils.chat_template import render_chat

    rows = load_eval_rows(ROOT / "rl_datasets" / "test.parquet")[:N]
    res = " </result>"
    own = [_sample("<think> s </think> <search>a</search> <result> x" + res + " <answer> 1 </answer>", ["search"], True),
           _sample("<think> p </think> <python>print(1)</python> <result> 1" + res + " <answer> 1 </answer>", ["python"], True),
           _sample("<think> s </think> <answer> 2 </answer>", [], False),  # no tool result: no second decision
           _sample("<think> p </think> <python>print(2)</python> <result> 2" + res + " <answer> 2 </answer>", ["python"], False),
           _sample("<think> s </think> <search>b</search> <result> y" + res + " <answer> 3 </answer>", ["search"], True),
           _sample("<think> s </think> <search>c</search> <result> z" + res + " <answer> 4 </answer>", ["search", "python"], True)]
    # trained model A: question 0 to Python first (right -> wrong), 2 now searches (wrong -> right), 3 right now
    a = [_sample("t", ["python"], False), _sample("t", ["python"], True), _sample("t", ["search"], True),
         _sample("t", ["python"], True), _sample("t", ["search"], True), _sample("t", ["search"], True)]
    # trained model B: question 1 searched (right -> wrong), nothing else moves
    b = [dict(s, text="t") for s in own]
    b[1] = _sample("t", ["search"], False)
    paths = {}
    for name, samples in [("own", own), ("A", a), ("B", b)]:
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(_report(rows, samples)))
    out = tmp_path / "margins.json"
    subprocess.run([sys.executable, str(ROOT / "experiments" / "decision_margins.py"), "--model", tiny,
                    "--limit", str(N), "--own_eval", str(paths["own"]), "--trained", f"A={paths['A']}",
                    "--trained", f"B={paths['B']}", "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    got = json.loads(out.read_text())

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32").eval()
    assert len(tok.encode(" <answer", add_special_tokens=False)) > 1  # the product over tokens is exercised
    recs = got["questions"]
    assert got["shared_prefix_tokens"] > 20  # the system prompt was encoded once and its cache reused
    assert [r["data_source"] for r in recs] == [r["data_source"] for r in rows]
    for r, row, s in zip(recs, rows, own):
        prompt = render_chat(tok, row["messages"], True)
        p_first = sum(_reference_prob(model, tok, prompt + "<think> I will", c) for c in (" search", " look"))
        assert r["p_first"] == pytest.approx(p_first, rel=1e-4)
        if "</result>" in s["text"]:
            head = prompt + s["text"].split("</result>")[0] + "</result>"
            pa, pt = (_reference_prob(model, tok, head, c) for c in (" <answer", " <think"))
            assert r["p_answer_now"] == pytest.approx(pa / (pa + pt), rel=1e-4)
        else:
            assert r["p_answer_now"] is None
    # each question sits in the band that holds its probability
    for f in got["flips"]:
        lo, hi = map(float, f["p_first_band"].split("-"))
        inside = [r for r in recs if r["data_source"] == f["data_source"] and lo <= r["p_first"] < hi]
        assert f["questions"] == len(inside)
    # the counts made by hand, per task type (summed over bands)
    by_src = {}
    for f in got["flips"]:
        acc = by_src.setdefault(f["data_source"], {})
        for k, v in f.items():
            if ":" in k:
                acc[k] = acc.get(k, 0) + v
    assert by_src["arpo_toy_multi"] == {"A:other_first_tool": 1, "A:right_to_wrong": 1, "A:wrong_to_right": 0,
                                        "B:other_first_tool": 0, "B:right_to_wrong": 0, "B:wrong_to_right": 0}
    assert by_src["arpo_toy_math"] == {"A:other_first_tool": 0, "A:right_to_wrong": 0, "A:wrong_to_right": 1,
                                       "B:other_first_tool": 1, "B:right_to_wrong": 1, "B:wrong_to_right": 0}
    assert by_src["arpo_toy_search"] == {"A:other_first_tool": 1, "A:right_to_wrong": 0, "A:wrong_to_right": 1,
                                         "B:other_first_tool": 0, "B:right_to_wrong": 0, "B:wrong_to_right": 0}
    margins = {m["data_source"]: m for m in got["margins"]}
    assert margins["arpo_toy_search"]["with_a_result"] == 1 and margins["arpo_toy_math"]["with_a_result"] == 2


def test_bad_arguments_are_refused_naming_the_fix(tiny, tmp_path):
    script = [sys.executable, str(ROOT / "experiments" / "decision_margins.py"), "--model", tiny, "--limit", "2"]
    r = subprocess.run(script + ["--trained", "A=x.json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "--trained needs --own_eval" in r.stderr
    r = subprocess.run(script + ["--own_eval", "o.json", "--trained", "x.json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "NAME=PATH" in r.stderr
    from verl_arpo.trainer.main_eval import load_eval_rows

    rows = load_eval_rows(ROOT / "rl_datasets" / "test.parquet")[:2]
    own = tmp_path / "own.json"
    own.write_text(json.dumps(_report(rows, [_sample("t", [], True)] * 2)))
    short = tmp_path / "short.json"
    short.write_text(json.dumps(_report(rows[:1], [_sample("t", [], True)])))
    r = subprocess.run(script + ["--own_eval", str(own), "--trained", f"S={short}", "--out", str(tmp_path / "o.json")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and "lacks 1 of the 2 questions" in r.stderr


def test_the_prompt_is_rendered_as_main_eval_renders_it(tiny, tmp_path):
    """--custom_chat_template and --chat_template_kwargs (main_eval's flags) shape the probed prompt:
    a template that prints a keyword argument before the question, probed against the reference loop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_arpo.trainer.main_eval import load_eval_rows

    template = ("{% for m in messages %}[{{ tag }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    out = tmp_path / "m.json"
    subprocess.run([sys.executable, str(ROOT / "experiments" / "decision_margins.py"), "--model", tiny, "--limit", "2",
                    "--custom_chat_template", template, "--chat_template_kwargs", '{"tag": "Qx"}', "--out", str(out)],
                   check=True, cwd=ROOT, timeout=600)
    got = json.loads(out.read_text())
    assert got["chat_template_kwargs"] == {"tag": "Qx"}
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32").eval()
    for r, row in zip(got["questions"], load_eval_rows(ROOT / "rl_datasets" / "test.parquet")[:2]):
        prompt = "".join(f"[Qx] {m['role']}: {m['content']}\n" for m in row["messages"]) + "assistant:"
        p_first = sum(_reference_prob(model, tok, prompt + "<think> I will", c) for c in (" search", " look"))
        assert r["p_first"] == pytest.approx(p_first, rel=1e-4)
