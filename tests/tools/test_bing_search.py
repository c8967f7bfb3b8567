"""BingSearchTool against a real HTTP server on 127.0.0.1 (see conftest.FakeBrightData)."""
import json
import logging
import sqlite3
from urllib.parse import parse_qs, urlsplit

import pytest

from verl_arpo.workers.rollout.tools.registry import ToolExecutor
from verl_arpo.workers.rollout.tools.search_tool import BingSearchTool

KEY = "sk-test-5f0c9d2e-NEVER-LEAK"


def serp(*descriptions):
    return {"organic": [{"title": f"t{i}", "link": f"https://x/{i}", "description": d}
                        for i, d in enumerate(descriptions)]}


def make(brightdata, tmp_path, **kw):
    params = dict(api_key=KEY, zone="serp_zone", endpoint=brightdata.url, retry_backoff=0.01,
                  request_timeout=5, cache_file=str(tmp_path / "cache.sqlite"))
    params.update(kw)
    return BingSearchTool(**params)


def test_request_shape(brightdata, tmp_path):
    brightdata.respond((200, serp("alpha"), {}, 0))
    tool = make(brightdata, tmp_path, location="cn")
    assert tool.execute("capital  of\nFrance ") == "Page 1: alpha"
    (req,) = brightdata.requests
    assert req["path"] == "/request"
    assert req["headers"]["Authorization"] == f"Bearer {KEY}"
    assert req["headers"]["Content-Type"] == "application/json"
    body = json.loads(req["body"])
    assert set(body) == {"zone", "url", "format"}
    assert body["zone"] == "serp_zone" and body["format"] == "raw"
    url = urlsplit(body["url"])
    assert (url.scheme, url.netloc, url.path) == ("https", "www.bing.com", "/search")
    q = parse_qs(url.query)
    assert q == {"q": ["capital of France"], "mkt": ["zh-CN"], "setLang": ["zh-hans"], "cc": ["cn"],
                 "brd_json": ["1"]}
    tool.close()


def test_parse_dedupe_max_results_and_length(brightdata, tmp_path):
    descriptions = ["first result", "", "first result", "  second\n result ", "third", "fourth"]
    brightdata.respond((200, serp(*descriptions), {}, 0))
    tool = make(brightdata, tmp_path, max_results=3, result_length=9)
    out = tool.execute("q")
    # empty dropped, duplicate dropped, whitespace collapsed, 3 kept, each cut to 9 characters
    assert out == "Page 1: first res\nPage 2: second re\nPage 3: third"
    tool.close()


def test_no_results_are_not_cached_and_results_are(brightdata, tmp_path):
    """An empty 200 answer may be an outage in disguise: asked again next time; a real result is
    served from the cache."""
    brightdata.respond((200, {"organic": []}, {}, 0), (200, {"organic": []}, {}, 0), (200, serp("found"), {}, 0))
    tool = make(brightdata, tmp_path)
    assert tool.execute("nothing here") == "No search results found."
    assert tool.execute("nothing here") == "No search results found."
    assert len(brightdata.requests) == 2  # asked twice: nothing was cached
    assert tool.execute("nothing here") == "Page 1: found"
    assert tool.execute("nothing here") == "Page 1: found"
    assert len(brightdata.requests) == 3  # the last answer came from the cache
    m = tool.metrics()
    assert (m["cache_hits"], m["cache_misses"]) == (1, 3)
    tool.close()


def test_429_then_success_is_retried(brightdata, tmp_path):
    brightdata.respond((429, {"error": "slow down"}, {}, 0), (503, "busy", {}, 0), (200, serp("ok"), {}, 0))
    tool = make(brightdata, tmp_path, http_retries=2)
    assert tool.execute("q") == "Page 1: ok"
    assert len(brightdata.requests) == 3
    tool.close()


def test_persistent_5xx_is_error_text_and_not_cached(brightdata, tmp_path):
    brightdata.respond(*[(500, "oops", {}, 0)] * 3)
    tool = make(brightdata, tmp_path, http_retries=2)
    out = tool.execute("q")
    assert out.startswith("Error:") and "HTTP 500" in out and "3 attempts" in out
    assert len(brightdata.requests) == 3  # bounded: 1 + http_retries
    brightdata.respond((200, serp("fresh"), {}, 0))
    assert tool.execute("q") == "Page 1: fresh"  # the failure was not cached
    tool.close()


def test_malformed_json_not_cached(brightdata, tmp_path):
    brightdata.respond((200, "<html>not json", {}, 0), (200, serp("good"), {}, 0))
    tool = make(brightdata, tmp_path)
    assert "malformed JSON" in tool.execute("q")
    assert tool.execute("q") == "Page 1: good"
    assert len(brightdata.requests) == 2
    tool.close()


def test_timeout_is_error_text_and_not_cached(brightdata, tmp_path):
    brightdata.respond((200, serp("late"), {}, 1.0))
    tool = make(brightdata, tmp_path, request_timeout=0.2, http_retries=0)
    out = tool.execute("q")
    assert out.startswith("Error:") and "timed out" in out
    tool.cache.flush()
    assert "q" not in tool.cache
    tool.close()


def test_executor_does_not_multiply_http_retries(brightdata, tmp_path):
    brightdata.respond(*[(502, "bad gateway", {}, 0)] * 10)
    tool = make(brightdata, tmp_path, http_retries=1)
    ex = ToolExecutor({"search": tool}, retry_count=3, retry_backoff=0.01, timeout=10)
    res = ex.execute("search", "q")
    assert not res.ok and "HTTP 502" in res.text and res.attempts == 1
    assert len(brightdata.requests) == 2
    assert ex.metrics()["tools/search/failures"] == 1
    ex.close()


def test_key_never_leaks(brightdata, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # includes urllib3's connection logs
    echo_auth = lambda headers: {"error": "bad auth", "got": headers.get("Authorization")}  # noqa: E731
    brightdata.respond((401, echo_auth, {}, 0), (500, echo_auth, {}, 0), (500, echo_auth, {}, 0),
                       (200, serp("result text"), {}, 0))
    tool = make(brightdata, tmp_path, http_retries=1)
    outputs = [tool.execute("q1"), tool.execute("q2"), tool.execute("q3")]
    assert outputs[0].startswith("Error: search failed: HTTP 401") and "***" in outputs[0]
    assert outputs[2] == "Page 1: result text"
    ex = ToolExecutor({"search": tool}, timeout=10)
    texts = outputs + [repr(tool), str(vars(tool).get("zone")), json.dumps(ex.metrics())]
    tool.close()  # flushes the async writer / closes the DB
    for t in texts:
        assert KEY not in t
    assert KEY not in caplog.text
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert KEY.encode() not in blob
    rows = sqlite3.connect(tmp_path / "cache.sqlite").execute("SELECT query, result FROM cache").fetchall()
    assert rows == [(tool.cache_namespace() + "\x1fq3", "Page 1: result text")]  # keyed by configuration + query
    assert KEY not in tool.cache_namespace()


def test_key_from_env_when_placeholder(brightdata, tmp_path, monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "env-key-123")
    brightdata.respond((200, serp("x"), {}, 0))
    tool = make(brightdata, tmp_path, api_key="YOUR_BRIGHTDATA_API_KEY")
    assert tool.execute("q") == "Page 1: x"
    assert brightdata.requests[0]["headers"]["Authorization"] == "Bearer env-key-123"
    tool.close()


def test_no_key_is_error_without_request(brightdata, tmp_path, monkeypatch):
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    tool = make(brightdata, tmp_path, api_key="")
    assert tool.execute("q") == "Error: search failed: no Bright Data API key configured"
    assert brightdata.requests == []
    tool.close()


@pytest.mark.parametrize("async_write", [False, True])
def test_reference_json_cache_is_used(brightdata, tmp_path, async_write):
    (tmp_path / "search_cache.json").write_text(json.dumps({"cached q": "Page 1: from json"}))
    tool = make(brightdata, tmp_path, cache_file=str(tmp_path / "search_cache.json"),
                async_cache_write=async_write)
    assert tool.execute("cached q") == "Page 1: from json"
    brightdata.respond((200, serp("new"), {}, 0))
    assert tool.execute("new q") == "Page 1: new"
    tool.close()
    assert brightdata.requests and len(brightdata.requests) == 1
    rows = dict(sqlite3.connect(tmp_path / "search_cache.sqlite").execute("SELECT * FROM cache"))
    ns = tool.cache_namespace() + "\x1f"  # the reference's entries belong to the tool that imports them
    assert rows == {ns + "cached q": "Page 1: from json", ns + "new q": "Page 1: new"}


def test_a_reply_that_echoes_the_key_reaches_neither_the_model_nor_the_cache(brightdata, tmp_path):
    """[issue 34, item 6] A 200 reply whose snippet echoes the API key (a debug field, an error page
    in disguise) was returned and cached in clear."""
    tool = make(brightdata, tmp_path, api_key="sk-echoed-9911", cache_file=str(tmp_path / "c.sqlite"))
    brightdata.respond((200, serp("your key sk-echoed-9911 is active; Authorization: Bearer tok-5150"), {}, 0))
    answer = tool.execute("status")
    tool.close()
    assert "sk-echoed-9911" not in answer and "tok-5150" not in answer and answer.startswith("Page 1: your key ***")
    stored = sqlite3.connect(tmp_path / "c.sqlite").execute("SELECT result FROM cache").fetchall()
    assert stored and all("sk-echoed-9911" not in r and "tok-5150" not in r for (r,) in stored)
