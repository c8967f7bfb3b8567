"""Search cache faults: the disk fills up under it, its file is not a database at all or breaks after
start-up, or it is shared by tools and parameters that answer differently.

Either way the search must keep answering (a cache is an optimisation): results are returned
uncached and the failure is counted and logged, never turned into an error for the model.
Extends tests/tools/test_search_cache.py (SIGKILLed writers, broken reference JSON).
"""
import logging
import os

import pytest
from rel_helpers import FakeSearchAPI

from verl_arpo.workers.rollout.tools.cache import SearchCache
from verl_arpo.workers.rollout.tools.registry import ToolExecutor, build_tools
from verl_arpo.workers.rollout.tools.search_tool import BingSearchTool


@pytest.fixture
def api():
    server = FakeSearchAPI(lambda i, h, b: (200, {"organic": [{"description": "z" * 900 + f" #{i}"}]}, {}))
    yield server
    server.close()


@pytest.mark.parametrize("async_write", [False, True])
def test_a_full_disk_never_fails_a_search(api, small_tmpfs, async_write, caplog):
    disk = small_tmpfs("disk", "256k")
    tool = BingSearchTool(api_key="k", endpoint=api.url, cache_file=str(disk / "cache.sqlite"),
                          async_cache_write=async_write, result_length=1000)
    executor = ToolExecutor({"search": tool}, max_workers=8, timeout=30, retry_count=0)
    with caplog.at_level(logging.WARNING):
        results = executor.execute_batch([("search", f"query {i}") for i in range(400)])
        tool.cache.flush()
    assert all(r.ok and r.text.startswith("Page 1: zzz") for r in results), [r.text for r in results if not r.ok][:2]
    assert os.statvfs(disk).f_bavail == 0  # the disk really filled up
    m = tool.metrics()
    assert m["cache_write_errors"] > 0 and m["cache_writes"] == 400
    warnings = [r for r in caplog.records if "could not write" in r.getMessage()]
    assert 1 <= len(warnings) <= 1 + m["cache_write_errors"] // 100  # logged, not once per search
    # what was written before the disk filled is still served from the cache, the rest is fetched
    # again (which queries were written first depends on the threads' timing, so all are asked)
    before, hits = len(api.requests), tool.metrics()["cache_hits"]
    again = executor.execute_batch([("search", f"query {i}") for i in range(400)])
    served = tool.metrics()["cache_hits"] - hits
    assert all(r.ok for r in again) and served >= 1 and len(api.requests) - before == 400 - served
    executor.close()


@pytest.mark.parametrize("content", [os.urandom(4096), b"SQLite format 3\x00" + b"\x07" * 5000, b"{}"])
def test_a_corrupt_cache_file_is_set_aside_and_search_keeps_working(api, tmp_path, content, caplog):
    path = tmp_path / "search_cache.sqlite"
    path.write_bytes(content)
    cfg = {"tools": {"tool_instances": {"search": {
        "class_path": "verl_arpo.workers.rollout.tools.search_tool.BingSearchTool",
        "params": {"api_key": "k", "endpoint": api.url, "cache_file": str(path)}}}}}
    with caplog.at_level(logging.WARNING):
        tools = build_tools(cfg)
    assert "search" in tools, caplog.text  # the tool was built, not skipped
    assert "moved it to" in caplog.text
    assert [p.name.split(".corrupt-")[0] for p in tmp_path.glob("*.corrupt-*")] == ["search_cache.sqlite"]
    assert tools["search"].execute("q").startswith("Page 1:")
    # the fresh cache persisted it, under the tool's namespace
    assert SearchCache(path, namespace=tools["search"].cache_namespace()).get("q").startswith("Page 1:")


def test_one_cache_file_never_serves_another_tools_or_parameters_answers(api, tmp_path):
    """Keyed by tool identity and result-shaping params: a local-corpus answer is not served to the
    web search, a longer result_length is not served a cut answer, a changed corpus is not served
    the old corpus's answers; the same configuration still hits."""
    from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool

    cache = str(tmp_path / "search_cache.sqlite")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"title": "Vrorkmere", "text": "Vrorkmere was founded by Ada Quill in 1832."}\n'
                      '{"title": "Olbeck", "text": "Olbeck lies on the river Tamsel."}\n')
    local = LocalSearchTool(corpus_path=str(corpus), result_length=20, cache_file=cache)
    short = local.run("Vrorkmere founded")
    assert short == "Page 1: Vrorkmere: Vrorkmere"
    local.close()
    longer = LocalSearchTool(corpus_path=str(corpus), result_length=200, cache_file=cache)
    assert longer.run("Vrorkmere founded") == "Page 1: Vrorkmere: Vrorkmere was founded by Ada Quill in 1832."
    assert longer.metrics()["cache_hits"] == 0
    longer.close()
    web = BingSearchTool(api_key="k", endpoint=api.url, cache_file=cache, result_length=20)
    assert web.run("Vrorkmere founded") == "Page 1: " + "z" * 20 and len(api.requests) == 1  # asked the API
    web.close()
    corpus.write_text('{"title": "Vrorkmere", "text": "Vrorkmere was founded by Lin Mott in 1901."}\n')
    edited = LocalSearchTool(corpus_path=str(corpus), result_length=20, cache_file=cache)
    assert edited.run("Vrorkmere founded") == "Page 1: Vrorkmere: Vrorkmere" and edited.metrics()["cache_hits"] == 0
    edited.close()
    corpus.write_text('{"title": "Vrorkmere", "text": "Vrorkmere was founded by Ada Quill in 1832."}\n'
                      '{"title": "Olbeck", "text": "Olbeck lies on the river Tamsel."}\n')
    same = LocalSearchTool(corpus_path=str(corpus), result_length=20, cache_file=cache)
    assert same.run("Vrorkmere founded") == short and same.metrics()["cache_hits"] == 1  # the original config hits
    same.close()


def test_an_empty_answer_is_not_cached(tmp_path):
    """A 200 with no results (an outage in disguise) is answered but not remembered."""
    server = FakeSearchAPI(lambda i, h, b: (200, {"organic": []} if i == 0 else
                                            {"organic": [{"description": "Olbeck lies on the Tamsel."}]}, {}))
    try:
        tool = BingSearchTool(api_key="k", endpoint=server.url, cache_file=str(tmp_path / "c.sqlite"))
        assert tool.run("Olbeck river") == "No search results found."
        assert tool.run("Olbeck river") == "Page 1: Olbeck lies on the Tamsel."
        assert tool.run("Olbeck river") == "Page 1: Olbeck lies on the Tamsel."
        assert len(server.requests) == 2 and tool.metrics()["cache_hits"] == 1
        tool.close()
    finally:
        server.close()


def test_a_cache_that_breaks_after_start_up_degrades_to_uncached(api, tmp_path, caplog):
    """The database (and its WAL and index) are overwritten with garbage after the tool started:
    the tool's next threads open a file that is not a database. Searches keep answering from the
    API, read failures are counted and logged once, never raised."""
    import threading

    path = tmp_path / "search_cache.sqlite"
    tool = BingSearchTool(api_key="k", endpoint=api.url, cache_file=str(path))
    first = ToolExecutor({"search": tool}, max_workers=2, timeout=30, retry_count=0)
    assert first.execute("search", "q0").ok
    for suffix in ("", "-wal", "-shm"):
        part = tmp_path / f"search_cache.sqlite{suffix}"
        if part.exists():
            with open(part, "r+b") as f:
                f.write(os.urandom(part.stat().st_size))
    results = []
    with caplog.at_level(logging.WARNING):
        for i in range(5):  # a fresh thread per call: each opens its own connection to the broken file
            t = threading.Thread(target=lambda i=i: results.append(tool.execute(f"q{i}")))
            t.start()
            t.join(30)
    assert len(results) == 5 and all(r.startswith("Page 1: zzz") for r in results), results
    assert tool.metrics()["cache_read_errors"] == 5
    assert len([r for r in caplog.records if "could not read" in r.getMessage()]) == 1
    first.close()
