"""MCPTool: the functions of an MCP (Model Context Protocol) server as one tool of the rollout
(docs/tools.md, "MCP servers").

The tool starts a stdio server (``command``) or joins a streamable-HTTP one (``url``), lists its
tools, and declares each as an OpenAI function schema (``functions()``); ``call(name, arguments)``
runs one on the server and returns its content as text. The protocol is the official ``mcp`` SDK's
(``mcp.Client`` over its stdio / streamable-HTTP transports)::

    tools:
      tool_instances:
        calc:
          class_path: verl_arpo.workers.rollout.tools.mcp_tool.MCPTool
          params: {command: [python, -m, my_mcp_server], name: calc, call_timeout: 10}
          timeout: 15           # the executor's deadline for one call
          max_concurrency: 4

Other params: ``args``, ``env``; ``url``, ``headers`` (HTTP); ``tools`` (an allow-list of function
names); ``connect_timeout``. The trigger tag is ``name``: several servers coexist under their names.

Why it is built this way:
- ONE persistent session per tool instance: starting a server (a subprocess, or an HTTP session and
  its handshake) per call costs more than most calls. The SDK is asyncio: the session lives on an
  event loop on a daemon thread, and the executor's threads submit their calls to it (the session
  multiplexes concurrent requests).
- A server that crashes, exits or hangs (no answer within ``call_timeout``) fails *that* call with a
  ``ToolInfraError`` (the trainer's outage policy applies; not retried, as the call may have acted
  before the server died) and its session is dropped; the next call opens a new one (a new
  subprocess, a new HTTP session) within ``connect_timeout``. An error the server reports
  (``isError``) is the model's: a ``ToolError`` whose text the model sees.
- ``headers`` and ``env`` values (API keys) never appear in errors, logs or ``repr``.
"""
from __future__ import annotations

import asyncio
import atexit
import base64
import binascii
import concurrent.futures
import copy
import json
import logging
import math
import shlex
import threading
import weakref
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, NoReturn
from urllib.parse import urlsplit

import anyio
import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT, CallToolResult
from pydantic import ValidationError

from verl_arpo.workers.rollout.tools.base_tool import BaseTool, ToolError, ToolInfraError
from verl_arpo.workers.rollout.tools.schema import PROPERTY_KEYS, validate_schema

logger = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[MCPTool] = weakref.WeakSet()   # closed at exit: no stdio server outlives us
atexit.register(lambda: [tool.close() for tool in list(_LIVE)])


@dataclass(eq=False)
class _Session:
    """One connection: the SDK client, held open by its holder task until ``stop`` is set."""

    stop: anyio.Event
    client: Client | None = None
    pid: int | None = None
    listing: list[Any] = field(default_factory=list)
    dead: bool = False


class MCPTool(BaseTool):
    """Every function of one MCP server; see the module docstring."""

    def __init__(self, command: list[str] | str | None = None, args: list[str] | None = None,
                 env: dict | None = None, url: str | None = None, headers: dict | None = None,
                 tools: list[str] | None = None, connect_timeout: float = 30, call_timeout: float = 60,
                 name: str = "mcp"):
        if (command is None) == (url is None):
            raise ValueError(f"MCPTool {name!r}: give exactly one of params.command (a stdio server: the command "
                             "that starts it, e.g. [python, -m, my_server]) or params.url (a streamable-HTTP "
                             f"server: its endpoint, e.g. http://host:8000/mcp); got {'both' if url else 'neither'}")
        self.trigger_tag = self.name = name
        argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command or []]
        self._argv, self._url = argv + [str(a) for a in args or []], url
        if command is not None and not self._argv:
            raise ValueError(f"MCPTool {name!r}: params.command is empty; write the command that starts the server")
        self._env = {str(k): str(v) for k, v in (env or {}).items()}
        self._headers = {str(k): str(v) for k, v in (headers or {}).items()}
        self._secrets = self._secret_values()
        self.connect_timeout, self.call_timeout = float(connect_timeout), float(call_timeout)
        self._counts = dict.fromkeys(("calls", "errors", "infra_errors", "reconnects"), 0)
        self._lock = threading.Lock()   # guards the session and the counters
        self._session: _Session | None = None
        self._holders: set[asyncio.Task] = set()
        self._closed = False
        self._names: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{name}", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        try:
            self._functions = self._declare(self._ensure_session().listing, tools)
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------- the tool API
    def functions(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self._functions)

    def set_tool_schema(self, schema: Any, where: str) -> None:
        raise ValueError(f"{where}: an MCP tool declares its server's functions; choose them with "
                         "params.tools instead of a tool_schema")

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        if name not in self._names:
            raise ToolError(f"MCP server {self.name} has no function {name!r}; its functions are "
                            f"{', '.join(sorted(self._names))}", retryable=False)
        sess = self._ensure_session()
        self._count("calls")
        fut = asyncio.run_coroutine_threadsafe(
            sess.client.call_tool(name, dict(arguments), read_timeout_seconds=self.call_timeout), self._loop)
        hung = f"{name} got no answer within {self.call_timeout:g} s (server hung?)"
        try:
            result: CallToolResult = fut.result(timeout=self.call_timeout + 2)   # the SDK's timeout, backed up
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self._fail(sess, hung)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                self._fail(sess, hung)
            if exc.code == CONNECTION_CLOSED:
                self._fail(sess, f"connection closed during {name} (server exited or crashed?)")
            self._count("errors")   # a protocol error from a live server: it refused the request
            raise ToolError(f"MCP server {self.name} refused {name}: {self._redact(exc.message)}",
                            retryable=False) from None
        except ValidationError:
            self._count("errors")
            raise ToolError(f"MCP server {self.name} returned a malformed result for {name}", retryable=False) from None
        except Exception as exc:  # noqa: BLE001 - closed streams, broken pipes, HTTP errors: the service
            self._fail(sess, f"{name} failed: {_reason(exc)}")
        text = _render(result)
        if result.is_error:
            self._count("errors")
            raise ToolError(text or f"{name} reported an error", retryable=False)
        return text or "[no content]"   # an empty result is an answer, not a reason to re-run the call

    def run(self, content: str) -> str:
        """Tag format: ``<tag>{"name": "add", "arguments": {"a": 1, "b": 2}}</tag>``."""
        try:
            req = json.loads(content)
            if not isinstance(req, dict) or not isinstance(req.get("name"), str) \
                    or not isinstance(req.get("arguments", {}), dict):
                raise ValueError("not an object with a string name and an object of arguments")
        except ValueError as exc:
            raise ToolError(f'write a JSON object {{"name": <one of {", ".join(sorted(self._names))}>, '
                            f'"arguments": {{...}}}} inside <{self.trigger_tag}>: {exc}', retryable=False) from None
        return self.call(req["name"], req.get("arguments", {}))

    def metrics(self) -> dict[str, Any]:
        """calls, errors (the server's isError/refusals), infra_errors (crash, hang, no connection), reconnects."""
        with self._lock:
            return dict(self._counts)

    @property
    def server_pid(self) -> int | None:
        """The stdio server's process id (None over HTTP, or while no session is open)."""
        sess = self._session
        return sess.pid if sess is not None else None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sess, self._session = self._session, None
        _LIVE.discard(self)
        if sess is not None:
            self._stop(sess)
        if self._thread.is_alive():
            async def drain() -> None:   # every holder shuts its server down (each of its waits is bounded)
                if self._holders:
                    await asyncio.wait(list(self._holders), timeout=10)
            try:
                asyncio.run_coroutine_threadsafe(drain(), self._loop).result(timeout=12)
            except Exception as exc:  # noqa: BLE001 - closing must not raise
                logger.warning("MCP server %s did not shut down cleanly: %s", self.name, type(exc).__name__)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def __repr__(self) -> str:
        return f"MCPTool(name={self.name!r}, {self._where()}, headers={sorted(self._headers)}, env={sorted(self._env)})"

    def _where(self) -> str:
        """The server without secrets: the executable, or the URL without userinfo and query."""
        if self._url is None:
            return f"command={self._argv[0]}"
        u = urlsplit(self._url)
        return f"url={u.scheme}://{u.hostname}{f':{u.port}' if u.port else ''}{u.path}"

    # --------------------------------------------------------------------------- the session
    def _ensure_session(self) -> _Session:
        with self._lock:
            if self._closed:
                raise ToolInfraError(f"MCP server {self.name}: the tool is closed", retryable=False)
            if self._session is not None and not self._session.dead:
                return self._session
            again, self._session = hasattr(self, "_functions"), None   # the first connect is no reconnect
            fut = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
            try:
                sess = fut.result(timeout=self.connect_timeout + 5)   # _hold's own deadline ends it first
            except Exception as exc:  # noqa: BLE001 - the reason, redacted, is the error's text
                fut.cancel()
                self._counts["infra_errors"] += 1
                raise ToolInfraError(f"MCP server {self.name}: could not connect ({self._where()}, within "
                                     f"{self.connect_timeout:g} s): {self._redact(_reason(exc))}") from None
            self._session = sess
            self._counts["reconnects"] += int(again)
            return sess

    async def _open(self) -> _Session:
        sess, ready = _Session(stop=anyio.Event()), asyncio.get_running_loop().create_future()
        holder = asyncio.get_running_loop().create_task(self._hold(sess, ready))
        self._holders.add(holder)
        holder.add_done_callback(self._holders.discard)
        return await ready

    async def _hold(self, sess: _Session, ready: asyncio.Future) -> None:
        """Open the client, list the tools, and hold the session open until ``stop``: one task, as
        anyio's scopes must be left by the task that entered them."""
        before = _children()
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + self.connect_timeout) as scope:
                async with AsyncExitStack() as stack:
                    if self._url is None:
                        target: Any = StdioServerParameters(command=self._argv[0], args=self._argv[1:],
                                                            env=self._env or None)
                    else:
                        http = await stack.enter_async_context(httpx2.AsyncClient(
                            headers=self._headers, timeout=httpx2.Timeout(30.0, connect=self.connect_timeout,
                                                                         read=300.0)))
                        target = streamable_http_client(self._url, http_client=http)
                    client = await stack.enter_async_context(Client(target, cache=None))
                    cursor, listing = None, []
                    for _ in range(100):   # pages of the tool list
                        page = await client.list_tools(cursor=cursor)
                        listing += page.tools
                        if not (cursor := page.next_cursor):
                            break
                    scope.deadline = math.inf   # connected: now only close() or a broken stream ends it
                    new = _children() - before
                    sess.client, sess.listing, sess.pid = client, listing, new.pop() if len(new) == 1 else None
                    if not ready.done():   # else the caller gave up waiting: close at once
                        ready.set_result(sess)
                        await sess.stop.wait()
            if not ready.done():
                ready.set_exception(TimeoutError("no handshake" if scope.cancelled_caught else "closed"))
        except Exception as exc:  # noqa: BLE001 - the connect's error, or the end of a broken session
            if not ready.done():
                ready.set_exception(exc)
            else:
                logger.debug("MCP server %s: session ended: %s", self.name, self._redact(_reason(exc)))
        finally:
            sess.dead = True

    def _stop(self, sess: _Session) -> None:
        """Drop a session: its holder leaves the client's context (the SDK stops the subprocess or
        ends the HTTP session) in the background, so no caller waits for it."""
        sess.dead = True
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(sess.stop.set)

    def _fail(self, sess: _Session, reason: str) -> NoReturn:
        with self._lock:
            if self._session is sess:
                self._session = None
            self._counts["infra_errors"] += 1
        self._stop(sess)
        message = f"MCP server {self.name}: {self._redact(reason)}"
        logger.warning("%s; the next call reconnects", message)
        raise ToolInfraError(message, retryable=False) from None

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    # ------------------------------------------------------------------------ schemas, secrets
    def _declare(self, listing: list[Any], allow: list[str] | None) -> list[dict[str, Any]]:
        missing = sorted(set(allow or ()) - {t.name for t in listing})
        if missing:
            raise ValueError(f"MCPTool {self.name!r}: params.tools names {missing}, which the server does not "
                             f"have; its tools are {sorted(t.name for t in listing)}")
        fns = [validate_schema({"name": t.name, "description": t.description or t.title or t.name,
                                "parameters": _strip(t.input_schema)}, where=f"MCP server {self.name} tool {t.name}")
               for t in listing if allow is None or t.name in allow]
        self._names = {f["function"]["name"] for f in fns}
        return fns

    def _secret_values(self) -> list[str]:
        vals = set(self._headers.values()) | set(self._env.values())
        vals |= {v.split()[-1] for v in self._headers.values() if v.split()}   # the token of "Bearer <token>"
        if self._url:
            u = urlsplit(self._url)
            vals |= {u.password or "", u.query}
        return sorted((v for v in vals if len(v) >= 4), key=len, reverse=True)

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def _strip(schema: Any) -> Any:
    """An MCP input schema without the JSON-Schema keys schema.py does not list (a server's schema
    is no user's typo; dropping a keyword such as ``multipleOf`` only loosens what the prompt shows)."""
    if isinstance(schema, list):   # anyOf / oneOf
        return [_strip(sub) for sub in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: v for k, v in schema.items() if k in PROPERTY_KEYS}
    for key in ("properties", "$defs", "definitions"):   # names -> schemas
        if isinstance(out.get(key), Mapping):
            out[key] = {name: _strip(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "anyOf", "oneOf"):
        if key in out:
            out[key] = _strip(out[key])
    return out


def _render(result: CallToolResult) -> str:
    """The content blocks as text: text verbatim, other blocks as a short placeholder."""
    parts = []
    for block in result.content:
        res = getattr(block, "resource", None)
        if block.type == "text" or hasattr(res, "text"):
            parts.append(block.text if block.type == "text" else res.text)
        elif block.type in ("image", "audio") or hasattr(res, "blob"):
            data, what = (block.data, block.mime_type) if res is None else (res.blob, res.mime_type or res.uri)
            parts.append(f"[{what}, {_size(data)} bytes]")
        else:
            parts.append(f"[{block.type} {getattr(block, 'uri', '')}]")
    if not any(b.type == "text" for b in result.content) and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _reason(exc: BaseException) -> str:
    """A short reason: the first leaf of an exception group (anyio's task groups raise them)."""
    while getattr(exc, "exceptions", None):   # an ExceptionGroup (the backport's on Python 3.10)
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _size(data: str) -> int:
    try:
        return len(base64.b64decode(data))
    except (binascii.Error, ValueError):
        return len(data)


def _children() -> set[int]:
    """The processes the calling thread started (the loop thread spawns the stdio server): how
    ``server_pid`` is found, as the SDK does not expose its subprocess. Empty where /proc lacks it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/children", encoding="ascii") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()
