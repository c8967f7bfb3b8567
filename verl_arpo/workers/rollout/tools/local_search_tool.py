"""LocalSearchTool: BM25 over a local JSONL corpus -- the offline default search (fixed API); tag <search>.

Not in the reference (which only had Bing through a paid API). It exists so training, evaluation
and tests run with no network and no key, on a corpus whose answers no model already knows (the
bundled ``search_cache/local_corpus.jsonl`` of fictional entities, made by
``search_cache/make_corpus.py``). It answers in the Bing tool's format --
``Page 1: <title>: <text>`` lines cut to ``result_length`` -- so a policy trained offline sees the
same shape of result as with web search, and it can use the same persistent cache.

Documents are JSON lines ``{"id", "title", "text"}``; title and text are indexed together with
bm25s (lower-cased word tokens, English stop words, no stemming). Documents with a zero score are
not returned, so a query sharing no word with the corpus gets "No search results found.".

bm25s imports JAX where it is installed and runs a JAX operation at import: on a GPU machine JAX
then preallocates 75% of the GPU (its default) inside the training worker that builds this tool --
107 GiB of an H200 in scripts/gpu_check.sh (docs/gpu.md, "Verify on your GPU"). Top-k of a few
thousand scores needs no GPU, so JAX is kept on the CPU here unless the user set JAX_PLATFORMS,
and retrieval takes numpy's top-k, the same on every machine whether JAX is installed or not.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from verl_arpo.workers.rollout.tools.base_tool import BaseTool, ToolError
from verl_arpo.workers.rollout.tools.cache import SearchCache
from verl_arpo.workers.rollout.tools.search_tool import format_results

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "search_cache/local_corpus.jsonl"


def resolve_path(path: str | Path) -> Path:
    """A relative path is tried from the working directory, then among the bundled files."""
    from verl_arpo.utils.resources import resolve_bundled

    return resolve_bundled(path)


def import_bm25s():
    """bm25s, imported with JAX (if installed and not yet imported) kept off the GPU (module docstring)."""
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s  # imported here: only this tool needs it

    return bm25s


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    docs = []
    with open(resolve_path(path), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            if "text" not in d:
                raise ValueError(f"{path}:{lineno}: document has no 'text'")
            docs.append({"id": str(d.get("id", lineno)), "title": str(d.get("title", "")),
                         "text": str(d["text"])})
    if not docs:
        raise ValueError(f"{path}: empty corpus")
    return docs


class LocalSearchTool(BaseTool):
    """BM25 search over ``corpus_path``. Params: ``corpus_path``, ``max_results``,
    ``result_length``, ``cache_file`` (optional), ``async_cache_write``."""

    name = "search"
    trigger_tag = "search"
    description = "Search the document collection and return the best-matching passages."
    argument, argument_description = "query", "what to search for"

    def __init__(
        self,
        corpus_path: str = DEFAULT_CORPUS,
        max_results: int = 5,
        result_length: int = 1000,
        cache_file: str | None = None,
        async_cache_write: bool = False,
        **_ignored: Any,  # Bing-only keys (api_key, zone, location) when a config swaps the class
    ):
        bm25s = import_bm25s()

        self._bm25s = bm25s
        self.corpus_path = str(resolve_path(corpus_path))
        self.max_results = int(max_results)
        self.result_length = int(result_length)
        self.docs = load_corpus(self.corpus_path)
        tokens = bm25s.tokenize([f"{d['title']} {d['text']}" for d in self.docs], stopwords="en",
                                show_progress=False)
        self.index = bm25s.BM25()
        self.index.index(tokens, show_progress=False)
        self._lock = threading.Lock()  # bm25s does not document retrieve() as thread-safe
        self.cache = (SearchCache(cache_file, async_write=async_cache_write, namespace=self.cache_namespace())
                      if cache_file else None)
        if _ignored:
            logger.info("LocalSearchTool ignores params %s", sorted(_ignored))

    def cache_namespace(self) -> str:
        """What shapes an answer besides the query: the corpus (by content) and result formatting."""
        import hashlib

        with open(self.corpus_path, "rb") as f:
            corpus = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        return f"local corpus={corpus} max_results={self.max_results} result_length={self.result_length}"

    def search(self, query: str, k: int | None = None) -> list[dict[str, Any]]:
        """Top documents with score > 0, best first, each with its ``score``."""
        k = min(k or self.max_results, len(self.docs))
        q = self._bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not q[0]:
            return []
        with self._lock:
            idx, scores = self.index.retrieve(q, k=k, show_progress=False, n_threads=1, backend_selection="numpy")
        return [dict(self.docs[int(i)], score=float(s)) for i, s in zip(idx[0], scores[0]) if s > 0]

    def run(self, content: str) -> str:
        query = " ".join(content.split())
        if not query:
            raise ToolError("empty search query", retryable=False)
        if self.cache is not None:
            hit = self.cache.get(query)
            if hit is not None:
                return hit
        # over-fetch a little: format_results drops duplicates before keeping max_results
        hits = self.search(query, k=self.max_results * 2)
        text = format_results([f"{h['title']}: {h['text']}" for h in hits], self.max_results,
                              self.result_length)
        if self.cache is not None and hits:  # no hit is cheap to recompute: keep the cache to answers
            self.cache.put(query, text)
        return text

    def metrics(self) -> dict[str, Any]:
        return self.cache.metrics() if self.cache is not None else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    def __repr__(self) -> str:
        return f"LocalSearchTool(corpus={self.corpus_path!r}, docs={len(self.docs)})"
