"""What every family's config parser shares: the error naming an unsupported key, and the rule for the
keys a parser does not read.

A family parses a Hugging Face config.json into a frozen dataclass holding exactly the numbers its model
uses; anything it cannot run exactly raises `ConfigError` naming the key, so a checkpoint never loads
into a silently different model. Importing this module imports no torch.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config that this implementation cannot run exactly; the message names the key."""


def leftover_keys(cfg: dict[str, Any], ignored: frozenset[str], strict: bool, model_type: str) -> dict[str, Any]:
    """What a config parser leaves in `cfg`: the `ignored` keys, returned to pass through to config.json;
    any other key raises ConfigError (strict) or is logged and dropped."""
    passthrough = {key: cfg.pop(key) for key in list(cfg) if key in ignored}
    if cfg:
        if strict:
            raise ConfigError(f"unsupported config key(s) {sorted(cfg)}: this implementation does not know "
                              f"what they change (pass strict=False to ignore them)")
        logger.warning("ignoring unknown %s config keys %s", model_type, sorted(cfg))
    return passthrough


def pop_required(cfg: dict[str, Any], key: str) -> Any:
    """Pop `key` from a config being parsed; ConfigError when it is absent."""
    if key not in cfg:
        raise ConfigError(f"missing required config key {key!r}")
    return cfg.pop(key)


def pop_expert_count(cfg: dict[str, Any], key: str) -> int:
    """The routed-expert count under the family's `key` or transformers' generic `num_local_experts`
    (either or both, equal), popped."""
    named, local = cfg.pop(key, None), cfg.pop("num_local_experts", None)
    if named is None and local is None:
        raise ConfigError(f"missing required config key '{key}' (or 'num_local_experts')")
    if None not in (named, local) and named != local:
        raise ConfigError(f"{key}={named} and num_local_experts={local} disagree")
    return named if named is not None else local


def pop_supported(cfg: dict[str, Any], key: str, expected: Any, why: str, *, allow_null: bool = True) -> None:
    """Pop `key` and raise unless it is absent, equal to the one supported value, or null (when `allow_null`)."""
    if key in cfg:
        value = cfg.pop(key)
        if value is None and allow_null:
            return
        if value != expected or type(value) is bool and type(expected) is not bool:
            raise ConfigError(f"{key}={value!r} is not supported ({why}); expected {expected!r}")
