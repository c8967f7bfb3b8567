"""Search cache faults: the disk fills up under it, or its file is not a database at all.

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
    # what was written before the disk filled is still served from the cache
    before = len(api.requests)
    again = executor.execute("search", "query 0")
    assert again.ok and len(api.requests) == before and tool.metrics()["cache_hits"] >= 1
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
    assert SearchCache(path).get("q").startswith("Page 1:")  # the fresh cache persisted it
