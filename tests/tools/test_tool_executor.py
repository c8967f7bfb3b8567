"""ToolExecutor and the YAML registry: concurrency, real timeouts, retries, metrics, seed configs."""
import logging
import threading
import time
from pathlib import Path

import pytest

from verl_arpo.workers.rollout.tools import (BaseTool, BingSearchTool, LocalSearchTool, PythonTool,
                                             ToolError, ToolExecutor, build_tools, load_tools_config,
                                             resolve_class)

ROOT = Path(__file__).resolve().parents[2]


class SleepTool(BaseTool):
    name = trigger_tag = "sleep"

    def __init__(self, seconds=0.3):
        self.seconds, self.active, self.peak = seconds, 0, 0
        self._lock = threading.Lock()

    def run(self, content):
        with self._lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(self.seconds)
        with self._lock:
            self.active -= 1
        return f"slept {content}"


class HangTool(BaseTool):
    """Blocks until released: a tool that never returns on its own."""
    name = trigger_tag = "hang"

    def __init__(self):
        self.release = threading.Event()

    def run(self, content):
        self.release.wait()
        return "finally"


class FlakyTool(BaseTool):
    """Fails (raise or empty output) ``failures`` times, then answers."""
    name = trigger_tag = "flaky"

    def __init__(self, failures, mode="raise"):
        self.failures, self.mode, self.calls = failures, mode, 0

    def run(self, content):
        self.calls += 1
        if self.calls <= self.failures:
            if self.mode == "raise":
                raise ConnectionError(f"boom {self.calls}")
            return "   "
        return f"ok after {self.calls}"


class LegacyTool:
    """The reference's duck-typed API: only name, trigger_tag and execute."""
    name, trigger_tag = "Legacy", "legacy"

    def execute(self, content):
        return content.upper()


def test_runs_concurrently_up_to_max_workers():
    tool = SleepTool(0.3)
    ex = ToolExecutor({"sleep": tool}, max_workers=8, timeout=5)
    t0 = time.monotonic()
    results = ex.execute_batch([("sleep", str(i)) for i in range(8)])
    assert time.monotonic() - t0 < 1.2  # 8 x 0.3 s in parallel, not 2.4 s in series
    assert [r.text for r in results] == [f"slept {i}" for i in range(8)]  # order kept
    assert tool.peak == 8

    tool2 = SleepTool(0.2)
    ex2 = ToolExecutor({"sleep": tool2}, max_workers=2, timeout=5)
    t0 = time.monotonic()
    ex2.execute_batch([("sleep", str(i)) for i in range(6)])
    assert time.monotonic() - t0 >= 0.6 and tool2.peak == 2


def test_hung_tool_times_out_for_real():
    hang, fast = HangTool(), SleepTool(0.05)
    ex = ToolExecutor({"hang": hang, "sleep": fast}, max_workers=4, timeout=0.5, retry_backoff=0.01)
    try:
        t0 = time.monotonic()
        res = ex.execute_batch([("hang", "x"), ("sleep", "y")])
        took = time.monotonic() - t0
        assert took < 1.5
        assert (res[0].ok, res[0].timed_out) == (False, True)
        assert res[0].text == "Error: hang tool timed out after 0.5 seconds."
        assert res[1].ok and res[1].text == "slept y"
        text, ok, seconds = res[0]  # results unpack as (text, ok, seconds)
        assert not ok and 0.45 <= seconds < 1.5
        m = ex.metrics()
        assert m["tools/hang/timeouts"] == 1 and m["tools/abandoned_threads"] == 1
    finally:
        hang.release.set()


def test_hung_calls_do_not_exhaust_workers():
    # with a plain thread pool of 1, the first hang would block every later call forever
    hang, fast = HangTool(), SleepTool(0.01)
    ex = ToolExecutor({"hang": hang, "sleep": fast}, max_workers=1, timeout=0.3)
    try:
        first = ex.execute_batch([("hang", "1"), ("hang", "2")])
        assert all(r.timed_out for r in first)
        t0 = time.monotonic()
        assert ex.execute("sleep", "z").text == "slept z"
        assert time.monotonic() - t0 < 0.3
    finally:
        hang.release.set()


@pytest.mark.parametrize("mode", ["raise", "empty"])
def test_retries_then_success(mode):
    tool = FlakyTool(2, mode)
    ex = ToolExecutor({"flaky": tool}, retry_count=3, retry_backoff=0.01, timeout=5)
    r = ex.execute("flaky", "q")
    assert (r.text, r.ok, r.attempts) == ("ok after 3", True, 3)
    m = ex.metrics()
    assert (m["tools/flaky/retries"], m["tools/flaky/successes"], m["tools/flaky/failures"]) == (2, 1, 0)


def test_failure_after_retries_is_text():
    ex = ToolExecutor({"flaky": FlakyTool(99)}, retry_count=2, retry_backoff=0.01, timeout=5)
    r = ex.execute("flaky", "q")
    assert not r.ok and r.attempts == 3
    assert r.text == "Error: flaky tool failed: ConnectionError: boom 3 (after 3 attempts)"
    empty = ToolExecutor({"flaky": FlakyTool(99, "empty")}, retry_count=1, retry_backoff=0.01)
    assert empty.execute("flaky", "q").text == "Error: flaky tool returned no output. (after 2 attempts)"


def test_retries_stop_at_the_deadline():
    tool = FlakyTool(99)
    ex = ToolExecutor({"flaky": tool}, retry_count=10, retry_backoff=0.2, timeout=0.5)
    t0 = time.monotonic()
    r = ex.execute("flaky", "q")
    assert not r.ok and time.monotonic() - t0 < 0.6
    assert tool.calls == 2  # 0 s, +0.2 s; the next backoff (+0.4 s) would pass the deadline


def test_non_retryable_tool_error_is_not_retried():
    class Refuse(BaseTool):
        name = trigger_tag = "refuse"
        calls = 0

        def run(self, content):
            self.calls += 1
            raise ToolError("input rejected", retryable=False)

    tool = Refuse()
    r = ToolExecutor({"refuse": tool}, retry_count=3).execute("refuse", "x")
    assert (r.text, r.attempts, tool.calls) == ("Error: input rejected", 1, 1)


def test_unknown_tag_and_empty_content():
    ex = ToolExecutor({"sleep": SleepTool(0), "legacy": LegacyTool()})
    r = ex.execute("browser", "x")
    assert not r.ok and r.text == "Error: unknown tool 'browser'. Available tools: sleep, legacy."
    r = ex.execute("sleep", "  \n ")
    assert not r.ok and r.text == "Error: empty <sleep> call: put the input between <sleep> and </sleep>."
    assert ex.execute("legacy", "abc").text == "ABC"  # execute-only tools still work
    m = ex.metrics()
    assert m["tools/unknown/failures"] == 1 and "tools/browser/calls" not in m


def test_metrics_counts_and_reset():
    ex = ToolExecutor({"sleep": SleepTool(0.05), "flaky": FlakyTool(1)}, retry_backoff=0.01)
    ex.execute_batch([("sleep", "a"), ("sleep", "b"), ("flaky", "c"), ("nope", "d")])
    m = ex.metrics(reset=True)
    assert (m["tools/sleep/calls"], m["tools/sleep/successes"], m["tools/sleep/failures"]) == (2, 2, 0)
    assert (m["tools/flaky/calls"], m["tools/flaky/retries"]) == (1, 1)
    assert (m["tools/calls"], m["tools/successes"], m["tools/failures"], m["tools/retries"]) == (4, 3, 1, 1)
    assert 0.05 <= m["tools/sleep/time_avg"] <= m["tools/sleep/time_max"] < 1
    assert m["tools/time_max"] == max(m["tools/sleep/time_max"], m["tools/flaky/time_max"])
    assert ex.metrics()["tools/calls"] == 0  # new window after reset


def test_stop_strings_and_call_limit():
    ex = ToolExecutor({"python": SleepTool(0), "search": SleepTool(0)}, call_limit=5)
    assert ex.stop_strings == ["</python>", "</search>"] and ex.trigger_tags == ["python", "search"]
    assert ex.call_limit == 5


def test_class_path_aliases():
    assert resolve_class("verl.workers.rollout.tools.python_tool.PythonTool") is PythonTool
    assert resolve_class("verl.workers.agent.tools.search_tool.BingSearchTool") is BingSearchTool
    assert resolve_class("verl_arpo.workers.rollout.tools.local_search_tool.LocalSearchTool") is LocalSearchTool


def test_seeds_yaml_loads_unchanged(seeds_yaml, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # the seeds' relative cache_file must not land in the repo
    monkeypatch.delenv("BRIGHTDATA_API_KEY", raising=False)
    caplog.set_level(logging.WARNING)
    cfg = load_tools_config(seeds_yaml)
    assert (cfg.call_limit, cfg.max_workers, cfg.timeout, cfg.retry_count) == (3, 64, 120, 3)
    assert cfg.verbose_logging is True and cfg.fail_on_error is False
    ex = ToolExecutor.from_config(seeds_yaml)
    try:
        assert isinstance(ex.tools["python"], PythonTool) and isinstance(ex.tools["search"], BingSearchTool)
        assert ex.tools["python"].python_path == "/usr/bin/python3"  # /path/to/conda does not exist
        assert ex.tools["python"].timeout == 60
        s = ex.tools["search"]
        assert (s.zone, s.max_results, s.result_length, s.location) == ("YOUR_BRIGHTDATA_ZONE", 10, 1000, "us")
        assert s.cache.path == tmp_path / "search_cache" / "search_cache.sqlite" and s.cache.async_write
        assert ex.stop_strings == ["</python>", "</search>"]
        assert ex.execute("python", "6 * 7").text == "42\n"
        assert ex.execute("search", "q").text == "Error: search failed: no Bright Data API key configured"
    finally:
        ex.close()
    assert "YOUR_BRIGHTDATA_API_KEY" not in caplog.text


def test_config_from_omegaconf_and_dict(seeds_yaml, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    node = OmegaConf.load(seeds_yaml)
    assert load_tools_config(node).max_workers == 64
    assert load_tools_config(node.tools).tool_instances["python"]["params"]["conda_env"] == "arpo"
    plain = {"timeout": 5, "tool_instances": {"s": {"class_path": f"{__name__}.SleepTool",
                                                     "params": {"seconds": 0}}}}
    ex = ToolExecutor.from_config(plain)
    assert ex.timeout == 5 and ex.execute("sleep", "1").text == "slept 1"


def test_a_tool_that_cannot_be_built_fails_the_run_unless_opted_out(caplog):
    """The default: the run stops, naming the tool, its class and the opt-out; fail_on_error=false
    is the explicit choice to train without it (warned)."""
    from verl_arpo.workers.rollout.tools.registry import ToolBuildError

    cfg = {"tool_instances": {
        "python": {"class_path": "verl.workers.rollout.tools.python_tool.PythonTool", "params": {"sandbox": "docker"}},
        "ghost": {"class_path": "verl.workers.rollout.tools.nowhere.Ghost"},
        "sleep": {"class_path": f"{__name__}.SleepTool", "params": None}}}
    with pytest.raises(ToolBuildError, match=r"tool 'python' \(verl.workers.rollout.tools.python_tool.PythonTool\) "
                                             r"could not be built: ValueError: sandbox must be .*fail_on_error=false"):
        build_tools(cfg)
    caplog.set_level(logging.WARNING)
    tools = build_tools(dict(cfg, fail_on_error=False))
    assert list(tools) == ["sleep"]
    assert "'python' not loaded" in caplog.text and "'ghost' not loaded" in caplog.text


def test_duplicate_tag_rejected(caplog):
    from verl_arpo.workers.rollout.tools.registry import ToolBuildError

    cfg = {"tool_instances": {"a": {"class_path": f"{__name__}.SleepTool"},
                              "b": {"class_path": f"{__name__}.SleepTool"}}}
    with pytest.raises(ToolBuildError, match="already used"):
        build_tools(cfg)
    assert list(build_tools(dict(cfg, fail_on_error=False))) == ["sleep"] and "already used" in caplog.text


@pytest.mark.parametrize("name, tags", [("python_search_local", ["python", "search"]),
                                        ("python_bing", ["python", "search"]),
                                        ("python_only", ["python"])])
def test_shipped_configs_load(name, tags, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ex = ToolExecutor.from_config(ROOT / "configs" / "tools" / f"{name}.yaml")
    try:
        assert ex.trigger_tags == tags
        assert ex.execute("python", "print('hi')").text == "hi\n"
    finally:
        ex.close()


def test_submit_runs_in_the_background_with_limits_timeouts_and_error_text():
    """The asynchronous rollout's entry point: `submit` returns at once; results come back through
    the callback, at most max_workers at a time, a hung call as timeout text, a raising one as
    error text; the calls are counted like execute_batch's."""
    import queue

    sleep, hang, flaky = SleepTool(0.3), HangTool(), FlakyTool(99)
    ex = ToolExecutor({"sleep": sleep, "hang": hang, "flaky": flaky}, max_workers=2, timeout=1.0, retry_count=0)
    got: queue.SimpleQueue = queue.SimpleQueue()
    t0 = time.monotonic()
    for i in range(4):
        ex.submit("sleep", str(i), lambda r, i=i: got.put((f"sleep{i}", r)))
    assert time.monotonic() - t0 < 0.1   # nothing waited for the tools
    results = dict(got.get(timeout=5) for _ in range(4))
    assert 0.55 < time.monotonic() - t0 < 1.5   # 4 calls of 0.3 s, 2 at a time
    assert sleep.peak == 2
    assert {k: r.text for k, r in results.items()} == {f"sleep{i}": f"slept {i}" for i in range(4)}
    ex.submit("hang", "x", lambda r: got.put(("hang", r)))
    ex.submit("flaky", "x", lambda r: got.put(("flaky", r)))
    late = dict(got.get(timeout=5) for _ in range(2))
    assert late["hang"].timed_out and "timed out" in late["hang"].text and not late["hang"].ok
    assert not late["flaky"].ok and late["flaky"].text.startswith("Error")
    m = ex.metrics()
    assert m["tools/sleep/calls"] == 4 and m["tools/hang/timeouts"] == 1 and m["tools/flaky/failures"] == 1
    hang.release.set()
    ex.close()


def test_per_tool_concurrency_and_timeout_from_the_yaml(tmp_path):
    """`tool_instances.<name>.max_concurrency` caps that tool's simultaneous calls (a search API's
    rate limit) while other tools keep the executor's max_workers; `.timeout` is its own deadline."""
    yaml = tmp_path / "tools.yaml"
    yaml.write_text(
        "tools:\n  max_workers: 16\n  timeout: 5\n  retry_count: 0\n  tool_instances:\n"
        "    sleep:\n      class_path: test_tool_executor.SleepTool\n"
        "      max_concurrency: 2\n      timeout: 0.75\n      params: {seconds: 0.3}\n"
        "    other:\n      class_path: test_tool_executor.OtherSleepTool\n"
        "      params: {seconds: 0.3}\n")
    ex = ToolExecutor.from_config(yaml)
    sleep, other = ex.tools["sleep"], ex.tools["other"]
    t0 = time.monotonic()
    results = ex.execute_batch([("sleep", str(i)) for i in range(6)] + [("other", str(i)) for i in range(6)])
    wall = time.monotonic() - t0
    assert sleep.peak == 2 and other.peak == 6
    # 2 at a time, 0.3 s each, 0.75 s deadline: the first two pairs finish, the third pair times out
    assert [r.ok for r in results[:6]].count(True) == 4 and [r.timed_out for r in results[:6]].count(True) == 2
    assert all("timed out after 0.75 seconds" in r.text for r in results[:6] if r.timed_out)
    assert all(r.ok for r in results[6:])
    assert wall < 2.0
    ex.close()


class OtherSleepTool(SleepTool):
    name = trigger_tag = "other"
