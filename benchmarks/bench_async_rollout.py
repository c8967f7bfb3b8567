"""Asynchronous vs synchronous tree rollout with a slow search API (rollout.mode, sync vs async).

Workload: ARPO at the quickstart's shape (`--prompts` prompts of the bundled training split × n = 4,
2 initial trajectories, beam 2, branch probability 0.5, entropy weight 0.2, 3 tool calls, 288
response tokens) on the quickstart's SFT model when it exists (`outputs/quickstart/sft_model`),
else the tool-calling tiny model. Tools: the sandboxed Python tool and `BingSearchTool` talking
HTTP to a local SERP server on 127.0.0.1 that answers from the bundled corpus (BM25) after a
log-normal delay (median `--latency` s, σ = 0.5, a SERP API's shape; the delay is drawn from the
query's hash, so both modes see the same delay for the same query). `--latency 0` is the
zero-latency check (async must not cost more than sync there).

Each mode runs the same steps (same seeds, alternated sync/async, fresh engine per run, one
process); reported: rollout seconds per step and per generated token (medians), the engine's busy
fraction (time inside the engine's generate/step calls over rollout time), and the tree statistics
that must agree within noise: trajectories per prompt, branches per trajectory, tool calls per
trajectory. The two modes draw from different random streams, so a step's trajectories (and
their lengths) differ between them: compare medians over several steps.

    python benchmarks/bench_async_rollout.py [--engine hf|vllm] [--latency 1.0] [--steps 3] [--quick]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


class SerpServer:
    """Bright Data's request shape on 127.0.0.1: POST {url: bing?q=...} -> {"organic": [...]},
    answered from the bundled corpus after a delay drawn from the query (log-normal)."""

    def __init__(self, median_s: float, sigma: float = 0.5):
        from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool

        self.search = LocalSearchTool(max_results=3, result_length=400)
        self.delays: list[float] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server naming
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                q = parse_qs(urlparse(body["url"]).query).get("q", [""])[0]
                delay = server.delay(q, median_s, sigma)
                server.delays.append(delay)
                time.sleep(delay)
                hits = server.search.search(q, 3) if q.strip() else []
                out = json.dumps({"organic": [{"description": h["text"]} for h in hits]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/request"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @staticmethod
    def delay(query: str, median_s: float, sigma: float) -> float:
        if median_s <= 0:
            return 0.0
        h = int.from_bytes(hashlib.sha256(query.encode()).digest()[:8], "big") / 2**64   # U(0, 1)
        z = statistics.NormalDist().inv_cdf(min(max(h, 1e-9), 1 - 1e-9))
        return median_s * math.exp(sigma * z)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class TimedEngine:
    """Counts the seconds spent inside the engine (generate / step) without changing it."""

    def __init__(self, engine):
        self.engine, self.busy = engine, 0.0
        for name in ("generate", "step"):
            fn = getattr(engine, name)

            def timed(*a, _fn=fn, **k):
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.busy += time.perf_counter() - t
            setattr(engine, name, timed)


def run_mode(mode: str, spec: dict, step: int, serp_url: str) -> dict:
    from transformers import AutoTokenizer

    from bench_branching import batch_of, load_prompts
    from verl_arpo.config import RolloutSection, from_mapping
    from verl_arpo.workers.rollout import build_agent_loop
    from verl_arpo.workers.rollout.engines import build_engine
    from verl_arpo.workers.rollout.tools.python_tool import PythonTool
    from verl_arpo.workers.rollout.tools.registry import ToolExecutor
    from verl_arpo.workers.rollout.tools.search_tool import BingSearchTool

    tok = AutoTokenizer.from_pretrained(spec["model"])
    ids, _, _ = load_prompts(tok, spec["data"], spec["prompts"])
    kw = {"dtype": spec["dtype"], "seed": 0}
    if spec["engine"] == "vllm":
        kw["max_model_len"] = 1024
    engine = build_engine(spec["engine"], spec["model"], tok, **kw)
    timer = TimedEngine(engine)
    executor = ToolExecutor({"python": PythonTool(timeout=10),
                             "search": BingSearchTool(api_key="bench", zone="bench", endpoint=serp_url,
                                                      max_results=2, result_length=200)},
                            max_workers=64, timeout=30, retry_count=0, call_limit=3)
    cfg = from_mapping(RolloutSection, dict(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5,
                                            entropy_weight=0.2, response_length=spec["response_length"],
                                            temperature=1.0), "rollout")
    loop = build_agent_loop(mode, engine, tok, executor, cfg, call_limit=3, seed=step)
    batch = batch_of(tok, ids)
    batch.meta_info["global_steps"] = step
    t0 = time.perf_counter()
    out = loop.generate_sequences(batch)
    wall = time.perf_counter() - t0
    executor.close()
    m, P = out.meta_info["metrics"], spec["prompts"]
    return dict(mode=mode, step=step, rollout_s=wall, engine_busy=timer.busy / wall,
                trajs_per_prompt=len(out) / P, branches_per_traj=m.get("rollout/branches", 0.0) / len(out),
                tool_calls_per_traj=m.get("tools/calls_per_traj", 0.0), tool_executions=m.get("tools/calls", 0.0),
                tokens_generated=m.get("rollout/tokens_generated", 0.0),
                ms_per_token=1000 * wall / max(1.0, m.get("rollout/tokens_generated", 0.0)))


def serve(median_s: float) -> None:
    """`bench_async_rollout.py serve <median_s>`: the SERP server in its own process (bm25s loads
    numba, which must not be in the process that starts a vLLM engine); prints its URL."""
    server = SerpServer(median_s)
    print(server.url, flush=True)
    threading.Event().wait()


def start_server(median_s: float):
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, __file__, "serve", str(median_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    return proc, proc.stdout.readline().strip()


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "serve":
        return serve(float(sys.argv[2]))
    from bench_common import print_table, summary_entry, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    p.add_argument("--model", default=None, help="HF folder (default: the quickstart's SFT model, else the tiny tool model)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--latency", type=float, default=1.0, help="median search latency, seconds (0 = none)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="the tool-calling tiny model (generation fast: latency dominates)")
    p.add_argument("--response_length", type=int, default=288)
    p.add_argument("--quick", action="store_true", help="tiny model, 2 prompts, 1 step, latency 0.2 s")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.steps, a.latency, a.response_length = 2, 1, 0.2, 96
    model, data, dtype = a.model, str(ROOT / "rl_datasets" / "train.parquet"), "bfloat16"
    sft = ROOT / "outputs" / "quickstart" / "sft_model"
    if model is None and not (a.quick or a.tiny) and (sft / "config.json").exists():
        model = str(sft)
    if model is None:   # the over-fitted tool model on its own prompt (fast, always calls tools)
        import tempfile

        from verl_arpo.utils.tiny_model import make_tiny_model, make_tool_model

        tmp = Path(tempfile.mkdtemp(prefix="bench_async_"))
        model = str(make_tool_model(make_tiny_model(tmp / "tiny", seed=0), tmp / "tool"))
        data, dtype = None, "float32"
    out_path = a.out or str(ROOT / "benchmarks" / "results" / f"async_rollout_{a.engine}.json")
    label = "tiny tool model" if data is None else Path(model).name
    server, url = start_server(a.latency)
    spec = dict(model=model, data=data, prompts=a.prompts, engine=a.engine, dtype=dtype,
                response_length=a.response_length)
    runs = []
    try:
        for step in range(1, a.steps + 1):
            for mode in (("sync_with_tool", "async_with_tool") if step % 2 else ("async_with_tool", "sync_with_tool")):
                runs.append(run_mode(mode, spec, step, url))
                r = runs[-1]
                print(f"step {step} {mode:<16} {r['rollout_s']:6.1f} s  engine busy {r['engine_busy']:.2f}  "
                      f"branches/traj {r['branches_per_traj']:.2f}  tool calls/traj {r['tool_calls_per_traj']:.2f}",
                      flush=True)
    finally:
        server.kill()
    rows = []
    for mode in ("sync_with_tool", "async_with_tool"):
        rs = [r for r in runs if r["mode"] == mode]
        rows.append({"mode": mode, **{k: statistics.median(r[k] for r in rs) for k in
                                      ("rollout_s", "engine_busy", "trajs_per_prompt", "branches_per_traj",
                                       "tool_calls_per_traj", "tokens_generated", "ms_per_token")}})
    sync, asyn = rows
    speedup = sync["rollout_s"] / asyn["rollout_s"]
    print_table(rows, list(rows[0]), title=f"{a.engine} engine, {label}, {a.prompts} prompts x n=4, "
                                           f"search latency median {a.latency} s, {a.steps} steps, load "
                                           f"{os.getloadavg()[0]:.1f}")
    print(f"async speed-up: {speedup:.2f}x")
    summary = [summary_entry(f"rollout s per step, sync / async ({a.engine}, search latency {a.latency} s)",
                             asyn["rollout_s"], sync["rollout_s"], speedup, 1.5 if a.latency > 0 else 0.95)]
    write_json(out_path, dict(benchmark="async_rollout", args={**vars(a), "model": model}, runs=runs, rows=rows,
                              summary=summary, load_avg=list(os.getloadavg())))


if __name__ == "__main__":
    main()
