"""Persistent search cache shared by threads and processes: SQLite in WAL mode.

The reference kept ``search_cache.json`` (one JSON object ``{query: formatted_result}``) in memory
and rewrote the whole file on every new entry from a background thread. That costs O(entries) per
write, loses entries when several trainer/eval processes rewrite the file concurrently (last
writer wins), and a process killed mid-write leaves a truncated, unparsable file.

Here the cache is one SQLite table in WAL mode:
- each write is its own small transaction: a B-tree insert whose cost grows with log(size) only
  (~0.1-0.2 ms at 1k-100k entries in benchmarks/bench_tools.py, vs ~8 ms-0.8 s for the JSON);
- readers never block writers and writers of other processes queue on SQLite's lock
  (busy_timeout), so concurrent processes all keep their entries;
- a writer SIGKILLed at any point loses only its uncommitted transaction; the file stays valid
  (journal replay), and everything other processes committed is there.
- a write that fails (disk full) is counted (``cache_write_errors``) and logged, never raised: a
  cache must not turn a good search result into an error; a file that is not a database at all
  (a copy taken mid-write) is moved aside at start-up and an empty cache is used;
- ``synchronous=NORMAL``: a committed entry survives a process crash; an OS crash / power loss may
  drop the last few entries but never corrupts the file. That is the right trade for a cache.
- SQLite WAL needs a local filesystem (not NFS) because it uses shared memory between processes.
  On a network filesystem (`network_filesystem`: nfs, cifs, lustre, ... from /proc/mounts) the
  cache warns once and uses SQLite's rollback journal instead (file locks, no shared memory): WAL
  there corrupted the file (issue 48). The launch scripts default to node-local /tmp.

Compatibility: a ``cache_file`` ending in ``.json`` means "the reference's file": we use a
sibling ``.sqlite`` database, and a tool that answers as the reference's Bing tool did
(``reference_json=True``: BingSearchTool) imports the JSON into its namespace (again only if the
JSON file changed). Any other tool (the local BM25 search) leaves it alone and says so in the log:
the reference's file holds Bing's answers, which are not that tool's.
``export_json`` writes the reference's format back (atomically), and
``python -m verl_arpo.workers.rollout.tools.cache export|import|stats`` does it from the shell.

Entries are keyed by ``namespace`` + query. A search tool's namespace names the tool and every
parameter that shapes its answer (class, endpoint, market, corpus checksum, ``max_results``,
``result_length``): switching tools or parameters on the same ``cache_file`` starts a fresh set of
entries instead of serving the other configuration's answers. Reads that fail after start-up
(an I/O error, a file replaced underneath) are counted (``cache_read_errors``) and answered as a
miss: the search then runs uncached.

``async_write=True`` (the seeds' ``async_cache_write``) queues writes to a background thread that
commits them in batches; reads see queued entries at once, and ``flush``/``close``/interpreter
exit drain the queue.
"""
from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import queue
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cache (query TEXT PRIMARY KEY, result TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_BUSY_TIMEOUT_MS = 60_000
_BATCH = 256
_STOP = object()


def db_path_for(cache_file: str | Path) -> tuple[Path, Path | None]:
    """(sqlite path, reference JSON to import or None) for a configured ``cache_file``.

    Made absolute now, so a later chdir of the process cannot split the cache in two."""
    p = Path(os.path.abspath(Path(cache_file).expanduser()))
    if p.suffix.lower() == ".json":
        return p.with_suffix(".sqlite"), p
    return p, None


def _rollback(conn: sqlite3.Connection) -> None:
    # [reliability: tests/reliability/README.md] SQLite may already have rolled back (SQLITE_FULL does); a second
    # ROLLBACK raised "no transaction is active" and hid the real error
    if conn.in_transaction:
        conn.execute("ROLLBACK")


NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph", "glusterfs", "beegfs",
                       "9p", "afs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "virtiofs")


def network_filesystem(path: str | Path, mounts: str | None = None) -> str | None:
    """The filesystem type of `path` when it is a network one (SQLite's WAL needs shared memory that
    a network filesystem does not share), else None. `mounts`: the text of /proc/mounts."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    target = str(Path(path).resolve())
    best, kind = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best):
            best, kind = point, fields[2]
    return kind if kind in NETWORK_FILESYSTEMS else None


class SearchCache:
    """Query -> formatted result store. Thread-safe; safe to use from many processes at once."""

    def __init__(self, cache_file: str | Path, async_write: bool = False, namespace: str = "",
                 reference_json: bool = False):
        self.path, json_file = db_path_for(cache_file)
        self.namespace = str(namespace)
        self._prefix = f"{self.namespace}\x1f" if self.namespace else ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.journal = "wal"
        if (fs := network_filesystem(self.path.parent)) is not None:
            self.journal = "delete"
            logger.warning("search cache %s is on a network filesystem (%s): SQLite's WAL would corrupt it there, so "
                           "the rollback journal is used (slower with many writers); put the cache on a local disk "
                           "(actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file)", self.path, fs)
        self.async_write = async_write
        self._stats_lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "writes": 0}
        self._closed = False
        self._reset_process_state()
        try:
            self._create_schema()
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):  # locked, read-only, I/O error: not corruption
                raise
            self._set_aside(exc)
            self._create_schema()
        if json_file is not None and json_file.exists():
            if reference_json:
                self._import_once(json_file)
            else:
                logger.info("search cache: not importing %s into namespace %r: the reference's JSON holds its Bing "
                            "tool's answers, not this tool's; this tool's entries go to %s", json_file,
                            self.namespace, self.path)
        # flush queued writes at interpreter exit, without keeping the cache alive for that
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    def _create_schema(self) -> None:
        """Switch the file to WAL (once) and create the tables. Several processes opening a new file
        at once race for the switch, and SQLite answers the loser "database is locked" without
        waiting (no busy handler for a journal-mode change): retry until the busy timeout."""
        deadline = time.monotonic() + _BUSY_TIMEOUT_MS / 1000
        delay = 0.01
        while True:
            try:
                with self._conn() as conn:
                    if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != self.journal:
                        conn.execute(f"PRAGMA journal_mode={self.journal.upper()}")
                    conn.executescript(_SCHEMA)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(delay)
                delay = min(0.5, delay * 2)

    def _close_conns(self) -> None:
        """Close every thread's connection (errors of an already broken one are ignored)."""
        with self._conns_lock:
            for conn in self._all_conns:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._all_conns.clear()

    def _set_aside(self, exc: Exception) -> None:
        """[reliability: tests/reliability/README.md] A file that is not a valid database (a copy taken mid-write, a
        truncated download) made the constructor raise, so the search tool was not built and the
        whole run went on without search. It is a cache: move it aside and start an empty one."""
        self._close_conns()
        self._reset_process_state()
        aside = f"{self.path}.corrupt-{os.getpid()}-{int(time.time())}"
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
            except OSError:  # absent, or another process moved it first
                pass
        logger.warning("search cache %s is not a valid SQLite database (%s): moved it to %s and started "
                       "an empty cache", self.path, exc, aside)

    # ------------------------------------------------------------------- connections / fork
    def _reset_process_state(self) -> None:
        # sqlite connections and threads do not survive fork(); a child starts afresh
        self._pid = os.getpid()
        self._local = threading.local()
        self._all_conns = []
        self._conns_lock = threading.Lock()
        self._pending: dict[str, str] = {}
        self._pending_lock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue()
        self._writer: threading.Thread | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._pid != os.getpid():
            self._reset_process_state()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(str(self.path), timeout=_BUSY_TIMEOUT_MS / 1000,
                                   isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            with self._conns_lock:
                self._all_conns.append(conn)
        return conn

    # ---------------------------------------------------------------------------- reads
    def get(self, query: str) -> str | None:
        """The cached result for ``query`` or None; counts a hit or a miss (or a read error)."""
        key = self._prefix + query
        with self._pending_lock:
            value = self._pending.get(key)
        if value is None:
            try:
                row = self._conn().execute("SELECT result FROM cache WHERE query=?", (key,)).fetchone()
            except sqlite3.Error as exc:  # the search goes on uncached
                self._count_error("read_errors", 1, exc, "read")
                return None
            value = row[0] if row else None
        with self._stats_lock:
            self._stats["hits" if value is not None else "misses"] += 1
        return value

    def __contains__(self, query: str) -> bool:
        key = self._prefix + query
        with self._pending_lock:
            if key in self._pending:
                return True
        return self._conn().execute("SELECT 1 FROM cache WHERE query=?", (key,)).fetchone() is not None

    def _own(self) -> tuple[str, tuple]:
        """SQL condition selecting this namespace's rows (all rows without a namespace)."""
        if not self._prefix:
            return "1", ()
        # keys start with the prefix: a range scan on the primary key ("\x1f" + 1 = "\x20")
        return "query >= ? AND query < ?", (self._prefix, self._prefix[:-1] + "\x20")

    def __len__(self) -> int:
        self.flush()
        where, args = self._own()
        return self._conn().execute(f"SELECT COUNT(*) FROM cache WHERE {where}", args).fetchone()[0]

    def items(self) -> Iterator[tuple[str, str]]:
        """(query, result) of this namespace, queries without the namespace."""
        self.flush()
        where, args = self._own()
        n = len(self._prefix)
        for key, result in self._conn().execute(f"SELECT query, result FROM cache WHERE {where} ORDER BY query",
                                                args):
            yield key[n:], result

    # ---------------------------------------------------------------------------- writes
    def put(self, query: str, result: str) -> None:
        """Store a result (last write wins). Callers store successes only, never error text."""
        if self._closed:
            raise RuntimeError("SearchCache is closed")
        with self._stats_lock:
            self._stats["writes"] += 1
        query = self._prefix + query
        if not self.async_write:
            try:
                self._write_many([(query, result)])
            except sqlite3.Error as exc:  # e.g. the disk is full: the caller's result is still good
                self._write_failed(1, exc)
            return
        if self._pid != os.getpid():
            self._reset_process_state()
        with self._pending_lock:
            self._pending[query] = result
        self._ensure_writer()
        self._queue.put((query, result))

    def _write_many(self, rows) -> None:
        conn = self._conn()
        # BEGIN IMMEDIATE takes the write lock up front: no deadlock-prone lock upgrade
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT OR REPLACE INTO cache(query, result) VALUES (?, ?)", rows)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise

    def _write_failed(self, n: int, exc: Exception) -> None:
        """[reliability: tests/reliability/README.md] A cache write that fails (disk full, read-only file) used to raise
        out of `put`, so every *successful* search then answered with an SQLite error. It is counted
        (`cache_write_errors`) and logged (the 1st, then every 100th); the entries stay uncached."""
        self._count_error("write_errors", n, exc, "write")

    def _count_error(self, stat: str, n: int, exc: Exception, what: str) -> None:
        with self._stats_lock:
            self._stats[stat] = self._stats.get(stat, 0) + n
            count = self._stats[stat]
        if count == n or count // 100 != (count - n) // 100:
            logger.warning("search cache %s: could not %s %d entries (%d so far): %s", self.path, what, n, count,
                           exc)

    def _ensure_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            with self._conns_lock:
                if self._writer is None or not self._writer.is_alive():
                    self._writer = threading.Thread(target=self._writer_loop, name="search-cache-writer",
                                                    daemon=True)
                    self._writer.start()

    def _writer_loop(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            batch, stop = [], item is _STOP
            if not stop:
                batch.append(item)
            while len(batch) < _BATCH and not stop:
                try:
                    nxt = q.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                else:
                    batch.append(nxt)
            try:
                if batch:
                    self._write_many(batch)
            except sqlite3.Error as exc:  # keep serving; the entries stay uncached
                self._write_failed(len(batch), exc)
            finally:
                with self._pending_lock:
                    for k, v in batch:
                        if self._pending.get(k) is v:
                            del self._pending[k]
                for _ in range(len(batch) + int(stop)):
                    q.task_done()
            if stop:
                return

    def flush(self) -> None:
        """Block until every queued write is committed."""
        if self.async_write and self._pid == os.getpid() and self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Flush and close all connections. Safe to call twice (and at exit)."""
        if self._closed:
            return
        if self._pid == os.getpid() and self._writer is not None and self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join()
        self._closed = True
        self._close_conns()
        self._local = threading.local()

    # ------------------------------------------------------------------ reference JSON format
    def import_json(self, json_file: str | Path, overwrite: bool = False) -> int:
        """Load ``{query: result}``; existing entries win unless ``overwrite``. Returns #rows read."""
        data = json.loads(Path(json_file).read_text(encoding="utf-8") or "{}")
        if not isinstance(data, dict):
            raise ValueError(f"{json_file}: expected a JSON object {{query: result}}")
        rows = [(self._prefix + str(k), v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
                for k, v in data.items()]
        verb = "INSERT OR REPLACE" if overwrite else "INSERT OR IGNORE"
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(f"{verb} INTO cache(query, result) VALUES (?, ?)", rows)
            conn.execute("COMMIT")
        except BaseException:
            _rollback(conn)
            raise
        return len(rows)

    def _import_once(self, json_file: Path) -> None:
        st = json_file.stat()
        key, sig = f"imported:{self.namespace}:{json_file.resolve()}", f"{st.st_size}:{st.st_mtime_ns}"
        conn = self._conn()
        row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        if row and row[0] == sig:
            return
        try:
            n = self.import_json(json_file)
        except (ValueError, OSError) as exc:  # a broken legacy file must not stop training
            logger.warning("search cache: could not import %s: %s", json_file, exc)
            return
        conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, sig))
        logger.info("search cache: imported %d entries from %s into %s", n, json_file, self.path)

    def export_json(self, json_file: str | Path) -> int:
        """Write all entries as the reference's JSON object (atomic replace). Returns #entries."""
        data = dict(self.items())
        out = Path(json_file)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")
        os.replace(tmp, out)
        return len(data)

    # ---------------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, float]:
        with self._stats_lock:
            s = dict(self._stats)
        looked = s["hits"] + s["misses"]
        out = {"cache_hits": s["hits"], "cache_misses": s["misses"], "cache_writes": s["writes"],
               "cache_hit_rate": s["hits"] / looked if looked else 0.0}
        for stat in ("write_errors", "read_errors"):
            if s.get(stat):
                out[f"cache_{stat}"] = s[stat]
        return out

    def __repr__(self) -> str:
        return f"SearchCache({str(self.path)!r}, async_write={self.async_write}, namespace={self.namespace!r})"


def namespace_counts(cache: SearchCache) -> list[tuple[str, int]]:
    """(namespace, entries) of every tool configuration in the file; '' for un-namespaced keys."""
    counts: dict[str, int] = {}
    for key, _ in cache.items():
        ns = key.split("\x1f", 1)[0] if "\x1f" in key else ""
        counts[ns] = counts.get(ns, 0) + 1
    return sorted(counts.items())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Inspect / convert the search cache.")
    ap.add_argument("command", choices=["stats", "export", "import"])
    ap.add_argument("cache_file", help="the .sqlite database (or the .json it shadows)")
    ap.add_argument("json_file", nargs="?", help="JSON file for export/import")
    ap.add_argument("--namespace", default="",
                    help="the tool configuration's entries (as `stats` lists them; a tool's cache_namespace())")
    args = ap.parse_args(argv)
    cache = SearchCache(args.cache_file, namespace=args.namespace)
    try:
        if args.command == "stats":
            print(f"{cache.path}: {len(cache)} entries" + (f" in namespace {args.namespace!r}" if args.namespace else ""))
            if not args.namespace:
                for ns, n in namespace_counts(cache):
                    print(f"  {n:8d}  {ns!r}")
        elif not args.json_file:
            ap.error(f"{args.command} needs a json_file")
        elif args.command == "export":
            print(f"exported {cache.export_json(args.json_file)} entries to {args.json_file}")
        else:
            print(f"imported {cache.import_json(args.json_file)} entries from {args.json_file}")
    finally:
        cache.close()


if __name__ == "__main__":
    main()
