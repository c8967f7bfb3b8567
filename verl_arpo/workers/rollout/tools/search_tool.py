"""BingSearchTool: web search through Bright Data's request API (fixed public API); tag <search>.

Behaviour kept from the reference: Bing results fetched through Bright Data (zone + API key),
snippets formatted as ``Page 1: ...\\nPage 2: ...`` with at most ``max_results`` entries of at
most ``result_length`` characters, and a persistent cache keyed by the query so repeated queries
(GRPO groups ask the same thing many times) cost nothing.

Differences from the reference, and why:
- The request goes to Bright Data's request API (``POST https://api.brightdata.com/request``,
  ``Authorization: Bearer <key>``, JSON ``{zone, url, format: "raw"}`` with the Bing URL carrying
  ``brd_json=1`` so the body is parsed SERP JSON) instead of putting the key in query parameters,
  where it ended up in proxy and server logs.
- HTTP errors, 429/5xx (retried a bounded number of times with backoff), timeouts and malformed
  JSON become readable error text -- and are never cached. The reference cached whatever came back,
  so one outage poisoned the cache for good.
- Empty and duplicate snippets are dropped before keeping ``max_results``.
- The key is read from ``BRIGHTDATA_API_KEY`` when the YAML leaves ``api_key`` empty or as the
  seeds' placeholder, and it is kept out of repr, logs, errors, metrics and the cache.
- The cache is SQLite (see cache.py), not a JSON file rewritten on every write.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlencode

import requests

from verl_arpo.utils.secrets import MASK, mask_text
from verl_arpo.workers.rollout.tools.base_tool import BaseTool, ToolError, ToolInfraError
from verl_arpo.workers.rollout.tools.cache import SearchCache

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://api.brightdata.com/request"
NO_RESULTS = "No search results found."
_RETRY_STATUS = {429, 500, 502, 503, 504}
# Bing market / UI language for the two-letter `location` values the seeds use; others fall back
# to English for that country.
_MARKETS = {"us": ("en-US", "en"), "gb": ("en-GB", "en"), "uk": ("en-GB", "en"), "cn": ("zh-CN", "zh-hans"),
            "de": ("de-DE", "de"), "fr": ("fr-FR", "fr"), "jp": ("ja-JP", "ja"), "in": ("en-IN", "en"),
            "ca": ("en-CA", "en"), "au": ("en-AU", "en")}


def format_results(snippets: list[str], max_results: int, result_length: int) -> str:
    """``Page i: snippet`` lines; empty/duplicate snippets dropped, each cut to result_length."""
    seen, pages = set(), []
    for s in snippets:
        s = " ".join(str(s).split())  # SERP snippets carry newlines/nbsp runs
        if not s or s in seen:
            continue
        seen.add(s)
        pages.append(s[:result_length])
        if len(pages) >= max_results:
            break
    if not pages:
        return NO_RESULTS
    return "\n".join(f"Page {i}: {s}" for i, s in enumerate(pages, 1))


def _placeholder(key: str) -> bool:
    # the seeds ship "YOUR_BRIGHTDATA_API_KEY", "YOUR_API_KEY", "<your_API_key>"
    return not key or key.upper().startswith("YOUR_") or key.startswith("<")


class BingSearchTool(BaseTool):
    """Bing through Bright Data. Params as in the seeds' YAML, plus ``endpoint``,
    ``request_timeout``, ``http_retries``, ``retry_backoff``, ``mkt``/``language`` overrides."""

    name = "search"
    trigger_tag = "search"
    description = "Search the web and return the top results' titles and snippets."
    argument, argument_description = "query", "what to search for"

    def __init__(
        self,
        api_key: str = "",
        zone: str = "",
        max_results: int = 10,
        result_length: int = 1000,
        location: str = "us",
        cache_file: str | None = None,
        async_cache_write: bool = False,
        endpoint: str = DEFAULT_ENDPOINT,
        request_timeout: float = 30.0,
        http_retries: int = 2,
        retry_backoff: float = 1.0,
        mkt: str | None = None,
        language: str | None = None,
        **unused: Any,
    ):
        # Swapping class_path between search tools keeps the other tool's params: ignore them.
        if unused:
            logger.warning("BingSearchTool ignores params it does not use: %s", sorted(unused))
        api_key = "" if _placeholder(str(api_key or "")) else str(api_key)
        self._api_key = api_key or os.environ.get("BRIGHTDATA_API_KEY", "")
        self.zone = str(zone or os.environ.get("BRIGHTDATA_ZONE", ""))
        self.max_results = int(max_results)
        self.result_length = int(result_length)
        self.location = str(location or "us").lower()
        default_mkt, default_lang = _MARKETS.get(self.location, (f"en-{self.location.upper()}", "en"))
        self.mkt, self.language = mkt or default_mkt, language or default_lang
        self.endpoint = endpoint
        self.request_timeout = float(request_timeout)
        self.http_retries = int(http_retries)
        self.retry_backoff = float(retry_backoff)
        # the reference's search_cache.json holds this tool's (Bing's) answers: imported into its namespace
        self.cache = (SearchCache(cache_file, async_write=async_cache_write, namespace=self.cache_namespace(),
                                  reference_json=True) if cache_file else None)
        self._sessions = threading.local()  # requests.Session is not documented thread-safe
        if not self._api_key:
            logger.warning("BingSearchTool: no API key (set api_key or BRIGHTDATA_API_KEY); "
                           "searches will return an error unless cached")

    def __repr__(self) -> str:  # never the key
        return f"BingSearchTool(zone={self.zone!r}, endpoint={self.endpoint!r}, cache={self.cache!r})"

    def cache_namespace(self) -> str:
        """What shapes an answer besides the query: the endpoint, market and result formatting."""
        return (f"bing endpoint={self.endpoint} mkt={self.mkt} lang={self.language} cc={self.location} "
                f"max_results={self.max_results} result_length={self.result_length}")

    # ---------------------------------------------------------------------------------------
    def bing_url(self, query: str) -> str:
        params = {"q": query, "mkt": self.mkt, "setLang": self.language, "cc": self.location,
                  "brd_json": 1}
        return "https://www.bing.com/search?" + urlencode(params)

    def run(self, content: str) -> str:
        query = " ".join(content.split())
        if not query:
            raise ToolError("empty search query", retryable=False)
        if self.cache is not None:
            hit = self.cache.get(query)
            if hit is not None:
                return hit
        data = self._request(query)
        if not isinstance(data, dict):
            raise ToolError("search failed: malformed response (not a JSON object)", retryable=False)
        organic = data.get("organic")
        if organic is not None and not isinstance(organic, list):
            raise ToolError("search failed: malformed response (organic is not a list)", retryable=False)
        snippets = [o.get("description", "") for o in organic or [] if isinstance(o, dict)]
        # a reply that echoes the key (an error page, a debug field) must reach neither the model nor the cache
        text = self._redact(format_results(snippets, self.max_results, self.result_length))
        # No `organic` key at all may be an error page in disguise, and an empty list may be a
        # transient outage answered with 200: answer, but do not remember either.
        if self.cache is not None and organic is not None and text != NO_RESULTS:
            self.cache.put(query, text)
        return text

    def _request(self, query: str) -> Any:
        if not self._api_key:
            raise ToolError("search failed: no Bright Data API key configured", retryable=False)
        body = {"zone": self.zone, "url": self.bing_url(query), "format": "raw"}
        headers = {"Authorization": f"Bearer {self._api_key}", "Content-Type": "application/json"}
        last, last_response = "unknown error", None
        for attempt in range(self.http_retries + 1):
            if attempt:
                time.sleep(self._backoff(attempt, last_response))
            last_response = None
            try:
                resp = self._session().post(self.endpoint, json=body, headers=headers,
                                          timeout=self.request_timeout)
            except requests.Timeout:
                last = f"request timed out after {self.request_timeout:g} s"
                continue
            except requests.RequestException as exc:
                last = f"connection error ({type(exc).__name__})"
                continue
            if resp.status_code in _RETRY_STATUS:
                last, last_response = f"HTTP {resp.status_code}", resp
                continue
            if resp.status_code >= 400:   # 4xx but 429: the request itself (a bad key or zone), the service is up
                raise ToolError(self._redact(f"search failed: HTTP {resp.status_code}: {resp.text[:200]}"),
                                retryable=False)
            try:
                return resp.json()
            except ValueError:
                raise ToolError("search failed: malformed JSON in the search response", retryable=False) from None
        # the executor must not multiply our own bounded retries
        raise ToolInfraError(self._redact(f"search failed after {self.http_retries + 1} attempts: {last}"),
                             retryable=False)

    def _session(self) -> requests.Session:
        s = getattr(self._sessions, "s", None)
        if s is None:
            s = self._sessions.s = requests.Session()
        return s

    def _backoff(self, attempt: int, resp: requests.Response | None) -> float:
        delay = self.retry_backoff * 2 ** (attempt - 1)
        retry_after = resp.headers.get("Retry-After") if resp is not None else None
        if retry_after and retry_after.isdigit():
            delay = max(delay, float(retry_after))
        return min(delay, 30.0)  # a server asking for minutes is treated as down

    def _redact(self, text: str) -> str:
        """The key (from the YAML or the environment) and any credential-looking value (mask_text)."""
        # a key shorter than 8 characters is a placeholder, not a secret: replacing it would corrupt words
        long_key = self._api_key and len(self._api_key) >= 8
        return mask_text(text.replace(self._api_key, MASK) if long_key else text)

    def metrics(self) -> dict[str, Any]:
        return self.cache.metrics() if self.cache is not None else {}

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
