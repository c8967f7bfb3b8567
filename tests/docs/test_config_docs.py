"""docs/configuration.md is generated from the Hydra configs (scripts/gen_config_docs.py): every key
must carry a description comment, and the committed page must equal the generator's output."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DOCUMENTED = ["ppo_trainer.yaml", "ppo_trainer_dr.yaml", "quickstart.yaml", "cpu_tiny.yaml"]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


gen = _generator()


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_key_has_a_description_comment(name):
    missing = gen.missing_comments(CONFIGS / name)
    assert not missing, ("keys without a trailing `# description` (docs/configuration.md is generated from "
                         "them):\n  " + "\n  ".join(missing))


def test_the_generator_documents_exactly_the_files_tested_here():
    assert [gen.BASE, *gen.PRESETS] == DOCUMENTED


def test_missing_comment_is_detected_and_reported_with_its_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults:\n  - base  # the base\n  - _self_\nsection:\n  good: 1   # a described key\n"
                   "  nested:\n    url: 'http://x#y'\n    empty: {}  # fine\n")
    assert gen.missing_comments(bad) == ["bad.yaml:3: defaults[1]", "bad.yaml:7: section.nested.url"]


def test_line_reader_agrees_with_yaml_on_every_config():
    for path in sorted(CONFIGS.glob("*.yaml")):
        leaves = {e.key for e in gen.load(path) if e.leaf}  # load() raises when the key sets differ
        assert leaves == gen._flatten(yaml.safe_load(path.read_text()))


def test_line_reader_refuses_what_it_cannot_read(tmp_path):
    odd = tmp_path / "odd.yaml"
    odd.write_text("a: 1  # one\n? complex key\n: 2\n")
    with pytest.raises(ValueError, match="odd.yaml:2"):
        gen.load(odd)


def test_page_lists_every_key_with_its_default_and_comment():
    page = (ROOT / "docs" / "configuration.md").read_text()
    for name in DOCUMENTED:
        for e in gen.load(CONFIGS / name):
            if e.leaf and not e.key.startswith("defaults["):
                assert f"| `{e.key}` | `{e.value.replace('|', chr(92) + '|')}` |" in page, (name, e.key)
                assert gen._cell(e.comment) in page, (name, e.key)


def test_generated_page_is_up_to_date():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\nrun: python scripts/gen_config_docs.py"


def test_check_mode_fails_on_a_stale_page(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("prompts per training step", "prompts per step (old text)", 1))
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert gen.main(["--check", "--output", str(tmp_path / "absent.md")]) == 1
    assert gen.main(["--output", str(stale)]) == 0 and gen.main(["--check", "--output", str(stale)]) == 0
