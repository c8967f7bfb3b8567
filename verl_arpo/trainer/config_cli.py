"""The command-line forms of `main_ppo` that print or check a config and train nothing
(docs/migrating.md, "Running the launch scripts"):

    --cfg job|hydra|all [--package <node>]   the composed config, credentials masked
    --help, --hydra-help, --info [...]       Hydra's own pages, credentials masked
    any run                                   unknown keys named, with the closest valid key

Hydra prints the config and its override list in clear, so every printing form goes through
`utils/secrets.mask_secrets` (the config, by key) or `mask_text` (Hydra's pages, by pattern). An
unknown key — plain (`a.b.foo=1`, which Hydra refuses) or added (`+a.b.foo=1`, which Hydra accepts)
— is one ConfigError line with exit 2, the same for `--cfg job` as for a run, instead of a
traceback or a silent exit 0.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import sys
import typing
from dataclasses import fields, is_dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from verl_arpo.config import ConfigError, JobConfig
from verl_arpo.utils.secrets import mask_secrets, mask_text

__all__ = ["CFG_TYPES", "PAGE_FLAGS", "parse_cli", "print_config", "print_masked_page", "check_keys", "known_keys"]

CFG_TYPES = ("job", "hydra", "all")
PAGE_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i")
"""Flags whose output is one of Hydra's pages (it prints the config with the overrides applied)."""
_CONFIG_FLAGS = {"--config-name": "name", "-cn": "name", "--config-path": "dir", "-cp": "dir",
                 "--cfg": "cfg", "-c": "cfg", "--package": "package", "-p": "package"}


class CommandLine(typing.NamedTuple):
    cfg_type: str | None      # --cfg value (None: not given or not one of CFG_TYPES)
    package: str | None       # --package value
    name: str                 # --config-name
    config_dir: str           # --config-path (absolute)
    overrides: list[str]      # key=value words
    other_flags: list[str]    # flags this module does not interpret (--multirun, --resolve, ...)


def parse_cli(argv: list[str], default_dir: str, default_name: str = "ppo_trainer") -> CommandLine:
    """Split a Hydra command line into the parts that select and change the config."""
    found = {"name": default_name, "dir": default_dir, "cfg": None, "package": None}
    overrides, other = [], []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        if flag in _CONFIG_FLAGS:
            found[_CONFIG_FLAGS[flag]] = value if eq else next(it, None)
        elif arg.startswith("-"):
            other.append(arg)
        else:
            overrides.append(arg)
    cfg_type = found["cfg"] if found["cfg"] in CFG_TYPES else None
    return CommandLine(cfg_type, found["package"], found["name"], os.path.abspath(found["dir"]), overrides, other)


def known_keys(cls: type = JobConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the typed config (sections and leaves)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if is_dataclass(hints[f.name]):
            keys += known_keys(hints[f.name], key + ".")
    return keys


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _unknown_key(exc: Exception) -> str | None:
    """The key of Hydra's "Could not override 'a.b.c'" (an override of a key not in the config)."""
    text = str(exc)
    marker = "Could not override '"
    if marker in text and "not in struct" in f"{text} {exc.__cause__}":
        return text.split(marker, 1)[1].split("'", 1)[0]
    return None


def _unknown(data: typing.Any, cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of `data` that the dataclass `cls` (recursively) has no field for; free-form fields
    (dicts such as tool_instances) are not looked into. Values are not resolved or checked here."""
    if not isinstance(data, dict):
        return []
    hints = typing.get_type_hints(cls)
    out = []
    for key, value in data.items():
        if key not in hints:
            out.append(f"{prefix}{key}")
        elif is_dataclass(hints[key]):
            out += _unknown(value, hints[key], f"{prefix}{key}.")
    return out


def check_keys(cfg: DictConfig) -> None:
    """ConfigError for every key of `cfg` the typed config does not know (an added `+key=`)."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    unknown = _unknown(plain, JobConfig)
    if unknown:
        raise ConfigError([(k, f"unknown key{_did_you_mean(k)}") for k in unknown])


def compose_checked(cli: CommandLine, return_hydra_config: bool = False) -> DictConfig:
    """Compose like Hydra does for a run; unknown keys (plain or added) raise one ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    try:
        with initialize_config_dir(config_dir=cli.config_dir, version_base=None):
            cfg = compose(config_name=cli.name, overrides=cli.overrides, return_hydra_config=return_hydra_config)
    except HydraException as exc:
        key = _unknown_key(exc)
        if key is None:
            raise
        raise ConfigError([(key, f"unknown key{_did_you_mean(key)} (Hydra: Could not override '{key}': "
                                 f"Key '{key.rsplit('.', 1)[-1]}' is not in struct)")]) from None
    check_keys(cfg)
    return cfg


def print_config(cli: CommandLine) -> None:
    """`--cfg job|hydra|all [--package node]`, credentials masked (Hydra's own printing shows them)."""
    cfg = compose_checked(cli, return_hydra_config=cli.cfg_type != "job")
    node = cfg.hydra if cli.cfg_type == "hydra" else cfg   # Hydra's section holds the override list: masked too
    if cli.package:
        node = OmegaConf.select(cfg, cli.package, default=None, throw_on_missing=False)
        if node is None:
            raise ConfigError([(cli.package, f"--package names no node of the config{_did_you_mean(cli.package)}")])
        print(f"# @package {cli.package}")
    if isinstance(node, (DictConfig, ListConfig)):
        masked = mask_secrets(node) if isinstance(node, DictConfig) else mask_secrets({"_": node})["_"]
        print(OmegaConf.to_yaml(OmegaConf.create(masked)), flush=True)
    else:
        leaf = cli.package.rsplit(".", 1)[-1] if cli.package else ""
        print(mask_text(f"{leaf}: {node}").split(": ", 1)[1], flush=True)


def print_masked_page(run_hydra: typing.Callable[[], None]) -> None:
    """Run Hydra for one of its pages (--help, --info) with stdout captured, then print it masked."""
    buf = io.StringIO()
    code: object = 0
    with contextlib.redirect_stdout(buf):
        try:
            run_hydra()
        except SystemExit as exc:
            code = exc.code
    sys.stdout.write(mask_text(buf.getvalue()))
    sys.stdout.flush()
    if code not in (0, None):
        sys.exit(code)
