"""Build tools from the seeds' YAML and run batches of tool calls: ``ToolExecutor``.

Config layout (the seeds' ``tools:`` section, accepted unchanged; the ``tools:`` wrapper is
optional)::

    tools:
      call_limit: 3        max tool calls per trajectory (enforced by the rollout, exposed here)
      max_workers: 64      calls running at once
      timeout: 120         wall seconds per call, retries included
      retry_count: 3       extra attempts after an exception or an empty result
      verbose_logging: true
      fail_on_error: true  raise when a tool cannot be built (false: warn and skip it)
      tool_instances:
        python: {class_path: verl.workers.rollout.tools.python_tool.PythonTool, params: {...}}
        search: {class_path: ..., params: {...},
                 max_concurrency: 8,   optional: calls of this tool running at once (an API's rate limit)
                 timeout: 30,          optional: this tool's own wall seconds per call
                 tool_schema: {...}}   optional: its OpenAI function schema (function calling; schema.py)

Class paths under ``verl.workers.rollout.tools.`` and ``verl.workers.agent.tools.`` (the reference
repos) resolve to ours, so the seeds' YAML and launch-script overrides load as they are.

Differences from the reference executor, and why:
- ``timeout`` is real. The reference waited on a thread pool future and, on timeout, left the hung
  call holding a pool thread; enough hangs and every later call queued forever. Here each call
  runs on its own daemon thread, at most ``max_workers`` at once, and a call past its deadline is
  answered with a timeout message and its thread is *abandoned* (no longer counted against
  ``max_workers``; reported as ``tools/abandoned_threads``). Python cannot kill a thread, so a tool
  that truly never returns leaks one thread per hang -- the PythonTool kills its own subprocess
  before the executor's deadline, so it never does.
- Retries (with exponential backoff, inside the same deadline) happen on an exception or an empty
  result; a ``ToolError(retryable=False)`` is not retried (the tool already retried, or the input
  is at fault). Every failure becomes readable ``Error: ...`` text; nothing raises into the rollout.
- Metrics per tool: calls, successes, failures, timeouts, retries, time avg/max, plus the tools'
  own counters (search cache hits/misses), as ``tools/<tag>/<name>``.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from verl_arpo.config import ToolsConfig, from_mapping
from verl_arpo.workers.rollout.tools.base_tool import (
    BaseTool,
    FunctionCall,
    ToolError,
    error_text,
    is_infra_failure,
    uses_run,
)
from verl_arpo.workers.rollout.tools.schema import validate_schema

logger = logging.getLogger(__name__)

_ALIASES = {
    "verl.workers.rollout.tools.": "verl_arpo.workers.rollout.tools.",
    "verl.workers.agent.tools.": "verl_arpo.workers.rollout.tools.",
}


def _to_plain(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, (str, Path)):
        import yaml

        return yaml.safe_load(Path(cfg).read_text(encoding="utf-8")) or {}
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(f"tool config must be a dict, OmegaConf node or YAML path, got {type(cfg).__name__}")


def load_tools_config(cfg: ToolsConfig | Mapping | str | Path | Any) -> ToolsConfig:
    """ToolsConfig from a dict / OmegaConf node / YAML path, with or without a ``tools:`` wrapper."""
    if isinstance(cfg, ToolsConfig):
        return cfg
    raw = _to_plain(cfg)
    if "tools" in raw and isinstance(raw["tools"], Mapping) and "tool_instances" not in raw:
        raw = _to_plain(raw["tools"])
    raw = dict(raw)
    # a tool file without tool_instances has no tools (not the trainer's default python + search)
    raw["tool_instances"] = {str(k): dict(_to_plain(v)) for k, v in (raw.get("tool_instances") or {}).items()}
    return from_mapping(ToolsConfig, raw, "tools")  # an unknown key is an error naming it


def resolve_class(class_path: str) -> type:
    """Import ``module.Class``; reference (verl) tool paths map to ours."""
    for old, new in _ALIASES.items():
        if class_path.startswith(old):
            class_path = new + class_path[len(old):]
            break
    module_name, _, cls_name = class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"class_path must be module.Class, got {class_path!r}")
    return getattr(importlib.import_module(module_name), cls_name)


class ToolBuildError(RuntimeError):
    """A configured tool could not be built (and tools.fail_on_error is true)."""


INSTANCE_KEYS = ("class_path", "params", "max_concurrency", "timeout", "tool_schema")
"""The keys of one `tool_instances.<name>` entry; any other is refused (a typo would be ignored)."""


def _check_instance(name: str, spec: Mapping[str, Any]) -> None:
    unknown = sorted(set(spec) - set(INSTANCE_KEYS))
    if unknown:
        raise ValueError(f"tools.tool_instances.{name}: unknown key(s) {unknown}; allowed: {list(INSTANCE_KEYS)}")
    if not spec.get("class_path"):
        raise ValueError(f"tools.tool_instances.{name}.class_path: missing; write module.Class")


def build_tools(cfg: ToolsConfig | Mapping | str | Path | Any) -> dict[str, BaseTool]:
    """``{trigger_tag: tool}``; a tool that fails to load is an error (skipped with a warning only
    when ``fail_on_error`` is false)."""
    config = load_tools_config(cfg)
    tools: dict[str, BaseTool] = {}
    for name, spec in config.tool_instances.items():
        _check_instance(name, spec)   # the user's key error, whatever fail_on_error says
        if spec.get("tool_schema") is not None:   # checked before anything is built or connected
            validate_schema(_to_plain(spec["tool_schema"]), f"tools.tool_instances.{name}.tool_schema")
        try:
            cls = resolve_class(str(spec["class_path"]))
            tool = cls(**(_to_plain(spec.get("params")) or {}))
            if spec.get("tool_schema") is not None:
                tool.set_tool_schema(_to_plain(spec["tool_schema"]), f"tools.tool_instances.{name}.tool_schema")
            tag = getattr(tool, "trigger_tag", None) or name
            if tag in tools:
                raise ValueError(f"trigger tag <{tag}> is already used by {tools[tag]!r}")
        except Exception as exc:
            if config.fail_on_error:
                raise ToolBuildError(
                    f"tool {name!r} ({spec.get('class_path')}) could not be built: {type(exc).__name__}: {exc}. "
                    "Fix its params, or set actor_rollout_ref.rollout.tools.fail_on_error=false to train "
                    "without it") from exc
            logger.warning("tool %r not loaded (%s: %s); continuing without it", name,
                           type(exc).__name__, exc)
            continue
        tools[tag] = tool
        tool._instance_name = name   # ToolExecutor.from_config finds the instance's limits by it
    return tools


def tool_schemas(cfg: ToolsConfig | Mapping | str | Path | Any) -> list[dict[str, Any]]:
    """The function schemas of a tool config (what the hermes format renders into every prompt):
    the tools are built, asked (an MCP tool asks its server) and closed again."""
    executor = ToolExecutor.from_config(cfg)
    try:
        return executor.schemas()
    finally:
        executor.close()


@dataclass
class ToolResult:
    """Outcome of one call: the text for ``<result>``, whether the tool succeeded, wall seconds."""

    text: str
    ok: bool
    seconds: float
    tag: str = ""
    attempts: int = 0
    timed_out: bool = False
    infra: bool = False   # the failure was the tool's service, not the model's input (base_tool.ToolInfraError)

    def __iter__(self):  # `text, ok, seconds = result`
        return iter((self.text, self.ok, self.seconds))


_STATS = ("calls", "successes", "failures", "infra_failures", "timeouts", "retries", "time_total", "time_max")


class ToolExecutor:
    """Runs ``[(tag, content), ...]`` concurrently with real timeouts, retries and metrics."""

    def __init__(self, tools: Mapping[str, BaseTool], max_workers: int = 64, timeout: float = 120.0,
                 retry_count: int = 3, retry_backoff: float = 0.5, verbose_logging: bool = False,
                 call_limit: int = 3, limits: Mapping[str, Mapping[str, Any]] | None = None):
        self.tools = dict(tools)
        self.max_workers = max(1, int(max_workers))
        self.timeout = float(timeout)
        # per tool (`tool_instances.<name>.max_concurrency` / `.timeout`): a slot semaphore, a deadline
        limits = {tag: dict(v) for tag, v in (limits or {}).items()}
        self._timeouts = {tag: float(v["timeout"]) for tag, v in limits.items() if v.get("timeout") is not None}
        self._slots = {tag: threading.BoundedSemaphore(int(v["max_concurrency"]))
                       for tag, v in limits.items() if v.get("max_concurrency") is not None}
        self.retry_count = max(0, int(retry_count))
        self.retry_backoff = float(retry_backoff)
        self.verbose_logging = verbose_logging
        self.call_limit = int(call_limit)
        self._lock = threading.Lock()
        self._stats: dict[str, dict[str, float]] = {}
        self._abandoned: list[threading.Thread] = []
        self._pool: ThreadPoolExecutor | None = None   # `submit` only

    @classmethod
    def from_config(cls, cfg: ToolsConfig | Mapping | str | Path | Any) -> "ToolExecutor":
        config = load_tools_config(cfg)
        tools = build_tools(config)
        limits = {}
        for name, spec in config.tool_instances.items():
            tag = next((t for t, tool in tools.items() if getattr(tool, "_instance_name", None) == name), name)
            limits[tag] = {k: spec[k] for k in ("max_concurrency", "timeout") if spec.get(k) is not None}
        return cls(tools, max_workers=config.max_workers, timeout=config.timeout,
                   retry_count=config.retry_count, retry_backoff=config.retry_backoff,
                   verbose_logging=config.verbose_logging, call_limit=config.call_limit, limits=limits)

    # --------------------------------------------------------------------------- properties
    @property
    def trigger_tags(self) -> list[str]:
        return list(self.tools)

    def function_table(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """{function name: (tool tag, schema)} over every tool (function calling). Two tools that
        declare the same function name are an error naming both."""
        table: dict[str, tuple[str, dict[str, Any]]] = {}
        for tag, tool in self.tools.items():
            fns = tool.functions() if hasattr(tool, "functions") else BaseTool.functions(tool)
            for schema in fns:
                schema = validate_schema(schema, f"tool {tag!r}'s function schema")
                fname = schema["function"]["name"]
                if fname in table:
                    raise ValueError(f"function {fname!r} is declared by tools {table[fname][0]!r} and {tag!r}; "
                                     "rename one (tool_instances.<name>.tool_schema.function.name)")
                table[fname] = (tag, schema)
        return table

    def schemas(self) -> list[dict[str, Any]]:
        """Every function schema, in tool order: what `apply_chat_template(tools=...)` renders."""
        return [schema for _, schema in self.function_table().values()]

    @property
    def stop_strings(self) -> list[str]:
        """What the engine stops generation on: ``</python>``, ``</search>``, ..."""
        return [f"</{tag}>" for tag in self.tools]

    # ------------------------------------------------------------------------------ running
    def execute(self, tag: str, content: "str | FunctionCall") -> ToolResult:
        return self.execute_batch([(tag, content)])[0]

    def execute_batch(self, calls: Sequence[tuple[str, str]]) -> list[ToolResult]:
        """One result per call, in order. Never raises because of a tool."""
        results: list[ToolResult | None] = [None] * len(calls)
        finished: dict[int, ToolResult] = {}
        started: dict[int, tuple[float, threading.Thread]] = {}
        wake = threading.Condition()
        nxt = 0
        while True:
            with wake:
                while nxt < len(calls) and len(started) < self.max_workers:
                    i, (tag, content) = nxt, calls[nxt]
                    nxt += 1
                    early = self._precheck(tag, content)
                    if early is not None:
                        results[i] = early
                        continue
                    th = threading.Thread(target=self._worker, args=(i, tag, content, finished, wake),
                                          name=f"tool-{tag}-{i}", daemon=True)
                    started[i] = (time.monotonic(), th)
                    th.start()
                if not started:
                    if nxt >= len(calls):
                        break
                    continue
                first_deadline = min(t0 + self._timeout_of(calls[i][0]) for i, (t0, _) in started.items())
                if not any(i in finished for i in started):
                    wake.wait(timeout=max(0.0, first_deadline - time.monotonic()))
                now = time.monotonic()
                for i in list(started):
                    t0, th = started[i]
                    if i in finished:
                        results[i] = finished.pop(i)
                    elif now >= t0 + self._timeout_of(calls[i][0]):
                        tag = calls[i][0]
                        results[i] = ToolResult(
                            f"Error: {tag} tool timed out after {self._timeout_of(tag):g} seconds.", False,
                            now - t0, tag, timed_out=True, infra=True)
                        self._abandon(th)
                    else:
                        continue
                    del started[i]
        for r in results:
            self._record(r)
        return results  # type: ignore[return-value]

    def submit(self, tag: str, content: "str | FunctionCall", on_done: Callable[[ToolResult], None]) -> None:
        """Run one call in the background and hand its result to `on_done` (on a pool thread):
        the asynchronous rollout's entry point. Same timeouts, retries, metrics and error text
        as `execute`; at most ``max_workers`` calls run at once, the rest wait in the pool's queue."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="tool-call")
            pool = self._pool

        def run() -> None:
            try:
                result = self.execute(tag, content)
            except BaseException as exc:  # noqa: BLE001 - the rollout waits for every result
                result = ToolResult(error_text(tag, exc), False, 0.0, tag)
            on_done(result)

        pool.submit(run)

    def _precheck(self, tag: str, content: str | FunctionCall) -> ToolResult | None:
        if tag not in self.tools:
            avail = ", ".join(self.tools) or "none"
            return ToolResult(f"Error: unknown tool '{tag}'. Available tools: {avail}.", False, 0.0, tag)
        if isinstance(content, FunctionCall):   # its arguments were checked against its schema
            return None
        if not content or not content.strip():
            return ToolResult(f"Error: empty <{tag}> call: put the input between <{tag}> and </{tag}>.",
                              False, 0.0, tag)
        return None

    def _worker(self, i: int, tag: str, content: "str | FunctionCall", finished: dict[int, ToolResult],
                wake: threading.Condition) -> None:
        t0 = time.monotonic()
        try:
            result = self._call_with_retries(tag, content, t0 + self._timeout_of(tag))
        except BaseException as exc:  # noqa: BLE001 - a worker must always report back
            result = ToolResult(error_text(tag, exc), False, 0.0, tag, infra=is_infra_failure(exc))
        result.seconds = time.monotonic() - t0
        with wake:
            finished[i] = result
            wake.notify()

    def _timeout_of(self, tag: str) -> float:
        return self._timeouts.get(tag, self.timeout)

    def _call_with_retries(self, tag: str, content: "str | FunctionCall", deadline: float) -> ToolResult:
        slots = self._slots.get(tag)
        if slots is None:
            return self._attempts(tag, content, deadline)
        # the tool's own concurrency limit: waiting for a slot counts against its deadline
        if not slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return ToolResult(f"Error: {tag} tool timed out after {self._timeout_of(tag):g} seconds (all its "
                              "concurrent slots were busy).", False, 0.0, tag, timed_out=True, infra=True)
        try:
            return self._attempts(tag, content, deadline)
        finally:
            slots.release()

    def _attempts(self, tag: str, content: "str | FunctionCall", deadline: float) -> ToolResult:
        tool = self.tools[tag]
        if isinstance(content, FunctionCall):   # function calling: by name, with JSON arguments
            fn = content

            def call(_):
                return tool.call(fn.name, dict(fn.arguments))
        else:
            call = tool.run if uses_run(tool) else tool.execute
        problem, attempts, infra = "", 0, False
        for attempt in range(self.retry_count + 1):
            if attempt:
                delay = self.retry_backoff * 2 ** (attempt - 1)
                if time.monotonic() + delay >= deadline:
                    break  # no budget left for another try
                time.sleep(delay)
            attempts += 1
            try:
                text = call(content)
            except ToolError as exc:
                problem, infra = error_text(tag, exc), is_infra_failure(exc)
                if not exc.retryable:
                    break
                continue
            except Exception as exc:  # noqa: BLE001 - turned into text for the model
                problem, infra = error_text(tag, exc), is_infra_failure(exc)
                logger.debug("tool %s raised", tag, exc_info=True)
                continue
            if text is not None and str(text).strip():
                return ToolResult(str(text), True, 0.0, tag, attempts)
            problem, infra = f"Error: {tag} tool returned no output.", False
        if attempts > 1:
            problem += f" (after {attempts} attempts)"
        return ToolResult(problem, False, 0.0, tag, attempts, infra=infra)

    def _abandon(self, th: threading.Thread) -> None:
        with self._lock:
            self._abandoned = [t for t in self._abandoned if t.is_alive()] + [th]
            n = len(self._abandoned)
        logger.warning("tool thread %s timed out and was abandoned (%d still running)", th.name, n)

    # ------------------------------------------------------------------------------ metrics
    def _record(self, r: ToolResult) -> None:
        tag = r.tag if r.tag in self.tools else "unknown"  # model-chosen tags must not mint metric names
        with self._lock:
            s = self._stats.setdefault(tag, dict.fromkeys(_STATS, 0.0))
            s["calls"] += 1
            s["successes" if r.ok else "failures"] += 1
            s["timeouts"] += int(r.timed_out)
            s["infra_failures"] += int(r.infra)
            s["retries"] += max(0, r.attempts - 1)
            s["time_total"] += r.seconds
            s["time_max"] = max(s["time_max"], r.seconds)
        if self.verbose_logging:
            logger.info("tool %s: ok=%s %.3fs attempts=%d", r.tag, r.ok, r.seconds, r.attempts)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """``tools/<tag>/{calls,successes,failures,infra_failures,timeouts,retries,time_avg,time_max}``, totals
        as ``tools/<name>``, and each tool's own counters. ``reset`` starts a new window."""
        out: dict[str, float] = {}
        with self._lock:
            stats = {k: dict(v) for k, v in self._stats.items()}
            if reset:
                self._stats.clear()
            alive = sum(t.is_alive() for t in self._abandoned)
        total = dict.fromkeys(_STATS, 0.0)
        for tag, s in stats.items():
            for k in ("calls", "successes", "failures", "infra_failures", "timeouts", "retries"):
                out[f"tools/{tag}/{k}"] = s[k]
                total[k] += s[k]
            out[f"tools/{tag}/time_avg"] = s["time_total"] / s["calls"] if s["calls"] else 0.0
            out[f"tools/{tag}/time_max"] = s["time_max"]
            total["time_total"] += s["time_total"]
            total["time_max"] = max(total["time_max"], s["time_max"])
        for k in ("calls", "successes", "failures", "infra_failures", "timeouts", "retries"):
            out[f"tools/{k}"] = total[k]
        out["tools/time_avg"] = total["time_total"] / total["calls"] if total["calls"] else 0.0
        out["tools/time_max"] = total["time_max"]
        out["tools/abandoned_threads"] = alive
        for tag, tool in self.tools.items():
            try:
                own = tool.metrics() if hasattr(tool, "metrics") else {}
                out.update({f"tools/{tag}/{k}": v for k, v in own.items()})
            except Exception as exc:  # noqa: BLE001 - metrics must not break a training step
                logger.warning("tool %s metrics failed: %s", tag, exc)
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for tool in self.tools.values():
            try:
                if hasattr(tool, "close"):
                    tool.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("closing tool %r failed: %s", tool, exc)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
