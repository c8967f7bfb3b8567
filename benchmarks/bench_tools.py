"""Tool overheads against the reference's way of doing the same thing, measured in one run.

1. Python tool: executions/s of our sandboxed PythonTool (bubblewrap, and the rlimit-only
   fallback) vs a plain ``python -c CODE`` subprocess (what the reference ran, minus its shell).
2. Search cache: per-write and per-hit latency at 1k / 10k / 100k entries for our SQLite (WAL)
   cache vs the reference's JSON cache (dict in memory + the whole file rewritten per write),
   plus the start-up cost (reference: json.load of the file; ours: opening the database).
3. Launching from a large host (under root only, where the sandbox drops to uid 65534): from a
   process holding ``--host_mb`` of written memory (an evaluator or rollout worker holds GBs), each
   call of the Python tool followed by one write to every page of the host, launched through
   util-linux's setpriv (ours: CPython can vfork) against ``Popen(user=...)`` (a fork of the host).
   Reported: seconds a call costs the host in all (the call and the faults its writes take after
   it), the write's own seconds against a write with no call before it, and the host's minor page
   faults per call (docs/performance.md, "Launching a tool without forking the host").

Each cache entry is ~1 KB (a formatted result with a few pages). Write latency is measured at a
given size: the cache is pre-filled to N entries, then K single writes are timed (K is smaller for
the JSON baseline at large N because each write rewrites the whole file; nothing is extrapolated).

    python benchmarks/bench_tools.py [--quick]     # prints a table, writes benchmarks/results/tools.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl_arpo.workers.rollout.tools import sandbox  # noqa: E402
from verl_arpo.workers.rollout.tools.cache import SearchCache  # noqa: E402
from verl_arpo.workers.rollout.tools.python_tool import DEFAULT_PYTHON, PythonTool, bwrap_available  # noqa: E402

CODE = "import math\nprint(sum(math.sqrt(i) for i in range(1000)))"


def _rate(fn, n: int, threads: int = 1) -> float:
    """Executions per second of ``fn`` over ``n`` calls on ``threads`` threads."""
    fn()  # warm-up (page cache, bwrap probe)
    t0 = time.perf_counter()
    if threads == 1:
        for _ in range(n):
            fn()
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: fn(), range(n)))
    return n / (time.perf_counter() - t0)


def bench_python(n: int) -> list:
    def plain():
        r = subprocess.run([DEFAULT_PYTHON, "-c", CODE], capture_output=True, text=True, timeout=30)
        assert r.stdout.strip()

    rows = []
    variants = [("plain `python -c` subprocess (reference)", plain)]
    if bwrap_available():
        tool = PythonTool(sandbox="bwrap", timeout=30)
        variants.append(("PythonTool, bubblewrap sandbox", lambda: tool.run(CODE)))
    fallback = PythonTool(sandbox="none", timeout=30)
    variants.append(("PythonTool, rlimit-only fallback", lambda: fallback.run(CODE)))
    for threads in (1, 2):
        for name, fn in variants:
            rows.append({"variant": name, "threads": threads, "exec_per_s": _rate(fn, n, threads)})
    return rows


def bench_launch(host_mb: int, calls: int) -> list:
    """Per call of the default-sandbox Python tool from a host holding `host_mb` of written memory:
    the call's seconds, the seconds of the host's next write to each of its pages (the faults a fork
    leaves behind), and the host's minor page faults, setpriv launch against Popen's own uid drop."""
    import resource

    if sandbox.drop_to() is None:
        print("launch from a large host: skipped (not root: no uid drop, CPython vforks either way)")
        return []
    if sandbox.setpriv_path() is None:
        print("launch from a large host: skipped (no setpriv here: every launch forks)")
        return []
    host = bytearray(host_mb << 20)
    pages = len(range(0, len(host), 4096))

    def write_pages(value: int) -> float:
        t = time.perf_counter()
        host[::4096] = bytes([value]) * pages
        return time.perf_counter() - t

    tool = PythonTool(sandbox="auto" if bwrap_available() else "none", timeout=30)
    real_setpriv_path = sandbox.setpriv_path
    rows = []
    try:
        for name, finder in (("no call (baseline write)", None), ("setpriv (ours)", real_setpriv_path),
                             ("Popen(user=) (fork)", lambda: None)):
            write_pages(1)
            call_s, write_s = [], []
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for i in range(calls):
                if finder is not None:
                    sandbox.setpriv_path = finder
                    t = time.perf_counter()
                    assert tool.run(CODE).strip()
                    call_s.append(time.perf_counter() - t)
                write_s.append(write_pages(i % 250 + 2))
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
            rows.append({"variant": name, "host_mb": host_mb, "calls": calls,
                         "call_s": statistics.median(call_s) if call_s else 0.0,
                         "write_s": statistics.median(write_s), "minor_faults_per_call": faults / calls})
    finally:
        sandbox.setpriv_path = real_setpriv_path
    base = rows[0]["write_s"]
    for r in rows:
        r["host_s_per_call"] = r["call_s"] + r["write_s"] - base
    fork = rows[2]["host_s_per_call"]
    for r in rows:
        r["speedup_vs_fork"] = fork / r["host_s_per_call"] if r["host_s_per_call"] > 0 else None
    return rows


class JsonCache:
    """The reference's cache: a dict, and json.dump of the whole dict on every new entry."""

    def __init__(self, path: Path):
        self.path, self.data = path, {}

    def put(self, q, r):
        self.data[q] = r
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, ensure_ascii=False)
        os.replace(tmp, self.path)

    def get(self, q):
        return self.data.get(q)


def _entry(i: int) -> str:
    return "\n".join(f"Page {p}: result {i}-{p} " + "lorem ipsum " * 15 for p in range(1, 6))[:1000]


def bench_cache(sizes, writes: int, hits: int, tmp: Path) -> list:
    rows = []
    for n in sizes:
        pre = [(f"query {i}", _entry(i)) for i in range(n)]
        rnd = random.Random(n)
        probe = [f"query {rnd.randrange(n)}" for _ in range(hits)]

        # --- ours: SQLite WAL (sync writes, each its own transaction; and async put latency)
        db = tmp / f"c{n}.sqlite"
        c = SearchCache(db)
        c._write_many(pre)  # bulk pre-fill, as an import would
        t0 = time.perf_counter()
        for j in range(writes):
            c.put(f"new {j}", _entry(j))
        w_sql = (time.perf_counter() - t0) / writes
        t0 = time.perf_counter()
        for q in probe:
            assert c.get(q) is not None
        h_sql = (time.perf_counter() - t0) / hits
        c.close()
        t0 = time.perf_counter()
        c = SearchCache(db)
        c.get("query 0")
        open_sql = time.perf_counter() - t0
        c.close()
        ca = SearchCache(db, async_write=True)
        t0 = time.perf_counter()
        for j in range(writes):
            ca.put(f"async {j}", _entry(j))
        w_async = (time.perf_counter() - t0) / writes
        ca.close()

        # --- reference: JSON rewritten per write
        jc = JsonCache(tmp / f"c{n}.json")
        jc.data = dict(pre)
        k = max(3, min(writes, int(2e6 // max(n, 1))))  # fewer timed writes when each is O(n)
        t0 = time.perf_counter()
        for j in range(k):
            jc.put(f"new {j}", _entry(j))
        w_json = (time.perf_counter() - t0) / k
        t0 = time.perf_counter()
        for q in probe:
            assert jc.get(q) is not None
        h_json = (time.perf_counter() - t0) / hits
        t0 = time.perf_counter()
        with open(jc.path, encoding="utf-8") as f:
            json.load(f)
        open_json = time.perf_counter() - t0
        rows.append({
            "entries": n, "sqlite_write_us": w_sql * 1e6, "sqlite_async_put_us": w_async * 1e6,
            "json_write_us": w_json * 1e6, "json_writes_timed": k, "write_speedup": w_json / w_sql,
            "sqlite_hit_us": h_sql * 1e6, "json_hit_us": h_json * 1e6,
            "sqlite_open_ms": open_sql * 1e3, "json_load_ms": open_json * 1e3,
            "sqlite_mb": db.stat().st_size / 2**20, "json_mb": jc.path.stat().st_size / 2**20,
        })
        db.unlink()
        for p in tmp.glob(f"c{n}.*"):
            p.unlink()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tools.json")
    ap.add_argument("--host_mb", type=int, default=None,
                    help="written memory of the host the launch is measured from (default 4096; --quick 256)")
    args = ap.parse_args()
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    n_exec = 10 if args.quick else 40
    host_mb = args.host_mb or (256 if args.quick else 4096)

    tmp = Path(tempfile.mkdtemp(prefix="bench_tools_"))
    try:
        py_rows = bench_python(n_exec)
        cache_rows = bench_cache(sizes, writes=500, hits=2000, tmp=tmp)
        launch_rows = bench_launch(host_mb, 4 if args.quick else 12)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nPython tool: executions/s ({n_exec} runs of a tiny script; higher is better)")
    print(f"{'variant':45s} {'threads':>7s} {'exec/s':>8s} {'vs plain':>9s}")
    for r in py_rows:
        base = next(b["exec_per_s"] for b in py_rows if b["threads"] == r["threads"] and "reference" in b["variant"])
        r["vs_plain"] = r["exec_per_s"] / base
        print(f"{r['variant']:45s} {r['threads']:7d} {r['exec_per_s']:8.1f} {r['vs_plain']:8.2f}x")

    print("\nSearch cache, ~1 KB entries (latency per operation at N entries; lower is better)")
    hdr = (f"{'N':>7s} {'sqlite write':>13s} {'async put':>10s} {'JSON write (ref)':>17s} {'speed-up':>9s} "
           f"{'sqlite hit':>11s} {'dict hit (ref)':>15s} {'sqlite open':>12s} {'JSON load (ref)':>16s}")
    print(hdr)
    for r in cache_rows:
        print(f"{r['entries']:7d} {r['sqlite_write_us']:11.0f}us {r['sqlite_async_put_us']:8.1f}us "
              f"{r['json_write_us'] / 1e3:13.1f}ms({r['json_writes_timed']}) {r['write_speedup']:8.0f}x "
              f"{r['sqlite_hit_us']:9.1f}us {r['json_hit_us']:13.2f}us {r['sqlite_open_ms']:10.1f}ms "
              f"{r['json_load_ms']:14.1f}ms")
    print("(JSON write: measured over the number of writes in parentheses, none extrapolated)")

    if launch_rows:
        print(f"\nPython tool launched from a host holding {host_mb} MB of written memory (per call; lower is better)")
        print(f"{'variant':26s} {'call':>8s} {'next write':>11s} {'host cost':>10s} {'faults':>9s} {'vs fork':>8s}")
        for r in launch_rows:
            ratio = f"{r['speedup_vs_fork']:7.1f}x" if r["speedup_vs_fork"] else "      --"
            print(f"{r['variant']:26s} {r['call_s'] * 1e3:6.1f}ms {r['write_s'] * 1e3:9.1f}ms "
                  f"{r['host_s_per_call'] * 1e3:8.1f}ms {r['minor_faults_per_call']:9.0f} {ratio}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"python": py_rows, "cache": cache_rows, "launch": launch_rows,
              "meta": {"bwrap": bwrap_available(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "kernel": platform.release(), "quick": args.quick,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S")}}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
