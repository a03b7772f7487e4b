"""The registry of model families: config.json `model_type` -> the architecture's `ModelFamily`.

Entries name a class by import path so that resolving a family imports only that architecture's
package (and no torch). Adding an architecture: its package with a `family.py`, plus one line in
`_BUILT_IN`.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

from zrl.models.family import ROUTING_CAPTURE_KINDS, ModelFamily

_BUILT_IN = {
    "zaya": "zrl.moepp.family:MoEPPFamily",
    "qwen3_moe": "zrl.qwen3_moe.family:Qwen3MoEFamily",
    "glm4_moe": "zrl.glm4_moe.family:Glm4MoEFamily",
}

_FAMILIES: dict[str, str] = {}


def register(model_type: str, target: str) -> None:
    """Register `module:Class` for `model_type`; raises on a duplicate."""
    if model_type in _FAMILIES:
        raise ValueError(f"model_type {model_type!r} is already registered ({_FAMILIES[model_type]})")
    _FAMILIES[model_type] = target


for _model_type, _target in _BUILT_IN.items():
    register(_model_type, _target)


def registered_types() -> list[str]:
    return sorted(_FAMILIES)


@functools.cache
def get_family(model_type: str) -> ModelFamily:
    """The family of `model_type`; raises ValueError listing the registered types on a miss."""
    if model_type not in _FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; registered: {', '.join(registered_types())}")
    module, _, name = _FAMILIES[model_type].partition(":")
    family = getattr(importlib.import_module(module), name)()
    if family.model_type != model_type or family.routing_capture not in ROUTING_CAPTURE_KINDS:
        raise TypeError(f"{_FAMILIES[model_type]}: model_type {family.model_type!r} (registered as {model_type!r}), "
                        f"routing_capture {family.routing_capture!r} (one of {ROUTING_CAPTURE_KINDS})")
    return family


def model_type_of(raw: dict) -> str:
    """config.json's model_type, or a ValueError saying it is missing."""
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not isinstance(model_type, str):
        raise ValueError(f"config.json has no model_type string (registered: {', '.join(registered_types())})")
    return model_type


def family_of_checkpoint(path: str | Path) -> ModelFamily:
    """The family of the checkpoint directory `path` (by its config.json's model_type)."""
    config = Path(path) / "config.json"
    return get_family(model_type_of(json.loads(config.read_text(encoding="utf-8"))))


def family_of(model) -> ModelFamily:
    """The family of a built model (by `model.config.model_type`; FSDP2-wrapped models included)."""
    return get_family(model.config.model_type)
