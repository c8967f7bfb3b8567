"""`pip install .` (a wheel, not editable) is enough to train and convert: the Hydra configs, the
bundled task and corpus ship as package data, and the converter is a console script and a module.

The wheel is built from this checkout and installed into a fresh virtualenv whose only other
packages are this environment's dependencies (a .pth line: nothing is downloaded, and the
checkout's editable install is not visible there). Every command runs outside the checkout.
"""
import filecmp
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    dist = base / "dist"
    # without PYTHONPATH throughout: a checkout on it (with the egg-info the build leaves there) would
    # count as installed, and pip would skip the wheel
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                        str(ROOT)], capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheel = next(dist.glob("verl_arpo-*.whl"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=_env())
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=_env()).stdout.strip()
    # this environment's dependencies, as a plain path entry: its .pth files (the editable install
    # of this checkout among them) are not processed there
    Path(site, "deps_from_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return {"venv": venv, "py": py, "site": Path(site), "wheel": wheel}


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def test_the_wheel_carries_configs_data_and_converter_identical_to_the_checkout(fresh_venv, tmp_path):
    r = subprocess.run([str(fresh_venv["py"]), "-c", "import verl_arpo, merge_ckpt; print(verl_arpo.__file__); "
                        "from verl_arpo.utils.resources import config_dir; print(config_dir())"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    module_file, configs = r.stdout.split()
    assert module_file.startswith(str(fresh_venv["site"])), module_file  # the installed copy, not the checkout
    assert configs == str(fresh_venv["site"] / "verl_arpo" / "_bundled" / "configs")
    bundled = fresh_venv["site"] / "verl_arpo" / "_bundled"
    for folder, pattern in (("configs", "*.yaml"), ("configs/tools", "*.yaml"), ("rl_datasets", "*.parquet"),
                            ("rl_datasets", "*.jsonl"), ("search_cache", "local_corpus.jsonl")):
        names = sorted(p.name for p in (ROOT / folder).glob(pattern))
        assert names, folder
        match, mismatch, errors = filecmp.cmpfiles(ROOT / folder, bundled / folder, names, shallow=False)
        assert (mismatch, errors) == ([], []), (folder, mismatch, errors)


def test_the_wheel_declares_its_license_and_metadata(fresh_venv, tmp_path):
    """[issue 33, item 6] Apache-2.0 (as verl and the reference ARPO code), with the license text in the
    wheel, an author, the Python range and classifiers, read back with importlib.metadata."""
    code = ("import importlib.metadata as m, json; d = m.distribution('verl_arpo'); md = d.metadata; "
            "print(json.dumps({'license': md['License'], 'author': md['Author'], 'requires_python': "
            "md['Requires-Python'], 'classifiers': md.get_all('Classifier'), 'files': [str(f) for f in d.files "
            "if 'licenses' in str(f)]}))")
    r = subprocess.run([str(fresh_venv["py"]), "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    meta = json.loads(r.stdout)
    assert meta["license"] == "Apache-2.0" and meta["author"]
    assert meta["requires_python"] == ">=3.10"
    assert "Programming Language :: Python :: 3.11" in meta["classifiers"]
    shipped = next(f for f in meta["files"] if f.endswith("licenses/LICENSE"))
    text = (fresh_venv["site"] / shipped).read_text()
    assert text == (ROOT / "LICENSE").read_text() and "Apache License" in text and "Version 2.0" in text


def test_train_two_steps_and_convert_from_the_installed_package(fresh_venv, tiny_model_dir, tmp_path):
    venv, py = fresh_venv["venv"], fresh_venv["py"]
    run = subprocess.run(
        [str(py), "-m", "verl_arpo.trainer.main_ppo", "--config-name=cpu_tiny",
         f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.total_training_steps=2", "trainer.save_freq=2",
         "data.max_prompt_length=384", "trainer.val_before_train=false", "trainer.test_freq=-1",
         "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
         f"actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file={tmp_path / 'search.sqlite'}"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "step 2/2" in run.stdout
    ckpt = tmp_path / "ckpt"
    for cmd in ([str(venv / "bin" / "verl-arpo-merge")], [str(py), "-m", "merge_ckpt.convert_verl_to_hf"]):
        out = tmp_path / f"hf_{len(cmd)}"
        r = subprocess.run([*cmd, "--verl_checkpoint", str(ckpt), "--output_dir", str(out)], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))


@pytest.mark.slow
def test_the_quickstart_runs_from_the_installed_package(fresh_venv, tmp_path):
    """[issue 33, item 5] `python -m verl_arpo.quickstart` from a wheel install: the packaged task and
    corpus, everything written under the current directory, nothing under site-packages."""
    site = fresh_venv["site"]
    before = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    env = {**_env(), "VERL_ARPO_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([str(fresh_venv["py"]), "-m", "verl_arpo.quickstart", "--tiny", "--smoke"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "outputs" / "quickstart"
    summary = json.loads((out / "summary.json").read_text())
    from verl_arpo.quickstart import SMOKE

    assert summary["test"]["n"] == SMOKE["questions"]   # the smoke's questions (6 since its small shape, not 30)
    assert (out / "rl_model_hf" / "config.json").is_file() and (out / "reward_curve.png").is_file()
    after = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    assert after == before, sorted(str(p) for p in after ^ before)[:10]
