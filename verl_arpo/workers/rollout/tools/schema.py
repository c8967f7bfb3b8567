"""OpenAI function schemas: the shape a tool declares for chat-template function calling
(docs/tools.md, "Function schemas"), checked once at config time, and the check of a model's
arguments against them at call time.

A schema is what `tokenizer.apply_chat_template(..., tools=[...])` renders into the prompt:

    {"type": "function",
     "function": {"name": "python", "description": "...",
                  "parameters": {"type": "object",
                                 "properties": {"code": {"type": "string", "description": "..."}},
                                 "required": ["code"]}}}

Two kinds of bad input, told apart as the house rules say:
- a bad schema is the *user's* (a tool YAML's `tool_schema`, an MCP server's tool list): a
  `SchemaError` naming the key, at build time;
- bad arguments are the *model's*: `argument_error` returns the text the model sees, nothing raises.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
"""The keys of a schema's `function` object (OpenAI's; `strict` is accepted and passed through)."""
PROPERTY_KEYS = {"type", "description", "enum", "items", "properties", "required", "default", "minimum", "maximum",
                 "minLength", "maxLength", "minItems", "maxItems", "additionalProperties", "title", "format",
                 "anyOf", "oneOf", "examples", "nullable", "pattern", "const", "$schema", "$defs", "definitions"}
"""JSON-Schema keywords a parameter may use. A key outside this set is more likely a typo than a
keyword (`desciption`, `require`), so it is refused rather than rendered into every prompt."""
JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
              "object": dict, "null": type(None)}
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class SchemaError(ValueError):
    """A tool's function schema is malformed; the message names the key and the fix."""


def function_schema(name: str, description: str, argument: str, argument_description: str) -> dict[str, Any]:
    """The schema of a tool that takes one string argument (the tag tools: python's code, search's query)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string", "description": argument_description}},
                       "required": [argument]}}}


def validate_schema(schema: Any, where: str) -> dict[str, Any]:
    """`schema` checked and normalised to `{"type": "function", "function": {...}}` (a bare function
    object is wrapped). `where` names it in errors (a config path such as
    `tools.tool_instances.python.tool_schema`)."""
    if not isinstance(schema, Mapping):
        raise SchemaError(f"{where}: a function schema is a mapping {{type: function, function: {{name, description, "
                          f"parameters}}}}, got {type(schema).__name__}")
    schema = copy.deepcopy(dict(schema))
    if "function" not in schema and "name" in schema:   # a bare function object
        schema = {"type": "function", "function": schema}
    unknown = set(schema) - {"type", "function"}
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {sorted(unknown)}; a schema has only `type: function` and `function`")
    if schema.get("type", "function") != "function":
        raise SchemaError(f"{where}.type: {schema['type']!r}; only 'function' is supported")
    fn = schema.get("function")
    if not isinstance(fn, Mapping):
        raise SchemaError(f"{where}.function: missing or not a mapping (it holds name, description, parameters)")
    fn = dict(fn)
    unknown = set(fn) - FUNCTION_KEYS
    if unknown:
        raise SchemaError(f"{where}.function: unknown key(s) {sorted(unknown)}; allowed: {sorted(FUNCTION_KEYS)}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise SchemaError(f"{where}.function.name: {name!r}; write 1-64 letters, digits, '_', '.' or '-'")
    if not isinstance(fn.get("description", ""), str):
        raise SchemaError(f"{where}.function.description: must be a string")
    params = fn.setdefault("parameters", {"type": "object", "properties": {}})
    _check_parameter(params, f"{where}.function.parameters", top=True)
    return {"type": "function", "function": fn}


def _check_parameter(p: Any, where: str, top: bool = False) -> None:
    if not isinstance(p, Mapping):
        raise SchemaError(f"{where}: a JSON-Schema object is a mapping, got {type(p).__name__}")
    unknown = set(p) - PROPERTY_KEYS
    if unknown:
        raise SchemaError(f"{where}: unknown JSON-Schema key(s) {sorted(unknown)}")
    types = p.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in JSON_TYPES:
            raise SchemaError(f"{where}.type: {t!r}; choose from {sorted(JSON_TYPES)}")
    if top and p.get("type") != "object":
        raise SchemaError(f"{where}.type: the parameters of a function are `type: object`, got {p.get('type')!r}")
    props = p.get("properties", {})
    if not isinstance(props, Mapping):
        raise SchemaError(f"{where}.properties: must map argument names to schemas")
    for k, v in props.items():
        _check_parameter(v, f"{where}.properties.{k}")
    required = p.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        raise SchemaError(f"{where}.required: {required!r} must list names from properties {sorted(props)}")
    if "items" in p:
        _check_parameter(p["items"], f"{where}.items")


def argument_error(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """What is wrong with a model's `arguments` for `schema` (text for the model), or None.
    Checks what a model gets wrong: not an object, a missing required argument, an unknown one when
    the schema closes them (`additionalProperties: false`, or any of our tag tools), a wrong type."""
    fn = schema["function"]
    name, params = fn["name"], fn.get("parameters") or {}
    if not isinstance(arguments, dict):
        return f"the arguments of {name} must be a JSON object, got {_json_type(arguments)}"
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"{name} needs the argument(s) {', '.join(missing)}"
    if params.get("additionalProperties") is False:
        extra = sorted(set(arguments) - set(props))
        if extra:
            return f"{name} takes no argument(s) {', '.join(extra)}; its arguments are {', '.join(props) or 'none'}"
    for k, v in arguments.items():
        if k in props and (problem := _type_error(props[k], v)):
            return f"argument {k!r} of {name} {problem}"
    return None


def _type_error(p: Mapping[str, Any], v: Any) -> str | None:
    types = p.get("type")
    if types is None:
        return None
    allowed = types if isinstance(types, list) else [types]
    for t in allowed:
        py = JSON_TYPES[t]
        if isinstance(v, py) and not (t in ("integer", "number") and isinstance(v, bool)):
            if t == "integer" and isinstance(v, float):
                continue
            if "enum" in p and v not in p["enum"]:
                return f"must be one of {p['enum']}, got {v!r}"
            return None
    return f"must be {' or '.join(allowed)}, got {_json_type(v)}"


def _json_type(v: Any) -> str:
    for name, py in JSON_TYPES.items():
        if isinstance(v, py) and not (name in ("integer", "number") and isinstance(v, bool)):
            return name
    return type(v).__name__
