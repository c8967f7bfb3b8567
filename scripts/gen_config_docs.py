#!/usr/bin/env python3
"""Generate docs/configuration.md from the Hydra configs, so the reference cannot drift from them.

    python scripts/gen_config_docs.py            # (re)write docs/configuration.md
    python scripts/gen_config_docs.py --check    # exit 1 when docs/configuration.md is stale

Source of truth: the trailing `# comment` of every key in configs/ppo_trainer.yaml (the defaults)
and in the presets ppo_trainer_dr.yaml, quickstart.yaml and cpu_tiny.yaml (their overrides). A key
without a comment is an error (exit 2, naming file and line): every key must say what it means.

The YAML is read twice: line by line (for the comments and the values exactly as written, e.g.
`1e-6`, `${data.max_prompt_length}`, `???`) and with yaml.safe_load; the two key sets must agree,
so a construct the line reader does not understand fails loudly instead of dropping a key.

Not covered: the keys of configs/tools/*.yaml (tool registry presets, documented in docs/tools.md;
only the first sentence of each file's header is listed) and the SFT trainer's keys
(`python -m verl_arpo.trainer.main_sft --help` prints them).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
OUTPUT = ROOT / "docs" / "configuration.md"
BASE = "ppo_trainer.yaml"
PRESETS = ("ppo_trainer_dr.yaml", "quickstart.yaml", "cpu_tiny.yaml")
SPLIT_SECTIONS = ("actor_rollout_ref",)
"""Top-level sections documented per child (model / actor / ref / rollout) instead of as one table."""

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w.@-]*|\"[^\"]*\"|'[^']*'):(?P<rest>(\s.*)?)$")
_LIST_LINE = re.compile(r"^(?P<indent> *)- (?P<rest>.*)$")


@dataclass
class Entry:
    """One key (or list item) of a YAML file, with its value as written and its comment."""

    key: str  # dotted path; list items as `defaults[0]`
    value: str  # the value text as written ("" for a mapping header)
    comment: str  # the trailing comment without '#', stripped ("" when none)
    line: int  # 1-based line number
    leaf: bool  # False for a mapping header (`data:`)


def split_comment(text: str) -> tuple[str, str]:
    """('value', 'comment') of the text after `key:`; a `#` inside quotes is not a comment."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].strip(), text[i + 1:].strip()
    return text.strip(), ""


def parse_entries(path: Path) -> list[Entry]:
    """Every key and list item of a block-style YAML file, in file order, with its comment."""
    entries: list[Entry] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    list_counts: dict[str, int] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for no, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if "\t" in line[: len(line) - len(line.lstrip())]:
            raise ValueError(f"{path.name}:{no}: tab indentation is not supported")
        m = _LIST_LINE.match(line)
        if m:
            indent = len(m.group("indent"))
            while stack and stack[-1][0] > indent:  # `- item` may sit at its key's own indent
                stack.pop()
            parent = ".".join(k for _, k in stack)
            idx = list_counts.get(parent, 0)
            list_counts[parent] = idx + 1
            value, comment = split_comment(m.group("rest"))
            entries.append(Entry(f"{parent}[{idx}]", value, comment, no, True))
            continue
        m = _KEY_LINE.match(line)
        if not m:
            raise ValueError(f"{path.name}:{no}: cannot read this line: {line.strip()!r}")
        indent = len(m.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = m.group("key").strip("\"'")
        dotted = ".".join([k for _, k in stack] + [key])
        value, comment = split_comment(m.group("rest") or "")
        leaf = value != ""
        entries.append(Entry(dotted, value, comment, no, leaf))
        if not leaf:
            stack.append((indent, key))
    return entries


def _flatten(node, prefix: str = "") -> set[str]:
    """Leaf paths of a loaded YAML document (empty mappings and all lists count as leaves)."""
    if isinstance(node, dict) and node:
        out: set[str] = set()
        for k, v in node.items():
            out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(node, list) and prefix == "defaults":
        return {f"defaults[{i}]" for i in range(len(node))}
    return {prefix}


def load(path: Path) -> list[Entry]:
    """parse_entries, checked against yaml.safe_load (same leaf keys)."""
    entries = parse_entries(path)
    ours = {e.key for e in entries if e.leaf}
    theirs = _flatten(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    if ours != theirs:
        raise ValueError(f"{path.name}: the line reader and yaml.safe_load disagree: only ours "
                         f"{sorted(ours - theirs)}, only yaml {sorted(theirs - ours)}")
    return entries


def missing_comments(path: Path) -> list[str]:
    """`file:line: key` for every key or list item with a value but no description comment."""
    return [f"{path.name}:{e.line}: {e.key}" for e in load(path) if e.leaf and not e.comment]


def header_comment(path: Path) -> list[str]:
    """The comment lines at the top of a file, without the '#'."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        out.append(line[1:].strip() if line.startswith("# ") or line == "#" else line[1:])
    return out


# ------------------------------------------------------------------------------------------ rendering
def _cell(text: str) -> str:
    """Markdown table cell text: no HTML tags, no column breaks."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`" if text else ""


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", title.lower()).replace(" ", "-")


def _section_of(key: str) -> str:
    parts = key.split(".")
    if parts[0] in SPLIT_SECTIONS and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0]


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


INTRO = """\
# Configuration reference

<!-- Generated by scripts/gen_config_docs.py from configs/*.yaml. Do not edit by hand:
     change the comment in the YAML file and run `python scripts/gen_config_docs.py`. -->

Every key of the trainer config, its default and what it means, generated from the trailing
comment each key carries in [`configs/ppo_trainer.yaml`](../configs/ppo_trainer.yaml); then the
values the presets change. The entry point is `python -m verl_arpo.trainer.main_ppo`; a key is
set on its command line as `dotted.key=value` (Hydra syntax, as in verl and the ARPO scripts):

```bash
python -m verl_arpo.trainer.main_ppo --config-name=cpu_tiny actor_rollout_ref.model.path=<hf_model_dir> \\
    actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.initial_rollouts=4 data.train_batch_size=4 --cfg job
```

- `--config-name=ppo_trainer_dr | quickstart | cpu_tiny` picks a preset (default: `ppo_trainer`);
  `--config-path=<dir>` another config folder.
- `--cfg job` prints the composed config and runs nothing; a real run prints it (secrets masked)
  and validates it before Ray starts, naming every bad key at once.
- An unknown key is an error naming it (the config is in struct mode, and the trainer builds the
  typed config of `verl_arpo/config/` from it). Only the free-form maps take new keys
  with `+` (`++` sets a key whether or not it exists): tool `params`, `ray_init.runtime_env`,
  `model.override_config`, `custom_reward_function.reward_kwargs`.
- `???` marks a required value, `${a.b}` copies another key, `null` is Python's None.
- Lists: `trainer.logger=[console,wandb]` (the quoted string `"[console, wandb]"` of the ARPO
  scripts also works).
- A tool registry YAML from `configs/tools/` merges over the rollout's tools as a group:
  `+tools@actor_rollout_ref.rollout=python_bing` (see [tools.md](tools.md)).

### How a value is checked

Right after Hydra composes, the tree becomes the typed `JobConfig`, one frozen dataclass per section
(`verl_arpo/config/`). Every value is checked against its field's type, then against the
value rules of its section, then against the rules across sections (batch sizes against the worker
count, token budgets against the lengths, the critic under `gae`); every problem is reported at once.

| field type | accepted |
|---|---|
| integer | an integer, or a string of digits (what `${oc.env:VAR}` gives); not `true`, not `2.0` |
| number | a number or a numeric string; not `true`, not `nan` |
| boolean | `true`/`false`, or those words as strings |
| string | a string; a number is taken as its text (`experiment_name=2024`) |
| a choice | one of the values listed in its error (`unknown 'x'; accepted: [...]`) |
| a section | a mapping; `null` gives every default |

A required value left as `???` (or an interpolation to one) is reported by the rule that needs it;
an interpolation that does not resolve is reported naming its key. A section with a type problem
skips its value rules until the type is fixed, so one mistake gives one message.

Adding a key: add it to the YAML (with its comment) and to its section's dataclass in
`verl_arpo/config/` (a rule on it goes in that section's `problems()`), then regenerate
this page. Nothing else holds a default.

Regenerate this page after changing a config, and check that it is current (the test suite does):

```bash
python scripts/gen_config_docs.py
python scripts/gen_config_docs.py --check
```
"""


def render() -> str:
    """The whole of docs/configuration.md."""
    base_path = CONFIGS / BASE
    base = load(base_path)
    problems = [p for name in (BASE, *PRESETS) for p in missing_comments(CONFIGS / name)]
    if problems:
        raise ValueError("keys without a description comment:\n  " + "\n  ".join(problems))
    base_values = {e.key: e.value for e in base if e.leaf}

    sections: dict[str, list[Entry]] = {}
    for e in base:
        if e.leaf or e.comment:  # mapping headers appear only when they carry a comment
            sections.setdefault(_section_of(e.key), []).append(e)

    preset_titles = [f"Preset {name}" for name in PRESETS]
    out = [INTRO, "## Contents", ""]
    for title in [*sections, *preset_titles]:
        out.append(f"- [{title}](#{_anchor(title)})")
    out.append(f"- [Tool registry presets](#{_anchor('Tool registry presets')})")
    out.append(f"- [Accepted, not implemented yet](#{_anchor('Accepted, not implemented yet')})")
    out.append("")

    out += [f"## Defaults: {BASE}", ""]
    out += [f"`configs/{BASE}` header:", "", "```text", *header_comment(base_path), "```", ""]
    for title, entries in sections.items():
        out += [f"### {title}", ""]
        rows = [(_code(e.key), _code(e.value) if e.leaf else "(section)", _cell(e.comment)) for e in entries]
        out += _table(rows, ("Key", "Default", "Meaning")) + [""]

    for name, title in zip(PRESETS, preset_titles):
        path = CONFIGS / name
        entries = load(path)
        out += [f"## {title}", ""]
        out += [f"`configs/{name}`: every key not listed here has its `{BASE}` default. Header:", ""]
        out += ["```text", *header_comment(path), "```", ""]
        defaults = [e.value for e in entries if e.key.startswith("defaults[")]
        if defaults:
            out += [f"Composition (`defaults`): {', '.join(_code(d) for d in defaults)}; the values below win.", ""]
        rows = []
        for e in entries:
            if not e.leaf or e.key.startswith("defaults["):
                continue
            default = base_values.get(e.key)
            rows.append((_code(e.key), _code(e.value), _code(default) if default is not None else "(new key)",
                         _cell(e.comment)))
        out += _table(rows, ("Key", "Preset value", f"{BASE} default", "Meaning")) + [""]

    out += ["## Tool registry presets", "",
            "Tool YAML files in the reference's layout (`tools:` with `tool_instances`), merged over the",
            "rollout's tools with `+tools@actor_rollout_ref.rollout=<name>` or loaded by",
            "`python -m verl_arpo.trainer.main_eval --tools configs/tools/<name>.yaml`:", ""]
    rows = []
    for path in sorted((CONFIGS / "tools").glob("*.yaml")):
        text = " ".join(ln.strip() for ln in header_comment(path) if ln.strip())
        first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]  # the first sentence
        rows.append((_code(path.stem), _cell(first)))
    out += _table(rows, ("Name", "What it holds")) + [""]

    from verl_arpo.config import NOT_IMPLEMENTED

    out += ["## Accepted, not implemented yet", "",
            "verl keys that launch scripts carry but no code here reads yet. Their default is accepted;",
            "any other value is a configuration error that names the key and what to use instead",
            "(`verl_arpo.config.NOT_IMPLEMENTED`):", ""]
    out += _table([(_code(k), _code(base_values.get(k, "")), _cell(why)) for k, why in NOT_IMPLEMENTED.items()],
                  ("Key", "Accepted value", "Why, and what to use instead")) + [""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate docs/configuration.md from configs/*.yaml.")
    ap.add_argument("--check", action="store_true", help="exit 1 if the output file is not up to date")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    try:
        text = render()
    except ValueError as exc:
        print(f"gen_config_docs: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
        if current != text:
            print(f"{args.output} is stale: run `python scripts/gen_config_docs.py`", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
