"""Secrets never reach logs, dumps, caches or checkpoints: masking for configs and free text.

    mask_secrets(cfg)   a plain dict copy of a config with credential values replaced by ***
    mask_text(text)     `text` with the values of SECRET_ENV_VARS replaced by ***

A key holds a credential when it matches *api_key*, *secret*, *password*, *credential*, *auth*
(`authorization`, `auth_header`), *cookie*, a named key (`subscription_key`, `access_key`,
`private_key`, `session_key`), or ends in `token` (`hf_token`, `access_token`) — so
`ppo_max_token_len_per_gpu`, `tokenizer`, `author` and `prompt_key` stay visible.

Free text loses the values of SECRET_ENV_VARS and of every environment variable whose name is a
credential by the same rule (`OPENAI_API_KEY`, `MY_SERVICE_TOKEN`, variables passed through
`ray_init.runtime_env.env_vars`), the value of any `Authorization:` / `Bearer` header, and the
value of a `<credential key>=value` assignment (a command line, Hydra's override list).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["SECRET_ENV_VARS", "MASK", "is_secret_key", "mask_text", "mask_secrets", "secret_env_vars"]

SECRET_ENV_VARS = ("BRIGHTDATA_API_KEY", "WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
"""Environment variables whose values are masked wherever they appear inside a string."""
MASK = "***"
_SECRET_KEY = re.compile(
    r"api_?key|secret|password|passwd|credential|authori[sz]ation|auth(?!or)|cookie"
    r"|(?:subscription|access|private|session|signing|encryption)[-_]?key|token$", re.IGNORECASE)
# "Authorization: Bearer abc", "authorization=abc", "Bearer abc" (headers echoed in errors or logs)
_AUTH_HEADER = re.compile(r"((?:proxy-)?authorization\s*[:=]\s*(?:(?:bearer|basic|token)\s+)?|bearer\s+)"
                          r"([^\s\"',;}]+)", re.IGNORECASE)


def is_secret_key(key: Any) -> bool:
    """True for keys holding credentials (the rule in this module's docstring)."""
    return bool(_SECRET_KEY.search(str(key)))


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


def mask_text(text: str) -> str:
    """`text` with secret environment values (>= 4 chars), Authorization/Bearer header values and
    the values of `<credential key>=value` assignments replaced by ***."""
    for value in _secret_env_values():
        if value in text:
            text = text.replace(value, MASK)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + MASK, text)
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
