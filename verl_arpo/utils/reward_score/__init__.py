"""Rule-based rewards, all with verl's signature `compute_score(data_source, solution_str,
ground_truth, extra_info=None)`; `default_compute_score` dispatches on `data_source`.

Convention: every scorer here returns a dict with at least `score` (float) and `reason` (str),
plus `answer` and scorer-specific fields (deep_research adds `f1`). The reward manager also
accepts a plain float from user functions.

Dispatch (case-insensitive): an exact name in `DATA_SOURCE_SCORERS`, else the longest matching
prefix in `DATA_SOURCE_PREFIXES`, else ValueError. Extend with `register_data_source`. Note that
"gsm8k" (the ARPO reasoning set, answers in `\\boxed{}`) goes to the math scorer, while
"openai/gsm8k" (verl's `####` format) goes to the GSM8K scorer.

This package imports no torch; math-verify (sympy) is imported lazily by the math scorer.
"""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

from . import deep_research, gsm8k, math
from ._text import sanitize_text

__all__ = ["default_compute_score", "register_data_source", "get_scorer", "SCORERS",
           "DATA_SOURCE_SCORERS", "DATA_SOURCE_PREFIXES"]

SCORERS: dict[str, Callable[..., Any]] = {
    "math": math.compute_score,
    "gsm8k": gsm8k.compute_score,
    "deep_research": deep_research.compute_score,
    "qa_f1": deep_research.compute_score_qa_f1,
}

_MATH_SOURCES = ("math", "aime", "aime24", "aime25", "aime2024", "aime2025", "math500", "math_500",
                 "amc", "amc23", "gsm8k", "olympiadbench", "minerva", "deepscaler", "dapo_math")
_QA_SOURCES = ("hotpotqa", "2wiki", "2wikimultihopqa", "musique", "bamboogle", "gaia", "hle",
               "webwalker", "webwalkerqa", "xbench", "xbench-deepsearch", "frames", "simpleqa", "nq",
               "triviaqa", "popqa", "simpledeepsearch", "webdancer", "hard_search", "deep_research")

DATA_SOURCE_SCORERS: dict[str, str] = {
    **{name: "math" for name in _MATH_SOURCES},
    **{name: "deep_research" for name in _QA_SOURCES},
    "openai/gsm8k": "gsm8k",
    "lighteval/math": "math",
    "digitallearninggmbh/math-lighteval": "math",
}

DATA_SOURCE_PREFIXES: dict[str, str] = {
    "numina_": "math",
    "arpo_toy_math": "math",
    "arpo_toy_gsm8k": "gsm8k",
    "arpo_toy_": "qa_f1",  # bundled lookup / two-step tasks: deep_research without the tool bonus
}


def register_data_source(name: str, scorer: "str | Callable[..., Any]", prefix: bool = False) -> None:
    """Map a data source name (or name prefix) to a scorer key or a compute_score function."""
    if callable(scorer):
        key = f"custom:{name}"
        SCORERS[key] = scorer
        scorer = key
    if scorer not in SCORERS:
        raise ValueError(f"unknown scorer {scorer!r}; known: {sorted(SCORERS)}")
    (DATA_SOURCE_PREFIXES if prefix else DATA_SOURCE_SCORERS)[name.lower()] = scorer


def get_scorer(data_source: Any) -> Callable[..., Any]:
    """The compute_score function for a data source (ValueError naming the fix if unknown)."""
    name = sanitize_text(data_source).strip().lower()
    key = DATA_SOURCE_SCORERS.get(name)
    if key is None:
        prefixes = [p for p in DATA_SOURCE_PREFIXES if name.startswith(p)]
        if prefixes:
            key = DATA_SOURCE_PREFIXES[max(prefixes, key=len)]
    if key is None:
        raise ValueError(
            f"No built-in reward function for data_source={data_source!r}. Known sources: "
            f"{sorted(DATA_SOURCE_SCORERS)}; prefixes: {sorted(DATA_SOURCE_PREFIXES)}. Fix: set "
            "custom_reward_function.path=<file.py> and custom_reward_function.name=<function> to "
            "a compute_score(data_source, solution_str, ground_truth, extra_info=None), or call "
            "verl_arpo.utils.reward_score.register_data_source(name, 'math'|'gsm8k'|'deep_research'|'qa_f1')."
        )
    return SCORERS[key]


def default_compute_score(data_source: Any, solution_str: Any, ground_truth: Any,
                          extra_info: Any = None, **kwargs: Any) -> Any:
    """Score one response with the built-in scorer for `data_source` (see module docstring)."""
    return get_scorer(data_source)(data_source, solution_str, ground_truth, extra_info, **kwargs)
