"""main_eval: pass@k and Wilson by hand, the LLM judge against a real HTTP server on 127.0.0.1, data
loading (our parquet, data/<benchmark>/test.jsonl with GAIA keys), and end-to-end runs (a scripted
engine for exact scores; the tiny model through the CLI)."""
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from verl_arpo.trainer import main_eval
from verl_arpo.trainer.main_eval import LLMJudge, load_eval_rows, pass_at_k, wilson_interval
from verl_arpo.workers.rollout.engines.base import GenOutput, InferenceEngine

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-secret-123"


# --------------------------------------------------------------------------- statistics
def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(4, 1, 3) == pytest.approx(0.75)         # 1 - C(3,3)/C(4,3) = 1 - 1/4
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_pass_at_k_small_cases_exact():
    from math import comb

    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_wilson_interval():
    lo, hi = wilson_interval(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo, hi = wilson_interval(0.0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)


# --------------------------------------------------------------------------- the judge server
class _JudgeHandler(BaseHTTPRequestHandler):
    """OpenAI-style chat completions: 'yes' when the predicted answer is in the server's table."""

    def do_POST(self):  # noqa: N802
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != f"Bearer {KEY}":
            return self._send(401, {"error": "unauthorized"})
        if srv.fail_next > 0:
            srv.fail_next -= 1
            return self._send(503, {"error": "busy"})
        user = body["messages"][-1]["content"]
        pred = user.split("Predicted answer: ")[1].split("\n")[0]
        reply = "maybe" if pred == "unsure" else ("Yes." if any(a in pred for a in srv.accept) else "no")
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": reply}}]})

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def judge_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _JudgeHandler)
    srv.requests, srv.fail_next, srv.accept = [], 0, ["seventeen", "Paris"]
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_judge_against_local_http_server(judge_server, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    base = f"http://127.0.0.1:{judge_server.server_port}"
    judge = LLMJudge(base, "judge-model", "JUDGE_KEY", timeout=5)
    assert judge.url == base + "/v1/chat/completions"
    assert judge.verdict("What is 10 + 7?", "17", "seventeen") is True
    assert judge.verdict("What is 10 + 7?", ["17"], "eighteen") is False
    assert judge.verdict("q", "17", "unsure") is None
    judge_server.fail_next = 1  # a 503 is retried
    assert judge.verdict("Capital of France?", "Paris", "Paris, France") is True
    req = judge_server.requests[0]
    assert req["auth"] == f"Bearer {KEY}" and req["body"]["model"] == "judge-model"
    assert req["body"]["messages"][0]["role"] == "system" and "17" in req["body"]["messages"][1]["content"]
    assert dict(judge.stats) == {"calls": 4, "yes": 2, "no": 1, "unparsed": 1}
    # wrong key: an error verdict (None), counted; the key appears in no log line and not in repr
    with caplog.at_level(logging.DEBUG):
        bad = LLMJudge(base + "/v1", "m", "NO_SUCH_VAR", timeout=5, retries=0)
        assert bad.verdict("q", "17", "seventeen") is None and bad.stats["errors"] == 1
    assert KEY not in repr(judge) and KEY not in caplog.text


# --------------------------------------------------------------------------- data loading
def test_load_bundled_parquet_and_gaia_jsonl(tmp_path):
    rows = load_eval_rows(ROOT / "rl_datasets" / "test.parquet")
    assert len(rows) == 600 and {r["data_source"] for r in rows} == {"arpo_toy_math", "arpo_toy_search", "arpo_toy_multi"}
    assert rows[0]["messages"][0]["role"] == "system" and rows[0]["question"] == rows[0]["messages"][-1]["content"]
    gaia = tmp_path / "data" / "gaia" / "test.jsonl"
    gaia.parent.mkdir(parents=True)
    gaia.write_text(json.dumps({"task_id": "t1", "Question": "How many?", "Level": 1, "Final answer": "17"}) + "\n")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"question": "Who?", "answer": ["Ada", "Ada Quill"]}) + "\n")
    g = load_eval_rows(gaia)[0]
    assert g["data_source"] == "gaia" and g["ground_truth"] == "17" and g["messages"][-1]["content"] == "How many?"
    q = load_eval_rows(tmp_path / "qa.jsonl", system_prompt="", data_source="hotpotqa")[0]
    assert q["ground_truth"] == ["Ada", "Ada Quill"] and q["data_source"] == "hotpotqa" and len(q["messages"]) == 1
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt_text": "x"}) + "\n")
    with pytest.raises(ValueError, match="needs a question"):
        load_eval_rows(tmp_path / "bad.jsonl")


# --------------------------------------------------------------------------- end to end
class _ScriptedEngine(InferenceEngine):
    """Trajectory t0 of every prompt computes with Python and answers; t1 answers 0 without tools."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_ids = tokenizer, [tokenizer.eos_token_id]

    def generate(self, requests):
        outs = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids)
            a, b = map(int, text.split("What is ")[-1].split("?")[0].split(" * "))
            if r.request_id.endswith("-t1"):
                reply, finish = "<think> guess </think> <answer> \\boxed{0} </answer>", "eos"
            elif "<result>" not in text.split("assistant")[-1]:
                reply, finish = f"<think> compute </think> <python>print({a} * {b})</python>", "stop"
            else:
                reply, finish = f" <answer> \\boxed{{{a * b}}} </answer>", "eos"
            ids = self.tokenizer.encode(reply, add_special_tokens=False) + ([self.eos_token_ids[0]] if finish == "eos" else [])
            outs.append(GenOutput(ids, finish, "</python>" if finish == "stop" else None, [-0.1] * len(ids),
                                  [[-0.1]] * len(ids), None))
        return outs

    def update_weights(self, named_tensors):
        pass


def test_scripted_engine_scores_exactly(tiny_model_dir, tiny_tokenizer, tmp_path):
    data = tmp_path / "mul.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n"
                            for a, b in [(123, 45), (67, 89), (1001, 7)]))
    args = main_eval.build_parser().parse_args([
        "--model", tiny_model_dir, "--data", str(data), "--k", "2", "--data_source", "arpo_toy_math",
        "--tools", "configs/tools/python_only.yaml", "--max_response_length", "128", "--out", str(tmp_path / "r.json")])
    report = main_eval.run_eval(args, engine=_ScriptedEngine(tiny_tokenizer), tokenizer=tiny_tokenizer)
    m = report["per_data_source"]["arpo_toy_math"]
    assert m["n_questions"] == 3 and m["pass@1"] == 0.5 and m["pass@2"] == 1.0
    assert m["tool_calls_per_question"] == 0.5 and m["tool_calls_per_question_by_tag"] == {"python": 0.5}
    first = report["samples"][0]["samples"][0]
    assert first["correct"] and "<result>\n5535\n" in first["text"]  # the sandbox really ran
    assert json.loads((tmp_path / "r.json").read_text())["overall"]["pass@2"] == 1.0


def test_cli_end_to_end_tiny_model_with_judge(tiny_model_dir, tmp_path, judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    data = tmp_path / "data" / "gaia" / "test.jsonl"
    data.parent.mkdir(parents=True)
    qs = [("What is the capital of France?", "Paris"), ("What is 10 + 7?", "17"),
          ("Who founded Vrorkmere?", "Raquun Bryglamouth"), ("How many legs has a spider?", "8")]
    data.write_text("".join(json.dumps({"Question": q, "Final answer": a, "Level": 1}) + "\n" for q, a in qs))
    judge_server.accept = ["seventeen"]  # the judge says yes to nothing the random model writes...
    out = tmp_path / "report.json"
    report = main_eval.main(["--model", tiny_model_dir, "--data", str(data), "--k", "2", "--max_response_length", "24",
                             "--tools", "configs/tools/python_search_local.yaml", "--seed", "3", "--out", str(out),
                             "--judge_url", f"http://127.0.0.1:{judge_server.server_port}", "--judge_model", "j",
                             "--judge_api_key_env", "JUDGE_KEY"])
    m = report["per_data_source"]["gaia"]
    assert m["n_questions"] == 4 and m["samples_per_question"] == 2
    assert 0.0 <= m["pass@1"] <= m["pass@2"] <= 1.0 and len(m["accuracy_ci95"]) == 2
    assert all(len(s["samples"]) == 2 for s in report["samples"])
    assert report["judge"]["calls"] == len(judge_server.requests) == 8 - sum(
        s["rule_correct"] for q in report["samples"] for s in q["samples"])
    text = out.read_text()
    assert KEY not in text and json.loads(text)["sampling"]["greedy"] is False
    # greedy (k = 1) is deterministic
    args = ["--model", tiny_model_dir, "--data", str(data), "--k", "1", "--max_response_length", "16", "--tools", "none"]
    a, b = main_eval.main(args), main_eval.main(args)
    assert [s["samples"][0]["text"] for s in a["samples"]] == [s["samples"][0]["text"] for s in b["samples"]]


class _HermesEngine(InferenceEngine):
    """hermes: trajectory t0 calls `python` by function calling and answers with its result; t1
    calls `python` to *print* a boxed answer, then answers 0: the tool message holds \\boxed{a*b},
    the final assistant turn does not, so t1 must score 0."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_ids = tokenizer, [tokenizer.eos_token_id]
        self.prompts: list[str] = []

    def generate(self, requests):
        outs = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids)
            self.prompts.append(text)
            a, b = map(int, text.split("What is ")[-1].split("?")[0].split(" * "))
            code = f"print({a} * {b})" if r.request_id.endswith("-t0") else f"print('\\\\boxed{{' + str({a} * {b}) + '}}')"
            if "<tool_response>" not in text:
                reply = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
            else:
                result = text.rsplit("<tool_response>\n", 1)[-1].split("\n</tool_response>")[0].strip()
                reply = f"<answer> \\boxed{{{result if r.request_id.endswith('-t0') else 0}}} </answer>"
            ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_token_ids[0]]
            outs.append(GenOutput(ids, "eos", None, [-0.1] * len(ids), [[-0.1]] * len(ids), None))
        return outs

    def update_weights(self, named_tensors):
        pass


def test_hermes_format_scores_the_final_assistant_turn(tiny_model_dir, tiny_tokenizer, tmp_path):
    data = tmp_path / "mul.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n"
                            for a, b in [(123, 45), (67, 89)]))
    args = main_eval.build_parser().parse_args([
        "--model", tiny_model_dir, "--data", str(data), "--k", "2", "--data_source", "arpo_toy_math",
        "--tools", "configs/tools/python_only.yaml", "--format", "hermes", "--max_response_length", "256"])
    engine = _HermesEngine(tiny_tokenizer)
    report = main_eval.run_eval(args, engine=engine, tokenizer=tiny_tokenizer)
    m = report["per_data_source"]["arpo_toy_math"]
    assert report["format"] == "hermes" and m["pass@1"] == 0.5 and m["pass@2"] == 1.0
    assert m["tool_calls_per_question_by_tag"] == {"python": 1.0}   # one call per sample
    t0, t1 = report["samples"][0]["samples"]
    assert t0["correct"] and t0["text"].strip() == "<answer> \\boxed{5535} </answer>"   # the final turn only
    assert not t1["correct"] and "<tool_response>" not in t1["text"]
    assert '"name": "python"' in engine.prompts[0] and "<tools>" in engine.prompts[0]   # rendered with the schemas
