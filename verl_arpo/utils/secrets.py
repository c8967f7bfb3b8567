"""Secrets never reach logs, dumps, caches or checkpoints: masking for configs and free text.

    mask_secrets(cfg)   a plain dict copy of a config with credential values replaced by ***
    mask_text(text)     `text` with the values of SECRET_ENV_VARS replaced by ***

A key holds a credential when it matches *api_key* / *api-key* (`x-api-key`), *secret*, *password*,
*credential*, *auth* (`authorization`, `auth_header`), *cookie*, ends in `token` (`hf_token`,
`access_token`), or ends in `_key` / `-key` (`openai_key`, `subscription_key`) unless it names a data
column (`prompt_key`, `reward_fn_key`, `response_key`, ...: NOT_CREDENTIAL_KEYS) — so
`ppo_max_token_len_per_gpu`, `tokenizer` and `author` stay visible.

Free text loses the values of SECRET_ENV_VARS and of every environment variable whose name is a
credential by the same rule (`OPENAI_API_KEY`, `MY_SERVICE_TOKEN`, variables passed through
`ray_init.runtime_env.env_vars`), the value of any `Authorization:` / `Bearer` / `X-Api-Key` header,
the password of a URL (`https://user:***@host`), and the value of a credential key written as
`key=value` (a command line, Hydra's override list), `key: value` (YAML) or `"key": "value"` (JSON).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["SECRET_ENV_VARS", "MASK", "NOT_CREDENTIAL_KEYS", "is_secret_key", "mask_text", "mask_secrets", "secret_env_vars"]

SECRET_ENV_VARS = ("BRIGHTDATA_API_KEY", "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
"""Environment variables whose values are masked wherever they appear inside a string."""
MASK = "***"
_SECRET_KEY = re.compile(
    r"api[-_]?key|secret|password|passwd|credential|authori[sz]ation|auth(?!or)|cookie"
    r"|(?:subscription|access|private|session|signing|encryption)[-_]?key|token$|[-_]key$", re.IGNORECASE)
NOT_CREDENTIAL_KEYS = frozenset({"prompt_key", "reward_fn_key", "response_key", "chosen_key", "rejected_key",
                                 "messages_key", "answer_key", "question_key", "label_key", "image_key", "video_key",
                                 "multi_turn_key", "sort_key", "cache_key", "group_key"})
"""Keys ending in `_key` that name a data column or a lookup, not a credential."""
# "Authorization: Bearer abc", "authorization=abc", "Bearer abc", "X-Api-Key: abc" (headers in errors or logs)
_AUTH_HEADER = re.compile(r"((?:proxy-)?authorization\s*[:=]\s*(?:(?:bearer|basic|token)\s+)?|bearer\s+"
                          r"|(?:x-)?api-key\s*[:=]\s*)([^\s\"',;})\]]+)", re.IGNORECASE)
# the password of a URL: scheme://user:password@host
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s/:@]+:)([^\s/@]+)(@)", re.IGNORECASE)
# `key: value` lines (YAML, Hydra's --help) and `"key": "value"` pairs (JSON)
_YAML_PAIR = re.compile(r"^(\s*(?:-\s+)?([\w.-]+)\s*:[ \t]+)(\S[^\n]*?)\s*$", re.MULTILINE)
_JSON_PAIR = re.compile(r'("([\w.-]+)"\s*:\s*")((?:[^"\\]|\\.)*)(")')
_EMPTY_VALUES = ("null", "~", "''", '""', "???", MASK, f"'{MASK}'")


def is_secret_key(key: Any) -> bool:
    """True for keys holding credentials (the rule in this module's docstring)."""
    name = str(key)
    return bool(_SECRET_KEY.search(name)) and name.lower() not in NOT_CREDENTIAL_KEYS


# credential-looking names that hold settings, not secrets (Ray exports RAY_AUTH_MODE=token)
_SETTING_SUFFIXES = ("_MODE", "_TYPE", "_ENABLED", "_LEVEL", "_URL", "_HOST", "_PORT", "_PATH", "_FILE", "_DIR")


def _looks_secret(value: str) -> bool:
    """A value worth masking in free text: long enough and not a plain word ("token", "false")."""
    return len(value) >= 16 or (len(value) >= 8 and not value.isalpha())


def _secret_env_values() -> list[str]:
    named = {os.environ.get(n, "") for n in SECRET_ENV_VARS}
    ruled = {v for k, v in os.environ.items()
             if is_secret_key(k) and not k.upper().endswith(_SETTING_SUFFIXES) and _looks_secret(v)}
    # longest first: a secret that contains another is masked whole
    return sorted((v for v in named | ruled if len(v) >= 4), key=len, reverse=True)


# `key=value` in command lines and Hydra override lists (`...params.api_key=sk-1`)
_ASSIGNMENT = re.compile(r"([\w.+/@-]+)(\s*=\s*)([^\s,'\"\]\)}]+)")


def _mask_assignment(m: re.Match) -> str:
    return m.group(1) + m.group(2) + MASK if is_secret_key(m.group(1).rsplit(".", 1)[-1]) else m.group(0)


def _mask_pair(m: re.Match) -> str:
    if not is_secret_key(m.group(2)) or m.group(3).strip() in _EMPTY_VALUES or MASK in m.group(3):
        return m.group(0)
    return m.group(1) + MASK + (m.group(4) if m.lastindex and m.lastindex >= 4 else "")


def mask_text(text: str) -> str:
    """`text` with secret environment values (>= 4 chars), header values (Authorization, Bearer,
    X-Api-Key), URL passwords and the values of credential keys (`key=value`, `key: value`,
    `"key": "value"`) replaced by ***."""
    for value in _secret_env_values():
        if value in text:
            text = text.replace(value, MASK)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + MASK, text)
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: m.group(1) + MASK + m.group(3), text)
    if ":" in text:
        text = _JSON_PAIR.sub(_mask_pair, text)
        text = _YAML_PAIR.sub(_mask_pair, text)
    return _ASSIGNMENT.sub(_mask_assignment, text) if "=" in text else text


def _mask(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: (MASK if is_secret_key(k) and v not in (None, "") else _mask(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask(v) for v in value]
    if isinstance(value, str):
        return mask_text(value)
    return value


def mask_secrets(cfg: DictConfig | Mapping | Any) -> dict:
    """A plain dict copy of `cfg` with secret values replaced by *** (see is_secret_key, mask_text).

    Accepts a DictConfig (resolved when possible; a ??? value stays ???) or any mapping.
    Null / empty secrets stay as they are, so the printout shows that no key is set.
    """
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except Exception:  # an interpolation that cannot resolve (e.g. to a ??? value)
            plain = OmegaConf.to_container(cfg, resolve=False)
    elif isinstance(cfg, Mapping):
        plain = {k: (OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v)
                 for k, v in cfg.items()}
    else:
        raise TypeError(f"mask_secrets expects a config or a mapping, got {type(cfg).__name__}")
    return _mask(plain)


def secret_env_vars(env_vars: Mapping[str, Any] | None) -> dict[str, str]:
    """The credential-named entries of an environment mapping (`ray_init.runtime_env.env_vars`)."""
    return {str(k): str(v) for k, v in (env_vars or {}).items() if is_secret_key(k)}
