"""main_eval's generation in several processes (`--workers N`): whole generation calls spread over
worker processes, the CPU cores (or the GPUs) split between them (docs/performance.md, "The
evaluation in two processes").

Why: at the evaluation's shapes a CPU decode step is bound by per-op overhead, not by the matmuls, so
one process with two threads keeps neither core busy. On a 2-core machine two processes of one thread
each evaluated 600 questions 1.14-1.24x faster, at 1.5-1.7x the peak memory (the quickstart keeps one
process: the check is in docs/performance.md). With several GPUs each worker gets one.

What stays the same: every call holds the same questions as in one process (calls are whole, and a
call keeps its own index, which seeds its sampling, and its question ids), so the rows decoded together
are those of `--workers 1`. What changes: a worker's thread count, and the matmul kernels' blocking
with it, so a greedy answer may differ from the one-process run's (27-28 of 600 on the measured machine).

Call c (questions c·B ... c·B + B − 1) goes to worker c mod N. A worker runs
`python -m verl_arpo.trainer.main_eval <the same arguments> --shard i/N --generations_out FILE`:
it generates its calls only and writes them; the parent scores everything, once, as before.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("verl_arpo.eval")

__all__ = ["call_starts", "parse_shard", "worker_env", "generate_in_workers", "write_shard", "SHARD_FLAGS"]

SHARD_FLAGS = ("--shard", "--generations_out")
"""The worker-only flags: the parent passes them; a user never needs to."""


def call_starts(n_rows: int, batch_size: int, shard: int = 0, shards: int = 1) -> list[int]:
    """First question of each generation call that worker `shard` of `shards` runs: calls start at
    0, B, 2B, ... and call c goes to worker c mod `shards`."""
    return [s for c, s in enumerate(range(0, n_rows, batch_size)) if c % shards == shard]


def parse_shard(text: str) -> tuple[int, int]:
    """`"i/N"` → (i, N) with 0 ≤ i < N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard {text!r}: expected i/N, e.g. 0/2") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard {text!r}: needs 0 <= i < N")
    return i, n


def worker_env(shard: int, workers: int, cores: int, gpus: list[str], engine: str = "hf") -> dict[str, str]:
    """Environment overrides of worker `shard`: with GPUs, one each (`CUDA_VISIBLE_DEVICES`); on the
    CPU, the cores split evenly between the workers' torch threads (`OMP_NUM_THREADS`; the HF engine
    only: vLLM's CPU backend binds its own threads to cores, and two of them would share theirs)."""
    if gpus:
        if workers > len(gpus):
            raise SystemExit(f"--workers {workers}: only {len(gpus)} GPU(s) visible; use --workers <= {len(gpus)}")
        return {"CUDA_VISIBLE_DEVICES": gpus[shard]}
    if engine != "hf":
        raise SystemExit(f"--workers {workers} with --engine {engine} on the CPU: its workers would bind the same "
                         "cores; use --engine hf, or one GPU per worker")
    if workers > cores:
        raise SystemExit(f"--workers {workers}: this process may use {cores} CPU core(s); "
                         f"use --workers <= {cores} (each worker needs a core)")
    return {"OMP_NUM_THREADS": str(cores // workers), "MKL_NUM_THREADS": str(cores // workers)}


def _visible_gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ([d.strip() for d in listed.split(",") if d.strip()] if listed
            else [str(i) for i in range(torch.cuda.device_count())])


def _worker_argv(argv: list[str], shard: int, workers: int, out: Path) -> list[str]:
    """The parent's arguments without --workers and --out (the parent writes the report), plus the
    worker's shard and file."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--workers", "--out", *SHARD_FLAGS):
            skip = "=" not in a
            continue
        kept.append(a)
    return [sys.executable, "-m", "verl_arpo.trainer.main_eval", *kept,
            "--shard", f"{shard}/{workers}", "--generations_out", str(out)]


def write_shard(path: str | Path, starts: list[int], generations: list[list[dict]], batch_size: int) -> None:
    """A worker's calls: {start of each call: that call's questions' samples}."""
    by_call, i = {}, 0
    for s in starts:
        n = min(batch_size, len(generations) - i)
        by_call[str(s)] = generations[i:i + n]
        i += n
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(by_call, ensure_ascii=False))
    os.replace(tmp, path)


def generate_in_workers(argv: list[str], n_rows: int, batch_size: int, workers: int,
                        engine: str = "hf") -> list[list[dict]]:
    """Run the workers, each on its calls (`call_starts`), at once; return every question's samples
    in question order. A worker that fails ends the evaluation naming it (the others are stopped)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = _visible_gpus()
    envs = [worker_env(i, workers, cores, gpus, engine) for i in range(workers)]
    with tempfile.TemporaryDirectory(prefix="verl_arpo_eval_") as tmp:
        files = [Path(tmp) / f"shard{i}.json" for i in range(workers)]
        procs = []
        try:
            for i in range(workers):
                logger.info("eval worker %d/%d: calls starting at %s (%s)", i, workers,
                            call_starts(n_rows, batch_size, i, workers), envs[i])
                procs.append(subprocess.Popen(_worker_argv(argv, i, workers, files[i]),
                                              env={**os.environ, **envs[i]}))
            pending = dict(enumerate(procs))
            while pending:
                for i, p in list(pending.items()):
                    rc = p.poll()
                    if rc is None:
                        continue
                    del pending[i]
                    if rc != 0:
                        raise SystemExit(f"evaluation worker {i}/{workers} failed (exit {rc}): see its output above")
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        by_call: dict[int, list[list[dict]]] = {}
        for f in files:
            by_call.update({int(s): g for s, g in json.loads(f.read_text()).items()})
    out = [g for s in sorted(by_call) for g in by_call[s]]
    if len(out) != n_rows:
        raise SystemExit(f"evaluation workers returned {len(out)} questions' samples, expected {n_rows}")
    return out
