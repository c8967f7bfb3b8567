"""Tools the rollout calls when the model writes ``<tag>...</tag>``: Python sandbox, web search
(Bing via Bright Data), offline BM25 search, their shared cache, and the executor that runs them.

Import-light on purpose: no torch, and bm25s only when a LocalSearchTool is built.
"""
from verl_arpo.workers.rollout.tools.base_tool import BaseTool, ToolError
from verl_arpo.workers.rollout.tools.cache import SearchCache
from verl_arpo.workers.rollout.tools.local_search_tool import LocalSearchTool
from verl_arpo.workers.rollout.tools.python_tool import PythonTool
from verl_arpo.workers.rollout.tools.registry import (
    ToolExecutor,
    ToolResult,
    ToolsConfig,
    build_tools,
    load_tools_config,
    resolve_class,
)
from verl_arpo.workers.rollout.tools.search_tool import BingSearchTool

__all__ = [
    "BaseTool", "ToolError", "SearchCache", "PythonTool", "BingSearchTool", "LocalSearchTool",
    "ToolExecutor", "ToolResult", "ToolsConfig", "build_tools", "load_tools_config", "resolve_class",
]
