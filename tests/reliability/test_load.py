"""Load: the tool executor under 1,000 concurrent calls of a slow tool (every call answered, in
order, memory bounded), and the search cache with 8 processes writing and reading at once.

Extends tests/tools/test_tool_executor.py (a handful of calls) and tests/tools/test_search_cache.py
(threads of one process; 4 writer processes, one killed).
"""
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rel_helpers import rss_bytes

from verl_arpo.workers.rollout.tools.base_tool import BaseTool
from verl_arpo.workers.rollout.tools.cache import SearchCache
from verl_arpo.workers.rollout.tools.registry import ToolExecutor

ROOT = Path(__file__).resolve().parents[2]
MB = 1 << 20


class SlowTool(BaseTool):
    name = trigger_tag = "search"

    def __init__(self, seconds):
        self.seconds = seconds

    def run(self, content):
        time.sleep(self.seconds)
        return f"Page 1: {content} " + "x" * 1000  # ~1 KB per answer


class PeakRSS:
    """Samples this process's RSS every 20 ms while in the `with` block."""

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end = rss_bytes()
        self.peak = max(self.peak, self.end)


@pytest.mark.parametrize("max_workers,seconds", [(1000, 0.2), (64, 0.05)])
def test_thousand_concurrent_slow_calls_all_answered_with_bounded_memory(max_workers, seconds):
    executor = ToolExecutor({"search": SlowTool(seconds)}, max_workers=max_workers, timeout=30, retry_count=0)
    calls = [("search", f"q{i}") for i in range(1000)]
    executor.execute_batch(calls[:50])  # warm-up: thread machinery, allocator pools
    rounds = []
    for _ in range(3):
        with PeakRSS() as mem:
            start = time.monotonic()
            results = executor.execute_batch(calls)
            elapsed = time.monotonic() - start
        rounds.append(mem)
        assert [r.text.split()[2] for r in results] == [f"q{i}" for i in range(1000)]  # each its own, in order
        assert all(r.ok for r in results)
        waves = -(-1000 // max_workers)
        assert elapsed < waves * seconds + 20, elapsed  # the waves, plus slack for a loaded machine
        del results
    # 1,000 threads and 1 MB of answers at a time (~15 MB measured): under 100 MB above the start of a round,
    # and no growth from round to round (nothing retained between batches)
    print("RSS growth per round (MB):", [round((m.peak - m.start) / MB, 1) for m in rounds],
          "end - start:", round((rounds[-1].end - rounds[0].start) / MB, 1))
    assert max(m.peak - m.start for m in rounds) < 100 * MB, [(m.peak - m.start) / MB for m in rounds]
    assert rounds[-1].end - rounds[0].start < 30 * MB, [(m.end - m.start) / MB for m in rounds]
    m = executor.metrics()
    assert m["tools/search/calls"] == 3050 and m["tools/search/successes"] == 3050 and m["tools/timeouts"] == 0


def test_thousand_calls_past_their_deadline_leak_nothing_lasting():
    # every call outlives the timeout: 1,000 answers "timed out" on time, 1,000 threads abandoned;
    # they end by themselves and the executor forgets them
    executor = ToolExecutor({"search": SlowTool(2.0)}, max_workers=1000, timeout=0.3, retry_count=0)
    with PeakRSS() as mem:
        start = time.monotonic()
        results = executor.execute_batch([("search", f"q{i}") for i in range(1000)])
        elapsed = time.monotonic() - start
    assert elapsed < 0.3 + 15
    assert all(r.timed_out and "timed out after 0.3 seconds" in r.text for r in results)
    assert mem.peak - mem.start < 200 * MB
    assert executor.metrics()["tools/abandoned_threads"] > 0
    deadline = time.monotonic() + 30
    while executor.metrics()["tools/abandoned_threads"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert executor.metrics()["tools/abandoned_threads"] == 0


WORKER = r"""
import os, random, sys, time
from verl_arpo.workers.rollout.tools.cache import SearchCache
cache_file, w, n, go, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.002)
c = SearchCache(cache_file, async_write=mode == "async", reference_json=True)  # opening (schema, WAL, JSON import) races too
rng, wrong = random.Random(w), []
for j in range(n):
    c.put(f"w{w}-{j}", f"v{w}-{j}")
    c.put(f"shared-{j % 40}", f"shared {j % 40}")  # every process writes the same keys
    if c.get(f"w{w}-{j}") != f"v{w}-{j}":
        wrong.append(("own", j))
    o, k = rng.randrange(8), rng.randrange(n)
    v = c.get(f"w{o}-{k}")  # another process's key: not there yet, or exactly its value
    if v is not None and v != f"v{o}-{k}":
        wrong.append(("other", o, k, v))
    if c.get("legacy-7") != "from the reference json":
        wrong.append(("legacy",))
c.close()
print("WRONG" if wrong else "ok", wrong[:3], flush=True)
"""


def test_eight_processes_write_and_read_one_cache_at_once(tmp_path):
    legacy = tmp_path / "search_cache.json"  # the reference's format: every process imports it at once
    legacy.write_text(json.dumps({f"legacy-{i}": "from the reference json" for i in range(100)}))
    go, n = tmp_path / "go", 300
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(legacy), str(w), str(n), str(go),
                               "async" if w % 2 else "sync"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp_path, env=env) for w in range(8)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        start = time.monotonic()
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert [out.split()[0] for out, _ in outs] == ["ok"] * 8, outs
    assert time.monotonic() - start < 90
    db = tmp_path / "search_cache.sqlite"
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = dict(conn.execute("SELECT query, result FROM cache"))
    conn.close()
    assert {k: v for k, v in rows.items() if k.startswith("w")} == {f"w{w}-{j}": f"v{w}-{j}" for w in range(8)
                                                                    for j in range(n)}
    assert all(rows[f"shared-{i}"] == f"shared {i}" for i in range(40))
    assert sum(k.startswith("legacy-") for k in rows) == 100
    c = SearchCache(legacy, reference_json=True)  # reopens and imports nothing twice
    assert len(c) == 8 * n + 40 + 100
    c.close()
