"""BaseTool: the contract between the rollout and a tool (fixed public API).

A tool has a ``name`` (for humans and metrics), a ``trigger_tag`` (the model writes
``<tag>content</tag>``; the rollout stops on ``</tag>``) and ``execute(content) -> str``.

Difference from the reference: the reference tools put all their work in ``execute`` and
let exceptions escape (or swallowed them into ``""``). Here a tool implements ``run``, which may
raise; ``execute`` is the never-raising wrapper for direct callers, and ``ToolExecutor`` calls
``run`` itself so it can tell a failure (exception -> retry, metrics ``failures``) from a result.
A tool written against the old API (only ``execute`` overridden) still works with the executor.

Function calling (``rollout.multi_turn.format: hermes``; docs/tools.md, "Function schemas"): a tool
also declares OpenAI function schemas (``functions()``) and answers a call by name with a dict of
arguments (``call(name, arguments)``). A tag tool is one function of one string argument
(``argument``), named after its tag; a tool YAML's ``tool_schema`` replaces the declared schema
(its description, say). An MCP tool declares the functions its server lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_arpo.workers.rollout.tools.schema import function_schema, validate_schema


class ToolError(Exception):
    """A tool failure whose message is safe to show to the model (no secrets, no host paths).

    ``retryable=False`` tells the executor not to retry: the tool already retried itself (e.g.
    the search tool's HTTP back-off) or the input is at fault, so another attempt cannot help.
    """

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class ToolInfraError(ToolError):
    """The tool's *service* failed (connection refused, rate limit, 5xx, a server gone), not the
    model's input: the trajectory's result says so, and the trainer's outage policy decides whether
    it trains (actor_rollout_ref.rollout.tools.infra_failure_policy; docs/tools.md, "Tool outages")."""


INFRA_EXCEPTIONS: tuple[type[BaseException], ...] = (ToolInfraError, ConnectionError, TimeoutError)
"""What counts as an infrastructure failure when a tool raises it (ConnectionError covers refused
and reset connections; TimeoutError a socket timeout). A model's bad code or empty query is not one."""


def is_infra_failure(exc: BaseException) -> bool:
    return isinstance(exc, INFRA_EXCEPTIONS)


def error_text(tool_name: str, exc: BaseException) -> str:
    """Readable one-line error for the model; ToolError messages are shown verbatim."""
    if isinstance(exc, ToolError):
        return f"Error: {exc}"
    return f"Error: {tool_name} tool failed: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class FunctionCall:
    """One parsed function call of the hermes format: the function's name and its JSON arguments."""

    name: str
    arguments: dict = field(default_factory=dict)


class BaseTool:
    """Base class of all tools. Subclasses set ``name``/``trigger_tag`` and implement ``run``."""

    #: human-readable name (the reference used "Python", "Search")
    name: str = "tool"
    #: tag the model writes around the call: <python>...</python>
    trigger_tag: str = "tool"
    #: the function schema's description and its one string argument (function calling)
    description: str = ""
    argument: str = "input"
    argument_description: str = ""

    def functions(self) -> list[dict[str, Any]]:
        """The OpenAI function schemas this tool answers: the configured ``tool_schema`` when the
        tool YAML gives one, else one function named after the tag with one string argument."""
        override = getattr(self, "_tool_schema", None)
        if override is not None:
            return [override]
        return [function_schema(self.trigger_tag, self.description or f"Run the {self.name} tool.", self.argument,
                                self.argument_description or f"the input of the {self.name} tool")]

    def set_tool_schema(self, schema: Any, where: str) -> None:
        """Install a tool YAML's ``tool_schema`` (checked: a bad key is an error naming it). A tag
        tool keeps one string argument, which the schema may rename and describe."""
        checked = validate_schema(schema, where)
        props = checked["function"]["parameters"].get("properties", {})
        strings = [k for k, v in props.items() if v.get("type") == "string"]
        if type(self).call is BaseTool.call and len(strings) != 1:
            raise ValueError(f"{where}.function.parameters: {type(self).__name__} takes one string argument; "
                             f"declare exactly one property of type string (got {sorted(props)})")
        if type(self).call is BaseTool.call:
            self.argument = strings[0]
        self._tool_schema = checked

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """Answer a function call (arguments already checked against the schema): a tag tool runs
        its one string argument. May raise, as ``run`` may."""
        return self.run(arguments[self.argument])

    def run(self, content: str) -> str:
        """Do the work; may raise (the executor retries and reports). Override this."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    def execute(self, content: str) -> str:
        """Run the tool and always return text: failures become ``Error: ...`` lines."""
        try:
            return self.run(content)
        except Exception as exc:  # noqa: BLE001 - the contract is "never raise into the rollout"
            return error_text(self.name, exc)

    def metrics(self) -> dict[str, Any]:
        """Tool-specific counters (e.g. cache hits); the executor prefixes them with tools/<tag>/."""
        return {}

    def close(self) -> None:
        """Release resources (flush caches, stop threads). Safe to call twice."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tag={self.trigger_tag!r})"


def uses_run(tool: Any) -> bool:
    """True when ``tool`` implements ``run`` (new API); False for execute-only tools."""
    run = getattr(type(tool), "run", None)
    return run is not None and run is not BaseTool.run
