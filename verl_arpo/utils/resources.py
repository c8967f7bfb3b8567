"""The files the package ships besides code: Hydra configs, the bundled task, the local corpus.

From a checkout they are the repository's own folders (`configs/`, `rl_datasets/`,
`search_cache/`); from an installed wheel they are package data under `verl_arpo/_bundled/`.
setup.py maps those same folders into the wheel, so the two are the same files (a test builds the
wheel and compares them byte by byte). A relative path in a config (`rl_datasets/train.parquet`,
`configs/tools/python_search_local.yaml`) is looked up in the working directory first, then here.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root (holds configs/ and verl_arpo/) when running from a checkout."""
BUNDLED_ROOT = Path(__file__).resolve().parents[1] / "_bundled"
"""Where a wheel install keeps configs/, rl_datasets/ and search_cache/."""
BUNDLED_DIRS = ("configs", "rl_datasets", "search_cache")


def bundled_root() -> Path:
    """The folder holding configs/, rl_datasets/ and search_cache/: the checkout, else the package."""
    if (REPO_ROOT / "configs" / "ppo_trainer.yaml").is_file():
        return REPO_ROOT
    return BUNDLED_ROOT


def config_dir() -> str:
    """The Hydra config directory (ppo_trainer.yaml and the presets)."""
    return str(bundled_root() / "configs")


def resolve_bundled(path: str | os.PathLike) -> Path:
    """An absolute path: as given, else relative to the cwd if it exists there, else among the
    bundled files if it exists there, else relative to the cwd (the caller reports it missing)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute() or p.exists():
        return p.resolve()
    candidate = bundled_root() / p
    return candidate if candidate.exists() else p.resolve()
