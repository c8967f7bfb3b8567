"""Loading a user's reward function from a file, and scoring a list of samples (torch-free).

`load_custom_reward_function(path, name)` implements verl's `custom_reward_function.{path,name}`:
it imports the file as a module and returns its function `name`, wrapped in a
`CustomRewardFunction` that pickles as "(path, name, kwargs)". A process that unpickles it (a
`ProcessPoolExecutor` worker started with spawn or forkserver) loads the file itself, once per
process, so user functions work in parallel scoring although their module is not importable by
name. Wrong path / name fail fast with a message that names the config key to fix.

`score_items` is the worker body of the reward manager: it lives here, not in
`reward_manager.py`, so that worker processes never import torch.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from typing import Any, NamedTuple
from collections.abc import Callable, Iterable

__all__ = ["load_custom_reward_function", "CustomRewardFunction", "score_items", "ScoringFailure"]

_CACHE: dict[tuple[str, str, float], Callable[..., Any]] = {}


class CustomRewardFunction:
    """A user's compute_score loaded from `path`; picklable by reference to the file."""

    def __init__(self, path: str, name: str, fn: Callable[..., Any],
                 reward_kwargs: dict[str, Any] | None = None):
        self.path, self.name, self.fn = path, name, fn
        self.reward_kwargs = dict(reward_kwargs or {})
        self.__name__ = name
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **{**self.reward_kwargs, **kwargs})

    def __reduce__(self):
        return (load_custom_reward_function, (self.path, self.name, self.reward_kwargs))

    def __repr__(self) -> str:
        return f"CustomRewardFunction(path={self.path!r}, name={self.name!r})"


def load_custom_reward_function(path: Any, name: Any = "compute_score",
                                reward_kwargs: dict[str, Any] | None = None) -> CustomRewardFunction:
    """Import `path` and return its callable `name` (see module docstring).

    Raises ValueError (empty path/name, not a .py file), FileNotFoundError (no such file),
    ImportError (the file fails to import), AttributeError (no such name, listing the callables
    the file defines) or TypeError (the name is not callable).
    """
    if not path:
        raise ValueError("custom_reward_function.path is empty: give the path of a Python file")
    if not name:
        raise ValueError("custom_reward_function.name is empty: give the function's name, e.g. compute_score")
    path, name = os.path.abspath(os.path.expanduser(str(path))), str(name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r}: no such file")
    if not path.endswith(".py"):
        raise ValueError(f"custom_reward_function.path={path!r} must be a Python (.py) file")
    key = (path, name, os.path.getmtime(path))
    fn = _CACHE.get(key)
    if fn is None:
        module_name = "verl_arpo_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        # [reliability: tests/reliability/README.md] SystemExit too: a file calling sys.exit() at import ended
        # validate_config (and the run) with that exit code and no message naming the file
        except (Exception, SystemExit) as exc:
            raise ImportError(
                f"custom_reward_function.path={path!r} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        sys.modules[module_name] = module
        if not hasattr(module, name):
            found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
            raise AttributeError(
                f"custom_reward_function.name={name!r} not found in {path}; callables there: {found}"
            )
        fn = getattr(module, name)
        if not callable(fn):
            raise TypeError(
                f"custom_reward_function.name={name!r} in {path} is a {type(fn).__name__}, not a function"
            )
        _CACHE[key] = fn
    return CustomRewardFunction(path, name, fn, reward_kwargs)


class ScoringFailure(NamedTuple):
    """What `score_items(..., tolerate=True)` returns for a sample whose scorer raised."""

    index: int
    data_source: str
    error: str


def score_items(compute_score: Callable[..., Any], items: Iterable[tuple[int, Any, str, Any, Any]],
                tolerate: bool = False) -> list[Any]:
    """Call `compute_score(data_source=, solution_str=, ground_truth=, extra_info=)` per item.

    `items` are (index, data_source, solution_str, ground_truth, extra_info). An exception from
    the scorer propagates unchanged, with a note naming the sample index and data source; with
    `tolerate` that sample's result is a `ScoringFailure` instead (the reward manager scores it 0
    and counts it).
    """
    results = []
    for index, data_source, solution_str, ground_truth, extra_info in items:
        try:
            results.append(compute_score(data_source=data_source, solution_str=solution_str,
                                         ground_truth=ground_truth, extra_info=extra_info))
        except Exception as exc:
            if tolerate:
                results.append(ScoringFailure(int(index), str(data_source), f"{type(exc).__name__}: {exc}"[:500]))
                continue
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"while scoring sample {index} (data_source={data_source!r})")
            raise
    return results


class TolerantScore:
    """A scorer for evaluation (main_eval): an exception scores that sample 0 with a warning, as a
    failed scoring, instead of ending the evaluation. Picklable when the wrapped scorer is, so it
    runs in the reward manager's killable worker processes."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, **kwargs: Any) -> Any:
        try:
            return self.fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - one failing sample must not end the evaluation
            logging.getLogger("verl_arpo.eval").warning("reward function failed on %s: %s",
                                                        kwargs.get("data_source"), exc)
            return {"score": 0.0, "reason": f"error: {type(exc).__name__}"}

