"""Secrets: after a full CPU training run, no file the run wrote contains the search API key.

The run is the real entry point (`python -m verl_arpo.trainer.main_ppo --config-name=cpu_tiny`, its
own Ray cluster) for 2 steps with every logger (console, jsonl, tensorboard, wandb offline),
rollout dumps, a checkpoint per step, `BingSearchTool` pointed at a search API on 127.0.0.1 with
`api_key=sk-test-SECRET-123` on the command line *and* the same key in BRIGHTDATA_API_KEY. The API
answers with results, 429s, and error pages that echo the key back (as some real APIs do). The run's
environment also holds WANDB_API_KEY and HF_TOKEN from the start, and the config passes a
`MY_SERVICE_TOKEN` to the workers through `ray_init.runtime_env.env_vars`: none may be written either.

Everything the run can write is kept in folders the test owns: the run's cwd (checkpoints, logs,
dumps, search cache, Hydra's output dir), HOME (wandb / HF caches), and TMPDIR (Ray's session
folder with every worker's log, the sandbox's scratch space). All of it is grepped byte by byte.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from rel_helpers import FakeSearchAPI

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-SECRET-123"
# secrets every cluster job carries in its environment, and one passed to the workers by the config
ENV_SECRETS = {"WANDB_API_KEY": "wandb-SECRET-0123456789abcdef", "HF_TOKEN": "hf_SECRETtokenXYZ987",
               "MY_SERVICE_TOKEN": "svc-SECRET-4567"}
NEEDLES = [n for v in (KEY, *ENV_SECRETS.values())
           for n in (v.encode(), v.encode("utf-16-le"), v.replace("-", "%2D").encode())]


def _responder(i, headers, body):
    """Results, rate limits, and error pages that echo the caller's Authorization header."""
    auth = headers.get("Authorization", "")
    kind = i % 4  # request 1 is always a 401 echo, whichever call gets it
    if kind == 0:
        return 429, {"error": "slow down"}, {"Retry-After": "0"}
    if kind == 1:
        return 401, f"invalid credentials: {auth}", {}
    if kind == 2:
        return 200, {"organic": [{"description": "Vrorkmere was founded by Ada Quill in 1832."}]}, {}
    return 500, {"error": f"internal error for {auth}"}, {}


def files_containing_secrets(*roots):
    hits = []
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for name in names:
                path = os.path.join(dirpath, name)
                if not os.path.isfile(path) or os.path.islink(path):
                    continue  # sockets, fifos
                try:
                    data = Path(path).read_bytes()
                except OSError:
                    continue
                if any(n in data for n in NEEDLES):
                    hits.append(path)
    return hits


@pytest.fixture
def run_dirs():
    # TMPDIR holds Ray's session folder, whose unix socket paths must stay short: not under tmp_path
    tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    yield Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_no_file_of_a_full_run_holds_the_api_key(tool_model_dir, tmp_path, run_dirs):
    run, home, tmpdir = tmp_path / "run", tmp_path / "home", run_dirs
    run.mkdir()
    home.mkdir()
    from verl_arpo.utils.tiny_model import TOOL_PROMPT_USER

    rows = [{"data_source": "arpo_toy_search", "prompt": [{"role": "user", "content": TOOL_PROMPT_USER}],
             "ability": "qa", "reward_model": {"ground_truth": "408", "style": "rule"},
             "extra_info": {"index": i}} for i in range(4)]
    pd.DataFrame(rows).to_parquet(run / "train.parquet")
    pd.DataFrame(rows[:2]).to_parquet(run / "valid.parquet")
    api = FakeSearchAPI(_responder)
    search = "actor_rollout_ref.rollout.tools.tool_instances.search"
    overrides = [
        f"actor_rollout_ref.model.path={tool_model_dir}", f"data.train_files={run / 'train.parquet'}",
        f"data.val_files={run / 'valid.parquet'}", "data.max_prompt_length=64", "data.max_response_length=64",
        "trainer.default_local_dir=ckpt", "trainer.rollout_data_dir=dumps", "trainer.save_freq=1",
        "trainer.total_training_steps=2", "trainer.logger=[console,jsonl,tensorboard,wandb]",
        "actor_rollout_ref.rollout.tools.verbose_logging=true", "actor_rollout_ref.rollout.tools.retry_count=1",
        f"{search}.class_path=verl_arpo.workers.rollout.tools.search_tool.BingSearchTool",
        f"{search}.params.api_key={KEY}", f"{search}.params.zone=test_zone",
        f"+{search}.params.endpoint={api.url}", f"+{search}.params.http_retries=1",
        f"+{search}.params.retry_backoff=0.01", f"+{search}.params.async_cache_write=true",
        f"{search}.params.cache_file={run / 'cache' / 'search_cache.json'}",
        f"+ray_init.runtime_env.env_vars.MY_SERVICE_TOKEN={ENV_SECRETS['MY_SERVICE_TOKEN']}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    env.update(WANDB_API_KEY=ENV_SECRETS["WANDB_API_KEY"], HF_TOKEN=ENV_SECRETS["HF_TOKEN"])
    env.update(HOME=str(home), TMPDIR=str(tmpdir), WANDB_MODE="offline", BRIGHTDATA_API_KEY=KEY,
               RAY_USAGE_STATS_ENABLED="0", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", NO_PROXY="127.0.0.1,localhost")
    log = run / "console.log"  # what a user tees from the console: part of what the run wrote
    try:
        with open(log, "w") as out:
            proc = subprocess.run([sys.executable, "-m", "verl_arpo.trainer.main_ppo", "--config-name=cpu_tiny",
                                   *overrides], cwd=run, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900)
    finally:
        api.close()
    assert proc.returncode == 0, log.read_text()[-4000:]

    # the run really used the key, and really wrote every kind of file
    assert api.requests and all(r["headers"].get("Authorization") == f"Bearer {KEY}" for r in api.requests)
    assert (run / "ckpt" / "global_step_2").is_dir() and (run / "ckpt" / "global_step_1").is_dir()
    dumps = sorted((run / "dumps").glob("rollout_*.jsonl"))
    assert len(dumps) == 2
    results = [c["result"] for line in dumps[0].read_text().splitlines() + dumps[1].read_text().splitlines()
               for c in json.loads(line)["tool_calls"] if c["tag"] == "search"]
    assert results and any("***" in r for r in results)  # an echoed key reached the model redacted
    assert list((run / "ckpt" / "logs" / "tensorboard").glob("events.out.tfevents.*"))
    assert list((run / "ckpt" / "logs" / "wandb").glob("offline-run-*"))
    assert (run / "ckpt" / "logs" / "metrics.jsonl").is_file()
    hydra_configs = list((run / "outputs").glob("*/*/config.yaml"))
    assert hydra_configs and "api_key: '***'" in hydra_configs[0].read_text()
    assert list((run / "cache").glob("search_cache.sqlite*"))
    assert list(tmpdir.glob("ray/session_*/logs/*worker*"))

    leaks = files_containing_secrets(run, home, tmpdir)
    if os.environ.get("RELIABILITY_KEEP_RUN"):  # debugging a leak: keep the files
        shutil.copytree(tmpdir, run / "tmpdir_copy", symlinks=True, ignore=shutil.ignore_patterns("sockets"))
    assert not leaks, "a secret was written to:\n" + "\n".join(leaks)
