"""docs/multinode.md says only true things, cheaply (default suite: no root, no cluster).

Every ```bash command of the page is recognised and checked: ``ray start`` flags exist in this Ray,
``main_ppo`` / launch-script overrides compose into a valid config, the search-cache CLI runs on
temporary files, ``scripts/test.sh`` knows ``--multinode``; every override shown inline composes;
links and anchors resolve; the messages the page quotes are the ones the code prints. What the
commands *do* on a cluster is tested by test_two_hosts.py.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "multinode.md"
TEXT = DOC.read_text(encoding="utf-8")
PLACEHOLDERS = {"HEAD_IP": "10.0.0.1", "THIS_NODE_IP": "10.0.0.2"}


def _bash_commands() -> list[str]:
    commands, block, pending = [], None, ""
    for line in TEXT.splitlines():
        stripped = line.strip()
        if block is None and stripped.startswith("```"):
            block = stripped[3:].strip()
        elif block is not None and stripped == "```":
            block = None
        elif block == "bash":
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            full, pending = (pending + stripped).strip(), ""
            if full and not full.startswith("#"):
                commands.append(full)
    return commands


def _words(command: str) -> list[str]:
    command = command.replace("<your overrides>", "")
    for name, value in PLACEHOLDERS.items():
        command = command.replace(f"<{name}>", value)
    assert "<" not in command, f"unknown placeholder in: {command}"
    return shlex.split(command, comments=True)


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def ray_start_help() -> str:
    ray = Path(sys.executable).with_name("ray")
    if not ray.exists():
        pytest.skip("no ray executable beside this python")
    return subprocess.run([str(ray), "start", "--help"], capture_output=True, text=True, timeout=120).stdout


COMMANDS = _bash_commands()


def test_the_page_has_the_commands_it_should():
    kinds = {w for c in COMMANDS for w in _words(c)[:3]}
    assert {"ray", "export", "python", "bash"} <= kinds, kinds
    assert len(COMMANDS) >= 8


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command(command, ray_start_help, tmp_path):
    words = _words(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0] == "export":
        names = {w.split("=", 1)[0] for w in words[1:]}
        assert names <= {"RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE"}, names
    elif words[:2] == ["ray", "start"]:
        for flag in (w.split("=", 1)[0] for w in words[2:] if w.startswith("--")):
            assert flag in ray_start_help, f"`ray start` has no {flag}"
    elif words[:3] == ["python", "-m", "verl_arpo.trainer.main_ppo"]:
        cfg = _compose(words[3:])
        assert int(cfg.trainer.nnodes) == 2 and str(cfg.ray_init.address) == "10.0.0.1:6379"
    elif words[0] == "bash" and words[1].startswith("scripts/ARPO"):
        script = (ROOT / words[1]).read_text()
        assert 'NNODES="${NNODES:-' in script and "trainer.nnodes=${NNODES}" in script and '"$@"' in script
        assert env == {"NNODES": "2"}
        assert str(_compose(words[2:]).ray_init.address) == "auto"
    elif words[:2] == ["bash", "scripts/test.sh"]:
        assert words[2] == "--multinode"
        assert "--multinode) RUN_MULTINODE=1" in (ROOT / "scripts/test.sh").read_text()
        assert "multinode:" in (ROOT / "pytest.ini").read_text()
        assert words[3:] in ([], ["--", "-m", "multinode"])
    elif words[:3] == ["python", "-m", "verl_arpo.workers.rollout.tools.cache"]:
        db = tmp_path / "local" / "search_cache.sqlite"
        db.parent.mkdir()
        json_file = tmp_path / Path(words[5]).name
        if words[3] == "import":
            json_file.write_text('{"a query": "a result"}')
        r = subprocess.run([sys.executable, "-m", "verl_arpo.workers.rollout.tools.cache", words[3], str(db),
                            str(json_file)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert json_file.exists()
    else:
        raise AssertionError(f"a command this test does not know how to check: {command}")


def test_inline_overrides_compose():
    shown = re.findall(r"`(\+?[a-z_]+(?:\.[A-Za-z_]+)+=[^`\s]+)`", TEXT)
    assert "+ray_init.runtime_env.env_vars.GLOO_SOCKET_IFNAME=eth1" in shown
    cfg = _compose([s.replace("<your overrides>", "") for s in shown])
    assert cfg.ray_init.runtime_env.env_vars.GLOO_SOCKET_IFNAME == "eth1"
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node", "ray_init.address", "trainer.resume_mode",
                "trainer.save_freq", "trainer.default_local_dir", "trainer.rollout_data_dir",
                "actor_rollout_ref.rollout.tools.tool_instances.search.params.cache_file"):
        assert f"`{key}" in TEXT
        node = cfg
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_links_and_anchors_resolve():
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", TEXT, flags=re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", TEXT):
        if target.startswith("#"):
            assert target[1:] in headings, target
        elif not target.startswith("http"):
            assert (DOC.parent / target).exists(), target


def test_quoted_messages_are_the_code_s():
    trainer = (ROOT / "verl_arpo/trainer/ppo/ray_trainer.py").read_text()
    group = (ROOT / "verl_arpo/single_controller/ray/base.py").read_text()
    assert "[verl_arpo] worker ranks on nodes: " in trainer and "GLOO_SOCKET_IFNAME=" in trainer
    assert "training stopped at step {self.global_steps}; last complete" in trainer
    assert "restart with trainer.resume_mode=auto to continue" in trainer
    assert "of group {self.name_prefix!r} died during {what}: " in group
    assert "self.peer_failure_grace = 10.0" in group
    for quoted in ("[verl_arpo] worker ranks on nodes: rank 0 on", "died during",
                   "training stopped at step 3; last complete checkpoint",
                   "restart with trainer.resume_mode=auto to continue", "peer_failure_grace` (10 s)"):
        assert quoted in TEXT, quoted
