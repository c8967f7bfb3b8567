"""scripts/setup_env.sh from nothing: a new virtualenv gets the pinned CPU torch and the rest from uv
(handed pip's find-links, where the local CPU wheel lies), and when uv cannot reach its index the same
command falls back to pip and still succeeds.

The two that build a real virtualenv in a temporary folder (about 1.5 and 3 minutes on 2 cores) are
`slow`; CI's own `scripts/test.sh` runs the uv path from a bare machine every time.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup(venv: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VERL_ARPO_VENV=str(venv), **env_extra)
    return subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/setup_env.sh; setup_env"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)


def _installed(venv: Path, tmp_path: Path) -> dict:
    """What the new environment imports, run outside the checkout (so the editable install is what finds it)."""
    code = ("import torch, verl_arpo, transformers, ray, hydra, tensordict, gguf, json, importlib.metadata as m; "
            "print(json.dumps({'torch': torch.__version__, 'verl_arpo': verl_arpo.__file__, "
            "'uv': [d.metadata['Name'] for d in m.distributions()].count('uv')}))")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_new_environment_from_uv_keeps_the_pinned_cpu_torch_and_a_second_call_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    r = _setup(venv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(uv;" in r.stderr and "pip instead" not in r.stderr, r.stderr[-3000:]
    got = _installed(venv, tmp_path)
    assert got["torch"] == "2.13.0+cpu"            # the pin, not a CUDA build uv would fetch from PyPI
    assert got["verl_arpo"] == str(ROOT / "verl_arpo" / "__init__.py")   # editable: the checkout itself
    assert got["uv"] == 1
    stamp = (venv / ".verl_arpo_stamp").read_text().strip()
    r2 = _setup(venv)
    assert r2.returncode == 0 and "installing" not in r2.stderr, r2.stderr[-3000:]
    assert (venv / ".verl_arpo_stamp").read_text().strip() == stamp


@pytest.mark.slow
def test_when_uv_cannot_reach_its_index_pip_installs_instead(tmp_path):
    venv = tmp_path / "venv"
    # a closed port on this machine: uv's resolution fails, as behind a proxy it cannot pass
    r = _setup(venv, UV_INDEX_URL="http://127.0.0.1:9/simple")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "uv could not install -e" in r.stderr, r.stderr[-3000:]
    got = _installed(venv, tmp_path)
    assert got["torch"] == "2.13.0+cpu"
    assert got["verl_arpo"] == str(ROOT / "verl_arpo" / "__init__.py")


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A new virtualenv with only the pip it comes with (pip 23 here), as setup_env has it when it asks pip."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    return venv


@pytest.mark.parametrize("where", ["environment", "pip.conf", "nowhere"])
def test_uv_is_handed_the_find_links_pip_would_use(tmp_path, bare_venv, where):
    """uv reads no pip configuration: setup_env passes it pip's find-links, from PIP_FIND_LINKS or else
    from pip's own configuration files, so that it finds the same local torch wheel that pip would."""
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PYTHONPATH", "VIRTUAL_ENV")}
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\n" + ("find-links = /wheels/a /wheels/b\n" if where == "pip.conf" else ""))
    env.update(VERL_ARPO_VENV=str(bare_venv), PIP_CONFIG_FILE=str(conf))
    if where == "environment":
        env["PIP_FIND_LINKS"] = "/wheels/env file:///wheels/two"
    r = subprocess.run(["bash", "-c", "set -euo pipefail; source scripts/setup_env.sh; _pip_find_links"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    want = {"environment": ["/wheels/env", "file:///wheels/two"], "pip.conf": ["/wheels/a", "/wheels/b"]}
    if where == "nowhere" and "find-links" in subprocess.run(
            [str(bare_venv / "bin" / "python"), "-m", "pip", "config", "list"], env=env,
            capture_output=True, text=True).stdout:
        pytest.skip("this machine's own pip configuration sets find-links")
    assert r.stdout.split() == want.get(where, [])


def test_an_unknown_installer_is_refused_by_name_before_anything_is_made(tmp_path):
    venv = tmp_path / "venv"
    r = _setup(venv, VERL_ARPO_INSTALLER="conda")
    assert r.returncode != 0
    assert "VERL_ARPO_INSTALLER=conda: set it to uv or pip" in r.stderr, r.stderr[-2000:]
    assert not venv.exists()


def _compile(venv: Path, stamp: str, dont_write: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VERL_ARPO_VENV=str(venv), **({"PYTHONDONTWRITEBYTECODE": "1"} if dont_write else {}))
    r = subprocess.run(["bash", "-c", f"set -euo pipefail; source scripts/setup_env.sh; _compile_bytecode {stamp}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_bytecode_is_compiled_once_per_install_only_where_python_would_not_write_it(bare_venv):
    """With PYTHONDONTWRITEBYTECODE set, every process would compile the environment's sources again:
    setup_env compiles them once per install (the stamp). Without it, Python writes on first import."""
    site = Path(subprocess.run([str(bare_venv / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())

    def probe(name: str) -> Path:
        (site / f"{name}.py").write_text("VALUE = 1\n")
        return site / "__pycache__" / f"{name}.cpython-{sys.version_info.major}{sys.version_info.minor}.pyc"

    unset = probe("verl_arpo_probe_unset")
    _compile(bare_venv, "stamp1", dont_write=False)
    assert not unset.exists() and not (bare_venv / ".verl_arpo_bytecode").exists()

    first = probe("verl_arpo_probe_first")
    _compile(bare_venv, "stamp1", dont_write=True)
    assert first.exists() and (bare_venv / ".verl_arpo_bytecode").read_text().strip() == "stamp1"

    later = probe("verl_arpo_probe_later")  # the same install: nothing is compiled again
    _compile(bare_venv, "stamp1", dont_write=True)
    assert not later.exists()
    _compile(bare_venv, "stamp2", dont_write=True)  # a new install (new stamp) is compiled
    assert later.exists() and (bare_venv / ".verl_arpo_bytecode").read_text().strip() == "stamp2"
