"""SearchCache: persistence, threads, processes with a SIGKILLed writer, reference JSON format."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verl_arpo.workers.rollout.tools.cache import SearchCache, db_path_for

ROOT = Path(__file__).resolve().parents[2]

WRITER = r"""
import os, sys, time
from verl_arpo.workers.rollout.tools.cache import SearchCache
db, wid, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cache = SearchCache(db)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
for j in range(n):
    cache.put(f"w{wid}-{j}", f"Page 1: result {wid}/{j} " + "x" * 200)
    print(j, flush=True)  # printed only after the write committed
cache.close()
"""


def test_put_get_persist_and_metrics(tmp_path):
    c = SearchCache(tmp_path / "c.sqlite")
    assert c.get("a") is None
    c.put("a", "Page 1: A")
    c.put("b", "Page 1: é ✓")
    c.put("a", "Page 1: A2")  # last write wins
    assert c.get("a") == "Page 1: A2"
    assert c.metrics() == {"cache_hits": 1, "cache_misses": 1, "cache_writes": 3, "cache_hit_rate": 0.5}
    c.close()
    c2 = SearchCache(tmp_path / "c.sqlite")
    assert (c2.get("a"), c2.get("b"), len(c2)) == ("Page 1: A2", "Page 1: é ✓", 2)
    mode = sqlite3.connect(tmp_path / "c.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    c2.close()


def test_async_writes_visible_at_once_and_flushed_on_close(tmp_path):
    c = SearchCache(tmp_path / "c.sqlite", async_write=True)
    for i in range(500):
        c.put(f"q{i}", f"r{i}")
    assert c.get("q499") == "r499"  # served from the pending queue or the DB, never missing
    c.close()
    rows = sqlite3.connect(tmp_path / "c.sqlite").execute("SELECT COUNT(*) FROM cache").fetchone()[0]
    assert rows == 500
    with pytest.raises(RuntimeError):
        c.put("late", "x")


def test_async_writes_flushed_at_interpreter_exit(tmp_path):
    code = ("from verl_arpo.workers.rollout.tools.cache import SearchCache\n"
            f"c = SearchCache({str(tmp_path / 'c.sqlite')!r}, async_write=True)\n"
            "for i in range(300): c.put(f'q{i}', 'r')\n")  # no close(): atexit must flush
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)
    assert sqlite3.connect(tmp_path / "c.sqlite").execute("SELECT COUNT(*) FROM cache").fetchone()[0] == 300


@pytest.mark.parametrize("async_write", [False, True])
def test_threads_share_one_cache(tmp_path, async_write):
    c = SearchCache(tmp_path / "c.sqlite", async_write=async_write)

    def work(t):
        for i in range(150):
            c.put(f"t{t}-{i}", f"v{t}-{i}")
            assert c.get(f"t{t}-{i}") == f"v{t}-{i}"

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(c) == 900
    c.close()


def test_four_processes_one_sigkilled(tmp_path):
    """4 writers x 1,000 entries at once; writer 0 is SIGKILLed mid-way. The cache must open cleanly
    and hold every write that any writer reported committed (all 1,000 of each survivor)."""
    db, go, n = tmp_path / "c.sqlite", tmp_path / "go", 1000
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(w), str(n), str(go)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env) for w in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    victim, done_by_victim = procs[0], []
    for line in victim.stdout:
        done_by_victim.append(int(line))
        if len(done_by_victim) >= 300:
            victim.send_signal(signal.SIGKILL)
            break
    done_by_victim += [int(x) for x in victim.stdout.read().split()]  # lines already in the pipe
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert 300 <= len(done_by_victim) < n, "the victim must die mid-way"
    for p in procs[1:]:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        assert [int(x) for x in out.split()] == list(range(n))

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    keys = {k for (k,) in conn.execute("SELECT query FROM cache")}
    conn.close()
    for w in (1, 2, 3):
        assert {f"w{w}-{j}" for j in range(n)} <= keys
    assert {f"w0-{j}" for j in done_by_victim} <= keys
    c = SearchCache(db)  # reopens cleanly and keeps working
    c.put("after", "crash")
    assert c.get("w2-999").startswith("Page 1: result 2/999") and c.get("after") == "crash"
    c.close()


def test_reference_json_import_export_roundtrip(tmp_path):
    ref = {"capital of France": "Page 1: Paris is the capital.\nPage 2: ...",
           "unicode ✓": "Page 1: 東京", "empty result": "No search results found."}
    json_file = tmp_path / "search_cache.json"
    json_file.write_text(json.dumps(ref, ensure_ascii=False), encoding="utf-8")
    assert db_path_for(json_file) == (tmp_path / "search_cache.sqlite", json_file)

    c = SearchCache(json_file, reference_json=True)  # a .json cache_file: sibling .sqlite, JSON imported
    assert c.path == tmp_path / "search_cache.sqlite"
    assert dict(c.items()) == ref
    c.put("new query", "Page 1: new")
    out = tmp_path / "exported.json"
    assert c.export_json(out) == 4
    c.close()
    assert json.loads(out.read_text(encoding="utf-8")) == dict(ref, **{"new query": "Page 1: new"})

    # importing again (file unchanged) is skipped; a changed JSON adds its new keys only
    c = SearchCache(json_file, reference_json=True)
    c.put("capital of France", "Page 1: kept")
    c.close()
    json_file.write_text(json.dumps(dict(ref, extra="Page 1: extra")), encoding="utf-8")
    c = SearchCache(json_file, reference_json=True)
    assert c.get("extra") == "Page 1: extra" and c.get("capital of France") == "Page 1: kept"
    c.close()


def test_broken_reference_json_does_not_stop_startup(tmp_path, caplog):
    bad = tmp_path / "search_cache.json"
    bad.write_text("{truncated", encoding="utf-8")
    c = SearchCache(bad, reference_json=True)
    assert len(c) == 0 and "could not import" in caplog.text
    c.close()


def test_cli_export(tmp_path):
    c = SearchCache(tmp_path / "c.sqlite")
    c.put("q", "r")
    c.close()
    r = subprocess.run([sys.executable, "-m", "verl_arpo.workers.rollout.tools.cache", "export",
                        str(tmp_path / "c.sqlite"), str(tmp_path / "o.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "o.json").read_text()) == {"q": "r"}


def test_hit_latency_is_small(tmp_path):
    c = SearchCache(tmp_path / "c.sqlite")
    c._write_many([(f"q{i}", "r" * 500) for i in range(2000)])
    t0 = time.perf_counter()
    for i in range(2000):
        assert c.get(f"q{i}") is not None
    per_hit = (time.perf_counter() - t0) / 2000
    assert per_hit < 1e-3  # generous bound for a loaded 2-core machine; typical ~10 us
    c.close()


def _open_and_write(path, barrier, results):
    from verl_arpo.workers.rollout.tools.cache import SearchCache

    barrier.wait()
    try:
        cache = SearchCache(path, namespace="tool")
        cache.put("q", "r")
        cache.close()
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(repr(exc))


def test_processes_creating_one_new_cache_at_once_all_succeed(tmp_path):
    """Two Ray workers build the search tool at the same moment on a cache file that does not exist
    yet: the loser of the switch to WAL got "database is locked" (no busy wait for a journal-mode
    change), and with tools that must build, the run stopped. Now it retries."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for trial in range(12):
        path = str(tmp_path / f"c{trial}.sqlite")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_open_and_write, args=(path, barrier, results)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [results.get(timeout=5) for _ in procs] == ["ok"] * 4, trial


def test_a_cache_on_a_network_filesystem_uses_the_rollback_journal(tmp_path, monkeypatch, caplog):
    """[issue 48] WAL needs shared memory a network filesystem does not share: there the cache warns and
    journals with file locks instead; a local disk keeps WAL."""
    import sqlite3

    from verl_arpo.workers.rollout.tools import cache as cache_mod

    mounts = ("/dev/sda1 / ext4 rw 0 0\nserver:/export /mnt/shared nfs4 rw 0 0\n"
              "tmpfs /mnt/shared/local tmpfs rw 0 0\nserver:/home /home/my\\040user nfs rw 0 0\n")
    assert cache_mod.network_filesystem("/mnt/shared/ckpt/cache.sqlite", mounts) == "nfs4"
    assert cache_mod.network_filesystem("/mnt/shared/local/cache.sqlite", mounts) is None   # the longest mount wins
    assert cache_mod.network_filesystem("/mnt/sharedx/cache.sqlite", mounts) is None
    assert cache_mod.network_filesystem("/home/my user/c.sqlite", mounts) == "nfs"

    local = cache_mod.SearchCache(tmp_path / "local" / "c.sqlite")
    local.put("q", "a")
    local.close()
    with sqlite3.connect(tmp_path / "local" / "c.sqlite") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    monkeypatch.setattr(cache_mod, "network_filesystem", lambda path, mounts=None: "nfs4")
    with caplog.at_level("WARNING"):
        remote = cache_mod.SearchCache(tmp_path / "remote" / "c.sqlite")
    remote.put("q", "a")
    assert remote.get("q") == "a"
    remote.close()
    assert "network filesystem (nfs4)" in caplog.text
    with sqlite3.connect(tmp_path / "remote" / "c.sqlite") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
