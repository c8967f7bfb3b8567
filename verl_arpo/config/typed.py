"""Building typed config sections from a composed tree: every value checked against its field's type.

    section, problems = build(ActorConfig, tree, "actor_rollout_ref.actor")
    section = from_mapping(ActorConfig, tree, "actor_rollout_ref.actor")   # raises ConfigError instead

A field's annotation is the rule (docs/configuration.md, "How a value is checked"):

    int             an integer, or a string of digits (what `${oc.env:VAR}` gives); never a bool or 2.0
    float           a number or a numeric string; never a bool or NaN
    bool            true/false, or the strings "true"/"false"
    str             a string; a number is taken as its text (`experiment_name=2024`)
    Literal[...]    one of the listed values (`field(metadata={"hint": ...})` adds why)
    X | None        null, or an X
    dict, tuple     a mapping; a list (a tuple field takes a list)
    a dataclass     a section: a mapping (null = all defaults); an unknown key is a problem naming it
    a dataclass | None   null (the section is off), or a section as above

`???` (a required value not given, or an interpolation to one) is read as null, so the section's own
`problems()` names what is required; an interpolation that does not resolve is a problem naming the
key. A value of the wrong type is reported and replaced by the field's default, so the rest of the
tree is still built and checked: `JobConfig.problems` skips the value rules of a section that has a
type problem, so a replaced default never produces a second, misleading message.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Literal

__all__ = ["ConfigError", "Problems", "build", "from_mapping", "plain_tree", "to_dict", "choices", "UNRESOLVED"]

Problems = list[tuple[str, str]]
"""(dotted key, message) pairs; a message says what is wrong and how to fix it."""


class ConfigError(ValueError):
    """A config with one or more bad values; `.problems` lists (key, message) pairs."""

    def __init__(self, problems: Problems):
        self.problems = list(problems)
        lines = [f"  - {key}: {msg}" for key, msg in self.problems]
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n" + "\n".join(lines))


class _Unresolved:
    """A leaf whose interpolation does not resolve (the reason is kept for the message)."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return "<unresolved>"


UNRESOLVED = _Unresolved
_INT_TEXT = re.compile(r"[+-]?\d+")
_UnionType = type(int | None)   # `X | None` written with `|` (typing.Union covers `Literal[...] | None`)


def choices(literal: Any) -> tuple:
    """The values of a `Literal[...]` type (also through `| None`): the one list of accepted choices."""
    args = typing.get_args(literal)
    if typing.get_origin(literal) is Literal:
        return args
    return tuple(v for a in args if typing.get_origin(a) is Literal for v in typing.get_args(a))


def plain_tree(node: Any) -> Any:
    """A plain dict/list copy of an OmegaConf tree (or of a plain mapping), resolved leaf by leaf:
    `???` becomes None, and a leaf that cannot be resolved becomes an `UNRESOLVED` marker, so one
    broken interpolation does not hide the rest of the tree."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a hard dependency
        return node
    if isinstance(node, DictConfig):
        out = {}
        for key in node.keys():
            out[key] = _resolved_child(node, key, OmegaConf)
        return out
    if isinstance(node, ListConfig):
        return [_resolved_child(node, i, OmegaConf) for i in range(len(node))]
    return node


def _resolved_child(node: Any, key: Any, omegaconf: Any) -> Any:
    try:
        if omegaconf.is_missing(node, key):
            return None
        return plain_tree(node[key])
    except Exception as exc:  # noqa: BLE001 - omegaconf's resolution errors: an interpolation to nowhere
        if type(exc).__name__ in ("MissingMandatoryValue", "InterpolationToMissingValueError"):  # to ???
            return None
        return _Unresolved(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


def _type_name(typ: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
             tuple: "a list"}
    return names.get(typ, getattr(typ, "__name__", str(typ)))


def _convert(value: Any, typ: Any, hint: str) -> Any:
    """`value` as `typ`, or raise ValueError with the message for the user."""
    if typ is Any or typ is object:
        return value
    if typing.get_origin(typ) is Literal:
        allowed = typing.get_args(typ)
        switch = any(isinstance(a, bool) for a in allowed)   # a switch with one accepted position
        if switch and isinstance(value, str) and value not in allowed:
            try:
                value = _convert(value, bool, "")
            except ValueError:
                pass
        for a in allowed:
            if type(a) is type(value) and a == value:
                return a
        if switch:  # its hint says why the other position is refused
            raise ValueError(hint or f"must be {str(allowed[0]).lower()}")
        shown = value if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
        raise ValueError(f"unknown {shown!r}; accepted: {list(allowed)}" + (f" ({hint})" if hint else ""))
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ValueError(f"must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _INT_TEXT.fullmatch(value.strip()):
            return int(value)
        raise ValueError(f"must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"must be a number, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"must be a number, got {value!r}") from None
        # [reliability: tests/reliability/README.md] NaN fails every comparison, so `clip_ratio=nan` or
        # `optim.lr=nan` would pass each "must be > 0" rule and reach the loss
        if number != number:
            raise ValueError("must be a number, got nan")
        return number
    if typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"must be a string, got {value!r}")
    if typ is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise ValueError(f"must be a mapping, got {value!r}")
    if typ is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(value)
        raise ValueError(f"must be a list, got {value!r}")
    raise TypeError(f"config field type {typ!r} has no rule in config/typed.py")  # a programming error


def _value(value: Any, typ: Any, hint: str) -> Any:
    """Check a leaf against a (possibly union) annotation; the first member that takes it wins."""
    if isinstance(value, _Unresolved):
        raise ValueError(f"does not resolve ({value.reason}): fix the interpolation or give a value")
    members = typing.get_args(typ) if typing.get_origin(typ) in (typing.Union, _UnionType) else (typ,)
    if value is None:
        if type(None) in members or typ is Any:
            return None
        raise ValueError(f"is required (null or ??? given): expected {_type_name(members[0])}")
    errors = []
    for member in (m for m in members if m is not type(None)):
        try:
            return _convert(value, member, hint)
        except ValueError as exc:
            errors.append(str(exc))
    raise ValueError(errors[0] if len(errors) == 1 else " or ".join(errors))



def _section_type(typ: Any) -> type | None:
    """The dataclass of a section field (`X` or `X | None`), else None."""
    if is_dataclass(typ):
        return typ
    if typing.get_origin(typ) in (typing.Union, _UnionType):
        members = [m for m in typing.get_args(typ) if m is not type(None)]
        if len(members) == 1 and is_dataclass(members[0]) and type(None) in typing.get_args(typ):
            return members[0]
    return None


def build(cls: type, data: Any, where: str) -> tuple[Any, Problems]:
    """An instance of dataclass `cls` from `data` (a mapping, an OmegaConf tree, None for all defaults,
    or already an instance), and every problem found on the way. A bad value is replaced by the
    field's default (and reported); an unknown key is reported and left out."""
    if isinstance(data, cls):
        return data, []
    data = plain_tree(data)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        shown = f"got {data.reason}" if isinstance(data, _Unresolved) else f"got {type(data).__name__}"
        return cls(), [(where or "<root>", f"must be a section (a mapping), {shown}")]
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    problems: Problems = [(f"{where}.{k}".lstrip("."), f"unknown key; {cls.__name__} accepts {sorted(known)}")
                          for k in sorted(str(k) for k in data if k not in known)]
    kwargs = {}
    for name, value in data.items():
        if name not in known:
            continue
        key = f"{where}.{name}".lstrip(".")
        typ = hints[name]
        section = _section_type(typ)
        if section is not None and not (value is None and typ is not section):
            kwargs[name], found = build(section, value, key)
            problems += found
            continue
        try:
            kwargs[name] = _value(value, typ, known[name].metadata.get("hint", ""))
        except ValueError as exc:
            problems.append((key, str(exc)))
    return cls(**kwargs), problems


def from_mapping(cls: type, data: Any, where: str) -> Any:
    """`build`, raising ConfigError with every problem instead of returning them."""
    section, problems = build(cls, data, where)
    if problems:
        raise ConfigError(problems)
    return section


def to_dict(obj: Any) -> dict:
    """A plain nested dict of a config dataclass (tuples stay tuples)."""
    return dataclasses.asdict(obj)
