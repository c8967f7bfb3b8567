"""Tool faults through the real AgentLoop + ToolExecutor: a tool that hangs forever, one that
raises, one that returns 10 MB, and a search API in a 429/500 storm (BingSearchTool against a real
HTTP server on 127.0.0.1). Each rollout must finish within a bound that holds on a loaded 2-core
machine, with readable error text inside <result>, and the trajectories must go on afterwards.

Extends tests/tools/test_tool_executor.py (executor alone) and tests/tools/test_bing_search.py (one
call at a time) to whole rollouts, concurrency and storms.
"""
import json
import threading
import time

import pytest
from rel_helpers import FakeSearchAPI, FuzzEngine, check_rollout, prompts

from verl_arpo.workers.rollout.agent_loop import AgentLoop
from worker_configs import rollout
from verl_arpo.workers.rollout.tools.base_tool import BaseTool
from verl_arpo.workers.rollout.tools.registry import ToolExecutor
from verl_arpo.workers.rollout.tools.search_tool import BingSearchTool

ANSWER = "<think>ok</think><answer>\\boxed{1}</answer>"
TEN_MB = 10 * 1024 * 1024
KEY = "sk-test-SECRET-123"


class FaultyTool(BaseTool):
    """`<python>hang</python>` never returns, `raise` raises, `big` returns 10 MB, else echoes."""

    name = trigger_tag = "python"

    def __init__(self):
        self.release = threading.Event()  # set at teardown so the abandoned threads can end
        self.calls = []

    def run(self, content):
        self.calls.append(content)
        if content == "hang":
            self.release.wait()
            return "too late"
        if content == "raise":
            raise ConnectionError("backend unreachable")
        if content == "big":
            return "y" * TEN_MB
        return f"ran:{content}"


@pytest.fixture
def faulty():
    tool = FaultyTool()
    yield tool
    tool.release.set()


def _loop(tok, executor, turns_by_prompt, n=2, response_length=256, call_limit=3):
    def script(req, k):
        turns = turns_by_prompt[int(req.request_id.split("-")[0][1:])]
        return turns[k] if k < len(turns) else ANSWER

    cfg, kw = rollout(n=n, response_length=response_length, call_limit=call_limit, entropy_mode="full")
    return AgentLoop(FuzzEngine(tok, script), tok, executor, cfg, **kw)


def test_hang_raise_and_ten_megabytes_in_one_rollout(rel_tok, faulty):
    executor = ToolExecutor({"python": faulty}, max_workers=4, timeout=1.5, retry_count=2, retry_backoff=0.05)
    turns = [["<python>hang</python>"], ["<python>raise</python>"], ["<python>big</python>"],
             ["<python>fine</python>"]]
    loop = _loop(rel_tok, executor, turns, n=2, response_length=256)
    start = time.monotonic()
    out = loop.generate_sequences(prompts(rel_tok, ["a", "b", "c", "d"]))
    elapsed = time.monotonic() - start
    # one timeout window (1.5 s) for all the concurrent calls, plus generous slack for a loaded machine
    assert elapsed < 1.5 + 15, elapsed
    check_rollout(out, rel_tok, 2, 4, 256, 3)
    nt = out.non_tensor_batch
    results = [calls[0]["result"] for calls in nt["tool_calls"]]
    assert all("timed out after 1.5 seconds" in r for r in results[0:2])
    assert all("ConnectionError: backend unreachable" in r and "after 3 attempts" in r for r in results[2:4])
    assert all(r.startswith("y" * 1000) and len(r) < 100_000 for r in results[4:6])  # cut to the budget
    assert results[6:8] == ["ran:fine", "ran:fine"]
    # after an error the model goes on: it answers (EOS); the 10 MB result filled the budget instead
    assert list(nt["finish_reason"]) == ["eos"] * 4 + ["length"] * 2 + ["eos"] * 2
    m = out.meta_info["metrics"]
    assert m["tools/python/timeouts"] == 2 and m["tools/python/failures"] == 4 and m["tools/abandoned_threads"] >= 2


def test_every_call_hangs_and_the_rollout_still_ends_on_time(rel_tok, faulty):
    # 8 trajectories × 3 rounds of calls to a tool that never returns, only 2 workers: abandoned
    # threads must not hold the worker slots, or the later rounds would queue forever
    executor = ToolExecutor({"python": faulty}, max_workers=2, timeout=0.2, retry_count=0)
    loop = _loop(rel_tok, executor, [["<python>hang</python>"] * 4] * 2, n=4, response_length=512)
    start = time.monotonic()
    out = loop.generate_sequences(prompts(rel_tok, ["a", "b"]))
    assert time.monotonic() - start < 3 * 4 * 0.2 + 15  # 3 rounds × 4 waves (8 calls, 2 slots) of 0.2 s, + slack
    check_rollout(out, rel_tok, 4, 2, 512, 3)
    assert set(out.non_tensor_batch["finish_reason"]) == {"call_limit"}
    assert all(len(c) == 3 and all("timed out" in x["result"] for x in c) for c in out.non_tensor_batch["tool_calls"])


class OddTool(BaseTool):
    """Returns values a tool should not: None, bytes, a dict, an int; and its metrics() raises."""

    name = trigger_tag = "python"
    replies = {"none": None, "bytes": b"\xff raw", "dict": {"a": 1}, "int": 7, "empty": "", "surrogate": "x\udcffy"}

    def run(self, content):
        return self.replies[content]

    def metrics(self):
        raise RuntimeError("metrics broke")


def test_odd_return_values_and_broken_metrics(rel_tok):
    executor = ToolExecutor({"python": OddTool()}, max_workers=4, timeout=5, retry_count=1, retry_backoff=0.0)
    names = sorted(OddTool.replies)
    loop = _loop(rel_tok, executor, [[f"<python>{k}</python>"] for k in names], n=1)
    out = loop.generate_sequences(prompts(rel_tok, names))
    check_rollout(out, rel_tok, 1, len(names), 256, 3)
    got = dict(zip(names, (c[0]["result"] for c in out.non_tensor_batch["tool_calls"])))
    assert got["none"].startswith("Error: python tool returned no output") and got["empty"] == got["none"]
    assert got["int"] == "7" and got["dict"] == "{'a': 1}" and got["surrogate"] == "x\ufffdy"
    json.dumps(got, ensure_ascii=False).encode("utf-8")  # what the rollout dump writes: must encode


# ------------------------------------------------------------------------------------------ search storms
def _storm(until: float, statuses=(429, 500, 502, 503), retry_after: str | None = "0"):
    """A responder failing with `statuses` in turn until time `until`, then answering normally."""

    def respond(i, headers, body):
        if time.monotonic() < until:
            return statuses[i % len(statuses)], {"error": "busy"}, ({"Retry-After": retry_after} if retry_after else {})
        query = json.loads(body)["url"]
        return 200, {"organic": [{"description": f"result for {query[-12:]}"}]}, {}

    return respond


def _search_tool(api, tmp_path, **kw):
    kw.setdefault("http_retries", 2)
    kw.setdefault("retry_backoff", 0.1)
    return BingSearchTool(api_key=KEY, zone="z", endpoint=api.url, cache_file=str(tmp_path / "cache.sqlite"),
                          request_timeout=5, **kw)


def test_storm_backs_off_bounds_retries_and_recovers(rel_tok, tmp_path):
    api = FakeSearchAPI(_storm(until=time.monotonic() + 3600))
    try:
        tool = _search_tool(api, tmp_path)
        # the executor's own retries must not multiply the tool's bounded HTTP retries
        executor = ToolExecutor({"search": tool}, max_workers=16, timeout=20, retry_count=3, retry_backoff=0.05)
        calls = [("search", f"query {i}") for i in range(16)]
        start = time.monotonic()
        results = executor.execute_batch(calls)
        elapsed = time.monotonic() - start
        assert all(not r.ok and "search failed after 3 attempts: HTTP" in r.text for r in results)
        assert len(api.requests) == 16 * 3  # exactly http_retries + 1 attempts per call, no more
        assert elapsed >= 0.1 + 0.2  # backoff 0.1 s then 0.2 s happened
        assert elapsed < 20
        by_query = {}
        for req in api.requests:
            by_query.setdefault(json.loads(req["body"])["url"], []).append(req["t"])
        for times in by_query.values():  # per call: gaps of at least the exponential backoff
            assert len(times) == 3 and times[1] - times[0] >= 0.09 and times[2] - times[1] >= 0.19
        assert len(tool.cache) == 0  # errors are never cached
        assert all(KEY not in r.text for r in results)
        # the storm ends: the same calls now succeed and are cached
        api.responder = _storm(until=0)
        again = executor.execute_batch(calls)
        assert all(r.ok and r.text.startswith("Page 1: result for") for r in again)
        assert len(tool.cache) == 16
        executor.close()
    finally:
        api.close()


def test_storm_during_a_rollout_gives_error_text_and_the_run_continues(rel_tok, tmp_path):
    api = FakeSearchAPI(_storm(until=time.monotonic() + 3600, statuses=(429, 500)))
    try:
        executor = ToolExecutor({"search": _search_tool(api, tmp_path, retry_backoff=0.02)}, max_workers=8,
                                timeout=20, retry_count=3)
        turns = [[f"<search>topic {i}</search>", f"<search>topic {i} again</search>"] for i in range(4)]
        loop = _loop(rel_tok, executor, turns, n=2, response_length=400)
        start = time.monotonic()
        out = loop.generate_sequences(prompts(rel_tok, ["a", "b", "c", "d"]))
        assert time.monotonic() - start < 20
        check_rollout(out, rel_tok, 2, 4, 400, 3)
        calls = out.non_tensor_batch["tool_calls"]
        assert all(len(c) == 2 and all("HTTP" in x["result"] and not x["ok"] for x in c) for c in calls)
        assert set(out.non_tensor_batch["finish_reason"]) == {"eos"}  # answered after the errors
        assert len(api.requests) == 8 * 2 * 3
        # next step, storm over: same rollout now gets results
        api.responder = _storm(until=0)
        out = loop.generate_sequences(prompts(rel_tok, ["a", "b", "c", "d"], step=1))
        assert all(x["ok"] and x["result"].startswith("Page 1:") for c in out.non_tensor_batch["tool_calls"] for x in c)
        executor.close()
    finally:
        api.close()


def test_retry_after_of_an_hour_is_cut_by_the_executor_timeout(rel_tok, tmp_path):
    api = FakeSearchAPI(_storm(until=time.monotonic() + 3600, statuses=(429,), retry_after="3600"))
    try:
        executor = ToolExecutor({"search": _search_tool(api, tmp_path)}, max_workers=4, timeout=1.0, retry_count=0)
        start = time.monotonic()
        results = executor.execute_batch([("search", f"q{i}") for i in range(4)])
        assert time.monotonic() - start < 1.0 + 5
        assert all(r.timed_out and "timed out after 1 seconds" in r.text for r in results)
    finally:
        api.close()


def test_silent_server_and_dropped_connections(rel_tok, tmp_path):
    import socket

    # a server that accepts and never answers: the request timeout, then the bounded retries
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    dropper = FakeSearchAPI()
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/request"
        tool = BingSearchTool(api_key=KEY, endpoint=url, request_timeout=0.3, http_retries=1, retry_backoff=0.05)
        start = time.monotonic()
        text = ToolExecutor({"search": tool}, timeout=10, retry_count=2).execute("search", "q").text
        assert "search failed after 2 attempts: request timed out after 0.3 s" in text
        assert time.monotonic() - start < 0.3 * 2 + 0.05 + 5

        def drop(i, headers, body):  # the handler dies mid-request: the client sees a closed connection
            raise ConnectionResetError("gone")

        dropper.responder = drop
        tool = BingSearchTool(api_key=KEY, endpoint=dropper.url, request_timeout=2, http_retries=2, retry_backoff=0.01)
        text = ToolExecutor({"search": tool}, timeout=10, retry_count=0).execute("search", "q").text
        assert "search failed after 3 attempts: connection error" in text and KEY not in text
    finally:
        silent.close()
        dropper.close()
