"""Every command shown in docs/*.md works (docs/multinode.md has its own test).

The shell commands of each fenced ```bash block are extracted (continuation lines joined, comments
dropped) and each one is exercised, cheaply:

- run for real, in a temporary working directory: the config doc generator, the search cache CLI
  (on temp files), the rollout tree viewer (on a small synthetic dump), every `--help`;
- training (`main_ppo`, `verl-arpo-train`): the command's own overrides with `--cfg job` (Hydra
  composes and prints the config, nothing runs), in-process through the module's `__main__`; every
  override must show up in the printed config, and the config must pass `validate_config` (an
  uninstalled vLLM is the only tolerated problem); the launch scripts run as subprocesses with
  `--cfg job`;
- SFT, evaluation, checkpoint conversion: the arguments go through the program's own argument /
  config parser, and `--help` works;
- system setup (`apt-get`, `pip`, `export`): the package, extra or variable must be the one the
  code uses.

`<placeholders>` in commands are replaced by temporary paths (PLACEHOLDERS below); an unknown one
fails. ```python blocks are executed (in a temporary working directory), ```yaml and ```json
blocks parsed and checked against the loaders they document, and relative links must resolve.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXCLUDED = {"multinode.md"}  # tested by tests/multinode
DOC_FILES = sorted(p for p in DOCS.glob("*.md") if p.name not in EXCLUDED)
EXPECTED_DOCS = {"algorithms.md", "configuration.md", "migrating.md", "tools.md"}
ENV = {**os.environ, "HYDRA_FULL_ERROR": "0", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
SOURCE_DIRS = ("configs/", "scripts/", "merge_ckpt/", "verl_arpo/", "benchmarks/", "experiments/")
"""A command word starting with one of these names a file of this repository: it must exist."""


# ------------------------------------------------------------------------------------------- extraction
@dataclass
class Command:
    doc: str
    line: int
    text: str
    env: dict = field(default_factory=dict)
    words: list = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def fenced_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, first line number of the content, content) of every ``` block."""
    blocks, lang, start, buf = [], None, 0, []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if lang is None and stripped.startswith("```"):
            lang, start, buf = stripped[3:].strip() or "text", no + 1, []
        elif lang is not None and stripped == "```":
            blocks.append((lang, start, "\n".join(buf)))
            lang = None
        elif lang is not None:
            buf.append(line)
    assert lang is None, f"{path.name}: unclosed ``` block"
    return blocks


def shell_commands(path: Path) -> list[Command]:
    out = []
    for lang, start, text in fenced_blocks(path):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        assert lang == "bash", f"{path.name}:{start}: use ```bash for shell commands"
        lines, pending, first = text.splitlines(), "", None
        for i, line in enumerate(lines):
            if first is None:
                first = start + i
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            full, pending = pending + line, ""
            words = shlex.split(full, comments=True)
            if words:
                out.append(Command(path.name, first, full.strip()))
            first = None
        assert not pending, f"{path.name}: a command ends with a line continuation"
    return out


ALL_COMMANDS = [c for p in DOC_FILES for c in shell_commands(p)]
PY_BLOCKS = [(p.name, s, t) for p in DOC_FILES for lang, s, t in fenced_blocks(p) if lang == "python"]
DATA_BLOCKS = [(p.name, s, lang, t) for p in DOC_FILES for lang, s, t in fenced_blocks(p) if lang in ("yaml", "json")]


# ------------------------------------------------------------------------------------------- placeholders
def _model_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")  # what validate_config looks for
    return d


PLACEHOLDERS = {  # name -> builder(tmp) returning the value that replaces <name>
    "hf_model_dir": lambda t: _model_dir(t / "model"),
    "save_dir": lambda t: t / "save",
    "tools_dir": lambda t: (t / "tools").mkdir(exist_ok=True) or t / "tools",
    "train.parquet": lambda t: (t / "train.parquet").write_bytes(b"") or t / "train.parquet",
    "valid.parquet": lambda t: (t / "valid.parquet").write_bytes(b"") or t / "valid.parquet",
    "corpus.jsonl": lambda t: (t / "corpus.jsonl").write_text('{"id": "1", "title": "A", "text": "b"}\n')
    or t / "corpus.jsonl",
    "sft_train.jsonl": lambda t: (t / "sft.jsonl").write_text("") or t / "sft.jsonl",
    "reference_train.parquet": lambda t: ROOT / "tests" / "fixtures" / "reference_format.parquet",
    "your_key": lambda t: "dummy-key",
    "your_zone": lambda t: "dummy-zone",
    "namespace": lambda t: "local corpus=0123456789abcdef max_results=5 result_length=1000",
}
_PLACEHOLDER = re.compile(r"<([A-Za-z0-9_.\-]+)>")


def substitute(text: str, tmp: Path, strict: bool = True) -> str:
    def repl(m):
        name = m.group(1)
        if name not in PLACEHOLDERS:
            if strict:
                raise AssertionError(f"unknown placeholder <{name}>: add it to PLACEHOLDERS in {__file__}")
            return m.group(0)
        return str(PLACEHOLDERS[name](tmp))

    return _PLACEHOLDER.sub(repl, text)


def prepare(cmd: Command, tmp: Path) -> Command:
    words = [substitute(w, tmp) for w in shlex.split(cmd.text, comments=True)]
    env = {}
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    assert words, f"{cmd.id}: only variable assignments"
    return Command(cmd.doc, cmd.line, cmd.text, env, words)


# ------------------------------------------------------------------------------------------- helpers
def run_module_inprocess(module: str, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """`python -m module argv...` in this process (same code path, no interpreter start-up)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [module, *argv]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "found in sys.modules": we re-run it on purpose
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            err.write(str(exc.code))
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return code, out.getvalue(), err.getvalue()


def run_script_inprocess(script: Path, argv: list[str], cwd: Path) -> tuple[int, str, str]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [str(script), *argv]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return code, out.getvalue(), err.getvalue()


def load_script_module(rel: str):
    name = "doccheck_" + re.sub(r"\W", "_", rel)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def flags_of(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--")]


def check_repo_paths(cmd: Command) -> None:
    for w in cmd.words + list(cmd.env.values()):
        for part in [w, *w.split("=", 1)[1:]]:
            if part.startswith(SOURCE_DIRS):
                assert (ROOT / part).exists(), f"{cmd.id}: {part} does not exist in the repository"


# ------------------------------------------------------------------------------------------- main_ppo
CONFIG_GROUPS = {p.name for p in (ROOT / "configs").iterdir() if p.is_dir()}


def check_main_ppo(cmd: Command, args: list[str], tmp: Path) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from verl_arpo.trainer.config import ConfigError, validate_config

    args = list(args)
    if "--cfg" not in args:
        args += ["--cfg", "job"]  # never train from a doc test
    assert args[args.index("--cfg") + 1] == "job", f"{cmd.id}: only --cfg job is exercised"
    code, out, err = run_module_inprocess("verl_arpo.trainer.main_ppo", args, tmp)
    assert code == 0, f"{cmd.id}: --cfg job failed:\n{err[-3000:]}"
    printed = OmegaConf.create(out)
    overrides = [a for a in args if not a.startswith("--") and a != "job"]
    for ov in OverridesParser.create().parse_overrides(overrides):
        key = ov.key_or_group
        if key.startswith("hydra.") or key in CONFIG_GROUPS or ov.package is not None:
            continue  # Hydra's own settings and config-group merges are not in the job config
        if ov.is_delete():
            assert OmegaConf.select(printed, key, default="<absent>") == "<absent>", f"{cmd.id}: {key} still set"
            continue
        got = OmegaConf.select(printed, key, default="<absent>")
        if isinstance(got, (list, dict)) or OmegaConf.is_config(got):
            got = OmegaConf.to_container(got)
        assert got == ov.value(), f"{cmd.id}: {ov.input_line} printed as {got!r}"
    try:
        validate_config(printed)
    except ConfigError as exc:
        problems = [(k, m) for k, m in exc.problems
                    if not (k == "actor_rollout_ref.rollout.name" and "vllm is not installed" in m)]
        assert not problems, f"{cmd.id}: the documented config does not validate:\n{exc}"


# ------------------------------------------------------------------------------------------- modules
def check_main_eval(cmd: Command, args: list[str], tmp: Path) -> None:
    from verl_arpo.trainer import main_eval

    if "--help" in args or "-h" in args:
        code, out, _ = run_module_inprocess("verl_arpo.trainer.main_eval", args, tmp)
        assert code == 0 and "--model" in out
        return
    try:
        parsed = main_eval.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd.id}: main_eval rejects these arguments: {args}")
    if parsed.tools not in (None, "none"):
        from verl_arpo.workers.rollout.tools import load_tools_config

        assert load_tools_config(ROOT / parsed.tools).tool_instances, f"{cmd.id}: {parsed.tools} has no tools"


def check_main_sft(cmd: Command, args: list[str], tmp: Path) -> None:
    if "--help" in args or "-h" in args:
        code, out, _ = run_module_inprocess("verl_arpo.trainer.main_sft", args, tmp)
        assert code == 0 and "partial_pretrain" in out
        return
    from verl_arpo.trainer import main_sft

    try:
        cfg = main_sft.load_config(args)
    except SystemExit as exc:
        pytest.fail(f"{cmd.id}: main_sft rejects these overrides: {exc}")
    assert cfg.model.partial_pretrain, cmd.id


def check_cache_cli(cmd: Command, args: list[str], tmp: Path) -> None:
    """Run for real in `tmp`; the JSON file an `import` reads is made first."""
    if args and args[0] == "import" and len(args) > 2 and not (tmp / args[2]).exists():
        (tmp / args[2]).parent.mkdir(parents=True, exist_ok=True)
        (tmp / args[2]).write_text(json.dumps({"capital of france": "Page 1: Paris is the capital of France."}))
    code, out, err = run_module_inprocess("verl_arpo.workers.rollout.tools.cache", args, tmp)
    assert code == 0, f"{cmd.id}: {err}"
    assert (tmp / args[1]).exists() or (tmp / args[1]).with_suffix(".sqlite").exists(), cmd.id
    if args[0] == "export":
        assert isinstance(json.loads((tmp / args[2]).read_text()), dict)
    if args[0] == "import":
        assert "imported 1 entries" in out


def check_rollout_tree(cmd: Command, args: list[str], tmp: Path) -> None:
    """Run for real; a missing dump is replaced by a small synthetic one (a root and its branch)."""
    if "--help" not in args and "-h" not in args:
        dump = Path(args[0]) if Path(args[0]).is_absolute() else tmp / args[0]
        if not dump.exists():
            dump.parent.mkdir(parents=True, exist_ok=True)
            base = {"step": 10, "uid": "u0", "prompt": "Q?", "response": "...", "response_mask": [[1, 3]],
                    "num_tool_calls": 1, "finish_reason": "stop", "advantage": 0.5}
            root = {**base, "traj_id": "p0-t0", "parent_id": None, "branch_round": -1, "branch_pos": -1,
                    "round_entropies": [0.4, 0.9], "reward": 1.0,
                    "tool_calls": [{"tag": "search", "content": "q", "result": "r", "seconds": 0.1, "ok": True}]}
            child = {**root, "traj_id": "p0-t1", "parent_id": "p0-t0", "branch_round": 0, "branch_pos": 2,
                     "reward": 0.0}
            dump.write_text("\n".join(json.dumps(r) for r in (root, child)) + "\n")
    code, out, err = run_module_inprocess("verl_arpo.utils.rollout_tree", args, tmp)
    assert code == 0, f"{cmd.id}: {err}"
    if "--help" not in args and "-h" not in args:
        html_out = Path(out.strip().splitlines()[-1])
        html_out = html_out if html_out.is_absolute() else tmp / html_out
        assert "<svg" in html_out.read_text(), cmd.id


def check_help_only(module: str, marker: str):
    """Modules that do real work (model builds, whole pipelines): their flags must be in --help."""

    def check(cmd: Command, args: list[str], tmp: Path) -> None:
        code, out, err = run_module_inprocess(module, ["--help"], tmp)
        assert code == 0 and marker in out, f"{cmd.id}: {module} --help failed: {err}"
        for flag in flags_of(args):
            assert flag in out, f"{cmd.id}: {module} has no option {flag}"

    return check


def check_memory_estimate(cmd: Command, args: list[str], tmp: Path) -> None:
    """Run for real: it only composes the script's config and counts parameters on the meta device."""
    code, out, err = run_module_inprocess("verl_arpo.trainer.memory_estimate", args, ROOT)
    assert code == 0, f"{cmd.id}:\n{out[-2000:]}\n{err[-2000:]}"
    assert "peak:" in out and "| total |" in out, out[-2000:]


MODULE_CHECKS = {
    "merge_ckpt.convert_verl_to_hf": lambda cmd, args, tmp: check_convert(cmd, args, tmp),
    "verl_arpo.trainer.memory_estimate": check_memory_estimate,
    "verl_arpo.trainer.main_ppo": check_main_ppo,
    "verl_arpo.trainer.main_eval": check_main_eval,
    "verl_arpo.trainer.main_sft": check_main_sft,
    "verl_arpo.workers.rollout.tools.cache": check_cache_cli,
    "verl_arpo.utils.rollout_tree": check_rollout_tree,
    "verl_arpo.utils.tiny_model": check_help_only("verl_arpo.utils.tiny_model", "tiny"),
    "verl_arpo.quickstart": check_help_only("verl_arpo.quickstart", "--smoke"),
}


# ------------------------------------------------------------------------------------------- scripts
def check_gen_config_docs(cmd: Command, args: list[str], tmp: Path) -> None:
    script = ROOT / "scripts" / "gen_config_docs.py"
    if "--check" in args:
        code, out, err = run_script_inprocess(script, args, ROOT)
        assert code == 0, f"{cmd.id}: {err}"
    else:  # the writing form, into a temp file: it must produce the committed page
        assert "--output" not in args, cmd.id
        code, _, err = run_script_inprocess(script, [*args, "--output", str(tmp / "configuration.md")], ROOT)
        assert code == 0, f"{cmd.id}: {err}"
        assert (tmp / "configuration.md").read_text() == (DOCS / "configuration.md").read_text(), \
            "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def check_convert(cmd: Command, args: list[str], tmp: Path) -> None:
    conv = load_script_module("merge_ckpt/convert_verl_to_hf.py")
    parser = conv._verl_parser() if args and args[0] in ("merge", "test") else conv._parser()
    if "--help" in args or "-h" in args:
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as info:
            parser.parse_args(args)
        assert info.value.code == 0
        return
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd.id}: convert_verl_to_hf.py rejects {args}")
    if getattr(parsed, "operation", None) is None:
        assert parsed.output_dir or parsed.test_hf_dir, f"{cmd.id}: needs --output_dir or --test_hf_dir"


def check_compare_algorithms(cmd: Command, args: list[str], tmp: Path) -> None:
    """Hours of training: the arguments go through its parser, and its Hydra overrides must compose."""
    mod = load_script_module("experiments/compare_algorithms.py")
    try:
        parsed = mod.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd.id}: compare_algorithms.py rejects {args}")
    assert parsed.algos is None or set(parsed.algos.split(",")) <= set(mod.ARMS), cmd.id


def check_bench_sequence_parallel(cmd: Command, args: list[str], tmp: Path) -> None:
    """Minutes of gloo runs (its --quick run is tests/benchmarks' smoke test): the arguments go through its parser."""
    mod = load_script_module("benchmarks/bench_sequence_parallel.py")
    try:
        mod.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd.id}: bench_sequence_parallel.py rejects {args}")


def check_decision_margins(cmd: Command, args: list[str], tmp: Path) -> None:
    """Needs trained models' reports (its run on a tiny model is tests/experiments/test_decision_margins.py):
    the arguments go through its parser and its checks."""
    mod = load_script_module("experiments/decision_margins.py")
    try:
        mod.parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd.id}: decision_margins.py rejects {args}")


def check_check_lever(cmd: Command, args: list[str], tmp: Path) -> None:
    """Hours of training (its run on the tiny model is tests/experiments/test_check_lever.py): the
    arguments go through its parser, and a lever is named by KEY=VALUE overrides."""
    mod = load_script_module("experiments/check_lever.py")
    try:
        parsed = mod.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{cmd.id}: check_lever.py rejects {args}")
    assert parsed.report or (parsed.overrides and all("=" in o for o in parsed.overrides)), cmd.id


PY_SCRIPT_CHECKS = {
    "experiments/compare_algorithms.py": check_compare_algorithms,
    "experiments/check_lever.py": check_check_lever,
    "experiments/decision_margins.py": check_decision_margins,
    "benchmarks/bench_sequence_parallel.py": check_bench_sequence_parallel,
    "scripts/gen_config_docs.py": check_gen_config_docs,
    "merge_ckpt/convert_verl_to_hf.py": check_convert,
}


def check_python(cmd: Command, tmp: Path) -> None:
    w = cmd.words
    if w[1] == "-m":
        module, args = w[2], w[3:]
        assert module in MODULE_CHECKS, f"{cmd.id}: no check for `python -m {module}`: add one to MODULE_CHECKS"
        MODULE_CHECKS[module](cmd, args, tmp)
    else:
        script, args = w[1], w[2:]
        assert script in PY_SCRIPT_CHECKS, f"{cmd.id}: no check for `python {script}`: add one to PY_SCRIPT_CHECKS"
        PY_SCRIPT_CHECKS[script](cmd, args, tmp)


def check_torchrun(cmd: Command, tmp: Path) -> None:
    assert (Path(sys.executable).parent / "torchrun").exists(), "torchrun is not installed next to python"
    w = cmd.words
    assert "-m" in w, f"{cmd.id}: torchrun without -m"
    i = w.index("-m")
    assert all(x.startswith("--") for x in w[1:i]), f"{cmd.id}: unexpected torchrun arguments {w[1:i]}"
    MODULE_CHECKS[w[i + 1]](cmd, w[i + 2:], tmp)


LAUNCH_SCRIPTS = {"scripts/ARPO_7B_Reasoning_1node.sh", "scripts/ARPO_14B_DeepSearch_1node.sh",
                  "scripts/AEPO_Qwen3_14B_DeepResearch.sh", "scripts/AEPO_Qwen25_7B_DeepResearch.sh",
                  "scripts/cpu_tiny_arpo.sh"}


def check_bash(cmd: Command, tmp: Path) -> None:
    script, args = cmd.words[1], cmd.words[2:]
    path = ROOT / script
    assert path.is_file(), f"{cmd.id}: {script} does not exist"
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = path.read_text()
    for name in cmd.env:  # variables the command sets must be ones the script reads
        assert "${" + name in text or f"${name}" in text, f"{cmd.id}: {script} does not read ${name}"
    if script in LAUNCH_SCRIPTS:
        env = {**ENV, "PYTHON": sys.executable, "WORK_DIR": str(tmp / "work"), **cmd.env}
        env.setdefault("ACTOR_MODEL_PATH", str(_model_dir(tmp / "model")))
        env.setdefault("MODEL_DIR", env["ACTOR_MODEL_PATH"])
        env.setdefault("SAVE_PATH", str(tmp / "save"))
        if "--cfg" not in args:
            args = [*args, "--cfg", "job"]
        proc = subprocess.run(["bash", str(path), *args], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{cmd.id}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        lines = proc.stdout.splitlines()
        body = "\n".join(ln for ln in lines if not ln.startswith("Switched to parent directory"))
        cfg = OmegaConf.create(body)
        assert cfg.actor_rollout_ref.model.path == env["ACTOR_MODEL_PATH"], cmd.id
        if "TRAIN_FILES" in cmd.env:
            assert cfg.data.train_files == cmd.env["TRAIN_FILES"], cmd.id
        if "ENABLE_DYNAMIC_ROLLOUTS" in cmd.env:
            want = cmd.env["ENABLE_DYNAMIC_ROLLOUTS"].lower() == "true"
            assert cfg.actor_rollout_ref.rollout.enable_dynamic_rollouts is want, cmd.id
    elif script == "scripts/gpu_check.sh":  # run for real by tests/scripts/test_gpu_check.py
        assert "gpu_check.py" in text
        proc = subprocess.run(["bash", str(path), "--help"], env={**ENV, "PYTHON": sys.executable},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "pass/fail table" in proc.stdout, proc.stderr[-2000:]
    elif script == "scripts/quickstart.sh":
        assert "verl_arpo.quickstart" in text
        check_help_only("verl_arpo.quickstart", "--smoke")(cmd, args, tmp)
    elif script == "scripts/test.sh":
        for flag in flags_of(args):
            assert f"{flag})" in text, f"{cmd.id}: scripts/test.sh has no option {flag}"
    elif script == "merge_ckpt/convert_checkpoint_from_verl_to_hf_qwen3.sh":
        assert "convert_verl_to_hf.py" in text and not args, cmd.id
        conv = load_script_module("merge_ckpt/convert_verl_to_hf.py")
        argv = ["--verl_checkpoint", cmd.env.get("VERL_CHECKPOINT", "x"), "--output_dir", cmd.env.get("OUTPUT_DIR", "y")]
        if cmd.env.get("MODEL_TYPE"):
            argv += ["--model_type", cmd.env["MODEL_TYPE"]]
        conv._parser().parse_args(argv)
    else:
        pytest.fail(f"{cmd.id}: no check for `bash {script}`: add one to check_bash")


def _source_text() -> str:
    files = [*ROOT.joinpath("verl_arpo").rglob("*.py"), *ROOT.joinpath("scripts").glob("*.sh")]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


def check_export(cmd: Command, tmp: Path) -> None:
    source = _source_text()
    for word in cmd.words[1:]:
        name = word.split("=", 1)[0]
        assert name in source, f"{cmd.id}: nothing in verl_arpo/ or scripts/ reads ${name}"


def check_apt(cmd: Command, tmp: Path) -> None:
    w = cmd.words
    assert w[1] == "install", f"{cmd.id}: only `apt-get install` is documented"
    packages = [x for x in w[2:] if not x.startswith("-")]
    setup_env = (ROOT / "scripts" / "setup_env.sh").read_text()
    for pkg in packages:
        assert pkg in setup_env, f"{cmd.id}: {pkg} is not a package scripts/setup_env.sh installs"


def check_pip(cmd: Command, tmp: Path) -> None:
    setup = (ROOT / "setup.py").read_text()
    w = cmd.words
    assert w[1] == "install", cmd.id
    for x in w[2:]:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", x)
        if m:
            for extra in m.group(1).split(","):
                assert f'"{extra}":' in setup, f"{cmd.id}: setup.py has no extra {extra!r}"


PROGRAM_CHECKS = {
    "python": check_python, "python3": check_python, "torchrun": check_torchrun, "bash": check_bash,
    "export": check_export, "apt-get": check_apt, "pip": check_pip,
    "verl-arpo-train": lambda cmd, tmp: check_main_ppo(cmd, cmd.words[1:], tmp),
}


# ------------------------------------------------------------------------------------------- tests
def test_docs_are_there_and_show_commands():
    assert EXPECTED_DOCS <= {p.name for p in DOC_FILES}
    for name in EXPECTED_DOCS:
        assert any(c.doc == name for c in ALL_COMMANDS), f"{name} shows no command"


@pytest.mark.parametrize("cmd", ALL_COMMANDS, ids=[c.id for c in ALL_COMMANDS])
def test_doc_command(cmd, tmp_path):
    c = prepare(cmd, tmp_path)
    program = c.words[0]
    assert program in PROGRAM_CHECKS, f"{c.id}: no check for `{program}`: add one to PROGRAM_CHECKS ({c.text})"
    check_repo_paths(c)
    PROGRAM_CHECKS[program](c, tmp_path)


@pytest.mark.parametrize("doc,line,code", PY_BLOCKS, ids=[f"{d}:{s}" for d, s, _ in PY_BLOCKS])
def test_doc_python_block(doc, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = substitute(code, tmp_path, strict=False)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, f"{doc}:{line}", "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("doc,line,lang,text", DATA_BLOCKS, ids=[f"{d}:{s}" for d, s, _, _ in DATA_BLOCKS])
def test_doc_data_block(doc, line, lang, text):
    if lang == "json":
        record = json.loads(text)
        if "conversations" in record or "messages" in record:  # an SFT record
            from verl_arpo.trainer.sft_data import to_messages

            roles = [m["role"] for m in to_messages(record)]
            assert "assistant" in roles and roles[0] == "system", (doc, line, roles)
        return
    data = yaml.safe_load(text)
    if isinstance(data, dict) and ("tool_instances" in data or "tool_instances" in (data.get("tools") or {})):
        import dataclasses

        from verl_arpo.workers.rollout.tools import ToolsConfig, load_tools_config

        raw = data.get("tools", data)
        unknown = set(raw) - {f.name for f in dataclasses.fields(ToolsConfig)}
        assert not unknown, f"{doc}:{line}: keys the tool registry ignores: {unknown}"
        cfg = load_tools_config(data)
        for name, spec in cfg.tool_instances.items():
            assert "class_path" in spec, (doc, line, name)


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    out = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            out.add(re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_relative_links_resolve(doc):
    for target in _LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        assert path.exists(), f"{doc.name}: broken link {target}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{doc.name}: no heading #{anchor} in {path.name}"
