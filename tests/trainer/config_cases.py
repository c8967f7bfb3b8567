"""What the trainer-config tests share (test_config.py, test_config_secrets.py): real files for every
path a config needs, the seeds' command lines, composing a preset, running the entry point, and a
valid CPU config to break one value at a time."""
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl_arpo.trainer.config import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SEEDS = ROOT / "tests" / "fixtures" / "seed_overrides"
SEED_SCRIPTS = ["arpo_7b_reasoning_1node", "aepo_qwen3_14b_deepresearch", "arpo_7b_reasoning_guide"]
ENV = {**os.environ, "HYDRA_FULL_ERROR": "0", "RAY_USAGE_STATS_ENABLED": "0"}
_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# ------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Real files for every path a config needs: model folder, data, reward function, run dir."""
    d = tmp_path_factory.mktemp("cfg")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text("{}")
    for name in ("train.parquet", "valid.parquet", "gaia.parquet", "hle.parquet"):
        (d / name).write_bytes(b"")
    (d / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                 "    return 0.0\n")
    return d


def seed_words(name: str, paths: Path) -> list[str]:
    """The fixture's command-line words after shell expansion, with real temp paths for the placeholders."""
    lines = [ln.strip() for ln in (SEEDS / f"{name}.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    assigns = [ln for ln in lines if _ASSIGN.match(ln)]
    words = [ln for ln in lines if not _ASSIGN.match(ln)]
    ours = {"PARENT_DIR": paths, "CONFIG_PATH": CONFIGS, "ACTOR_MODEL_PATH": paths / "model",
            "TRAIN_FILES": paths / "train.parquet", "VALID_FILES": paths / "valid.parquet",
            "SAVE_PATH": paths / "save", "ROLLOUT_SAVE_PATH": paths / "save" / "rollout",
            "SEARCH_CACHE_PATH": paths / "cache.json", "CUSTOM_REWARD_FUNCTION_PATH": paths / "reward.py"}
    if "gaia" in " ".join(assigns):
        ours["VALID_FILES"] = f"[{paths / 'gaia.parquet'},{paths / 'hle.parquet'}]"
    script = "\n".join(assigns + [f"{k}='{v}'" for k, v in ours.items()] + ["printf '%s\\0' " + " ".join(words)])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def split_cli(words: list[str]) -> tuple[str, list[str]]:
    """(config name, overrides) from --config-path/--config-name + overrides."""
    name, overrides = "ppo_trainer", []
    for w in words:
        if w.startswith("--config-name="):
            name = w.split("=", 1)[1]
        elif not w.startswith("--config-path="):
            overrides.append(w)
    return name, overrides


def compose(name: str = "cpu_tiny", overrides: tuple = ()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return hydra_compose(config_name=name, overrides=list(overrides))


def run_main(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_arpo.trainer.main_ppo", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def good_base(paths):
    return compose("cpu_tiny", (f"actor_rollout_ref.model.path={paths / 'model'}",
                                f"data.train_files={paths / 'train.parquet'}",
                                f"data.val_files={paths / 'valid.parquet'}"))


@pytest.fixture
def good(good_base):
    """A valid CPU config (cpu_tiny preset + temp paths) to break one value at a time."""
    return copy.deepcopy(good_base)


def problems_of(cfg) -> dict:
    with pytest.raises(ConfigError) as info:
        validate_config(cfg)
    return dict(info.value.problems)
