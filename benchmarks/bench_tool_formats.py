"""The hermes format against tags, and MCP tools against direct ones (issue 49; docs/tools.md).

Three measurements, each a ratio against a baseline measured in the same run:

1. format overhead, model excluded: the same scripted turns (a call, its result, an answer; the
   engine costs nothing) through the loop in the tags and in the hermes format, EchoTool-like
   tools. Reported: loop seconds per tool call (median of `--reps`), hermes / tags.
2. format overhead, end to end: the tiny model over-fitted to call tools in each format (tags: the
   kit's tool model; hermes: the same recipe on the hermes prompt), the HF engine, the real Python
   tool, `--prompts` × n = 4 trajectories. Reported: generated tokens/s, tool calls/s, the peak RSS
   growth of this process over the rollouts; hermes / tags. The two models differ (each learnt its
   format), so their trajectories differ: the per-token and per-call rates are what compare.
3. MCP: one call through the executor to an MCP server on stdio (the SDK's own server, started
   here) against the same function as a direct in-process tool: median latency of `--calls`
   calls; and a slow MCP server (`--latency` s per call) under the async rollout against sync
   rollout (hermes, tool model 2): rollout seconds per generated token, sync / async (the goal of
   the other slow tools, ≥ 1.5).

    python benchmarks/bench_tool_formats.py [--quick] [--out benchmarks/results/tool_formats.json]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "rollout"))
sys.path.insert(0, str(ROOT / "tests"))

SLOW_SERVER = '''
import sys, time
from mcp.server.mcpserver import MCPServer
server = MCPServer("slow")
DELAY = float(sys.argv[1])

@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    time.sleep(DELAY)
    return a + b

@server.tool()
def echo(text: str) -> str:
    """Return the text."""
    time.sleep(DELAY)
    return text

server.run()
'''


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _prompts(tok, n: int, tools=None):
    import torch

    from verl_arpo.protocol import DataProto, as_object_array
    from verl_arpo.utils.tiny_model import TOOL_PROMPT_USER

    msgs = [[{"role": "user", "content": TOOL_PROMPT_USER}] for _ in range(n)]
    enc = [tok.encode(tok.apply_chat_template(m, tools=tools, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for m in msgs]
    ids = torch.tensor(enc)
    nt = {"uid": as_object_array([f"u{i}" for i in range(n)])}
    if tools:
        nt["raw_prompt"] = as_object_array(msgs)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)}, non_tensors=nt,
                               meta_info={"global_steps": 1})


# ------------------------------------------------------------------------------------ 1. scripted
def scripted_overhead(tok, reps: int, prompts: int) -> dict:
    from scripted import ScriptedEngine, Turn, make_executor
    from worker_configs import rollout

    from verl_arpo.workers.rollout import build_agent_loop

    turns = {
        "tags": (lambda req, k: Turn("<think> c </think> <python>print(12 * 34)</python>" if k < 2
                                     else "<answer> \\boxed{408} </answer>")),
        "hermes": (lambda req, k: Turn('<tool_call>{"name": "python", "arguments": {"code": "print(12 * 34)"}}'
                                       '</tool_call>' if k < 2 else "<answer> \\boxed{408} </answer>")),
    }
    out = {}
    for fmt in ("tags", "hermes"):
        marker = (lambda text: text.count("</result>")) if fmt == "tags" else \
            (lambda text: text.count("<|im_start|>assistant\n") - 1)
        times, calls = [], 0
        for r in range(reps):
            ex = make_executor(3)
            cfg, kw = rollout(n=4, initial_rollouts=4, response_length=512, multi_turn={"format": fmt}, seed=r)
            loop = build_agent_loop("sync_with_tool", ScriptedEngine(tok, turns[fmt], round_of=marker), tok, ex, cfg,
                                    **kw)
            batch = _prompts(tok, prompts, ex.schemas() if fmt == "hermes" else None)
            t0 = time.perf_counter()
            res = loop.generate_sequences(batch)
            times.append(time.perf_counter() - t0)
            calls = int(sum(res.non_tensor_batch["num_tool_calls"]))
        out[fmt] = {"s_per_call": statistics.median(times) / max(1, calls), "calls": calls}
    return out


# ---------------------------------------------------------------------------------- 2. tool models
def model_rollouts(base: str, work: Path, prompts: int, reps: int, mcp_command=None,
                   modes=("sync_with_tool",), formats=("tags", "hermes")) -> dict:
    from transformers import AutoTokenizer
    from worker_configs import rollout

    from verl_arpo.utils.tiny_model import make_tool_model
    from verl_arpo.workers.rollout import build_agent_loop
    from verl_arpo.workers.rollout.engines.hf_engine import HFEngine
    from verl_arpo.workers.rollout.tools.registry import ToolExecutor

    py = {"class_path": "verl_arpo.workers.rollout.tools.python_tool.PythonTool", "params": {"timeout": 20}}
    results = {}
    for fmt in formats:
        instances = {"python": py}
        if fmt == "hermes" and mcp_command:
            instances["calc"] = {"class_path": "verl_arpo.workers.rollout.tools.mcp_tool.MCPTool",
                                 "params": {"command": mcp_command, "name": "calc", "tools": ["add"],
                                            "call_timeout": 30}}
        ex = ToolExecutor.from_config({"tool_instances": instances, "timeout": 60, "retry_count": 0})
        schemas = ex.schemas() if fmt == "hermes" else None
        model = make_tool_model(base, work / f"tool_model_{fmt}{'_mcp' if mcp_command else ''}", tools=schemas)
        tok = AutoTokenizer.from_pretrained(model)
        for mode in modes if fmt == "hermes" else ("sync_with_tool",):
            rows = []
            rss0 = _rss_mb()
            for r in range(reps):
                engine = HFEngine(model, tok, dtype="float32", seed=r)
                cfg, kw = rollout(n=4, initial_rollouts=2, beam_size=2, branch_probability=0.5, response_length=192,
                                  temperature=1.0, multi_turn={"format": fmt}, seed=r, mode=mode)
                loop = build_agent_loop(mode, engine, tok, ex, cfg, **kw)
                t0 = time.perf_counter()
                res = loop.generate_sequences(_prompts(tok, prompts, schemas))
                dt = time.perf_counter() - t0
                m = res.meta_info["metrics"]
                rows.append({"s": dt, "tokens": m["rollout/tokens_generated"], "calls": m.get("tools/calls", 0.0),
                             "format_errors": m.get("tools/format_errors", 0.0)})
            results[f"{fmt}/{mode}"] = {
                "tokens_per_s": statistics.median(r["tokens"] / r["s"] for r in rows),
                "calls_per_s": statistics.median(r["calls"] / r["s"] for r in rows),
                "s_per_token": statistics.median(r["s"] / max(1.0, r["tokens"]) for r in rows),
                "calls": sum(r["calls"] for r in rows), "format_errors": sum(r["format_errors"] for r in rows),
                "peak_rss_growth_mb": _rss_mb() - rss0}
        ex.close()
    return results


# ------------------------------------------------------------------------------------ 3. MCP latency
def mcp_latency(command: list[str], calls: int) -> dict:
    from verl_arpo.workers.rollout.tools.base_tool import BaseTool, FunctionCall
    from verl_arpo.workers.rollout.tools.registry import ToolExecutor

    class Echo(BaseTool):
        name = trigger_tag = "echo"
        argument = "text"

        def run(self, content):
            return content

    mcp = ToolExecutor.from_config({"tool_instances": {"calc": {
        "class_path": "verl_arpo.workers.rollout.tools.mcp_tool.MCPTool",
        "params": {"command": command, "name": "calc", "tools": ["echo"]}}}, "retry_count": 0})
    direct = ToolExecutor({"echo": Echo()}, retry_count=0)
    out = {}
    for name, ex, tag in (("direct", direct, "echo"), ("mcp", mcp, "calc")):
        ex.execute(tag, FunctionCall("echo", {"text": "warm"}))
        lat = []
        for i in range(calls):
            t0 = time.perf_counter()
            r = ex.execute(tag, FunctionCall("echo", {"text": f"x{i}"}))
            lat.append(time.perf_counter() - t0)
            assert r.ok and r.text == f"x{i}", r
        out[name] = {"median_ms": 1000 * statistics.median(lat), "p90_ms": 1000 * sorted(lat)[int(0.9 * len(lat))]}
        ex.close()
    return out


def main(argv=None) -> dict:
    from bench_common import machine_info
    from transformers import AutoTokenizer

    from verl_arpo.utils.tiny_model import make_tiny_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and prompts")
    p.add_argument("--latency", type=float, default=1.0, help="seconds per call of the slow MCP server")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tool_formats.json")
    a = p.parse_args(argv)
    reps, prompts, calls = (2, 4, 50) if a.quick else (5, 8, 200)
    report = {"machine": machine_info(), "args": vars(a) | {"out": str(a.out)}}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        base = make_tiny_model(work / "tiny")
        tok = AutoTokenizer.from_pretrained(base)
        (work / "calc.py").write_text(SLOW_SERVER)
        fast = [sys.executable, str(work / "calc.py"), "0"]
        slow = [sys.executable, str(work / "calc.py"), str(a.latency)]
        report["scripted"] = scripted_overhead(tok, reps, prompts)
        report["mcp_latency"] = mcp_latency(fast, calls)
        report["models"] = model_rollouts(base, work, prompts, reps)
        report["slow_mcp"] = model_rollouts(base, work, prompts, reps, mcp_command=slow,
                                            modes=("sync_with_tool", "async_with_tool"), formats=("hermes",))
    s, m, slow_m = report["scripted"], report["models"], report["slow_mcp"]
    report["ratios"] = {
        "scripted_s_per_call_hermes_over_tags": s["hermes"]["s_per_call"] / s["tags"]["s_per_call"],
        "tokens_per_s_hermes_over_tags": m["hermes/sync_with_tool"]["tokens_per_s"] / m["tags/sync_with_tool"]["tokens_per_s"],
        "calls_per_s_hermes_over_tags": (m["hermes/sync_with_tool"]["calls_per_s"] / m["tags/sync_with_tool"]["calls_per_s"]
                                         if m["tags/sync_with_tool"]["calls_per_s"] else None),
        "mcp_over_direct_latency": report["mcp_latency"]["mcp"]["median_ms"] / report["mcp_latency"]["direct"]["median_ms"],
        "slow_mcp_s_per_token_sync_over_async": (slow_m["hermes/sync_with_tool"]["s_per_token"]
                                                 / slow_m["hermes/async_with_tool"]["s_per_token"]),
    }
    from bench_common import summary_entry

    r = report["ratios"]
    report["summary"] = [
        summary_entry("loop seconds per tool call on scripted turns, tags / hermes (the format's own cost)",
                      s["hermes"]["s_per_call"], s["tags"]["s_per_call"], 1 / r["scripted_s_per_call_hermes_over_tags"],
                      None),
        summary_entry("generated tokens/s, hermes / tags (tiny tool model of each format, HF engine)",
                      m["hermes/sync_with_tool"]["tokens_per_s"], m["tags/sync_with_tool"]["tokens_per_s"],
                      r["tokens_per_s_hermes_over_tags"], 0.9),
        summary_entry("tool call latency, direct / MCP over stdio (median ms)", report["mcp_latency"]["mcp"]["median_ms"],
                      report["mcp_latency"]["direct"]["median_ms"], 1 / r["mcp_over_direct_latency"], None),
        summary_entry(f"rollout s per generated token with a {a.latency:g} s MCP server, sync / async",
                      slow_m["hermes/async_with_tool"]["s_per_token"], slow_m["hermes/sync_with_tool"]["s_per_token"],
                      r["slow_mcp_s_per_token_sync_over_async"], 1.5),
    ]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["ratios"], indent=1))
    return report


if __name__ == "__main__":
    main()
