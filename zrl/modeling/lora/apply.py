"""Putting adapters on a built model, through its family's declared modules, and freezing the base.

`apply_lora(model, spec)` replaces every module the family's `lora_modules` names for the recipe's
targets by its adapted twin (layers.py), in place: the same base Parameter objects under the same
names, so the base's state-dict names, its order and the FSDP2 units are unchanged. Every parameter
that is not an adapter is then frozen (`requires_grad=False`) in its own dtype; adapters are fp32.
Applied on the meta device (the trainer's way: build on meta, adapt, shard, load), the adapters are
initialised later by `reset_adapters`; elsewhere at once, from `seed` (the same values on every rank).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from zrl.modeling.experts import SwiGLUExperts
from zrl.modeling.lora.layers import LoRALinear, LoRASwiGLUExperts
from zrl.models import family_of

if TYPE_CHECKING:
    from zrl.config.schema import LoRASpec

ADAPTER_SUFFIXES = ("lora_A", "lora_B")
ADAPTED = (LoRALinear, LoRASwiGLUExperts)


def is_adapter(name: str) -> bool:
    """Whether the parameter called `name` (a state-dict name) is an adapter."""
    return name.endswith(ADAPTER_SUFFIXES)


def _compile(patterns: tuple[str, ...]) -> list[re.Pattern]:
    return [re.compile("^" + re.escape(p).replace(r"\*", r"[^.]+") + "$") for p in patterns]


def target_patterns(model: nn.Module, spec: LoRASpec) -> dict[str, tuple[str, ...]]:
    """{kind: the family's module patterns} of the targets `spec` turns on; raises a one-line ValueError
    for a target the family cannot adapt."""
    family = family_of(model)
    declared, targets = family.lora_modules, spec.targets
    if targets.router and not declared.router:
        raise ValueError(f"model.lora.targets.router: {family.model_type} declares no router module an adapter "
                         f"can wrap (zrl/models/family.py LoRAModules)")
    chosen = {"attention": declared.attention if targets.attention else (),
              "experts": declared.experts if targets.experts else (),
              "dense_mlp": declared.dense_mlp if targets.dense_mlp else (),
              "router": declared.router if targets.router else ()}
    return {kind: patterns for kind, patterns in chosen.items() if patterns}


def apply_lora(model: nn.Module, spec: LoRASpec, *, seed: int = 0) -> list[str]:
    """Adapt `model` in place as `spec` asks; returns the adapted modules' names (module order)."""
    compiled = {kind: _compile(patterns) for kind, patterns in target_patterns(model, spec).items()}
    adapted = []
    for name, module in list(model.named_modules()):
        kinds = [kind for kind, regexes in compiled.items() if any(r.match(name) for r in regexes)]
        if not kinds:
            continue
        if isinstance(module, ADAPTED):
            raise ValueError(f"{name}: already has adapters (apply_lora runs once per model)")
        kind = kinds[0]
        if kind == "experts":
            if not isinstance(module, SwiGLUExperts):
                raise TypeError(f"{name}: declared as experts but is a {type(module).__name__}, not SwiGLUExperts")
            new = LoRASwiGLUExperts(module, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout,
                                    shared_a=spec.targets.experts == "shared_a")
        else:
            if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
                raise TypeError(f"{name}: declared as {kind} but is a {type(module).__name__}, not an nn.Linear "
                                f"using nn.Linear's forward")
            new = LoRALinear(module, rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout)
        new.train(module.training)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        adapted.append(name)
    if not adapted:
        raise ValueError(f"model.lora.targets: no module of this {family_of(model).model_type} model matches them")
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if not any(p.is_meta for p in adapter_parameters(model).values()):
        reset_adapters(model, seed=seed)
    return adapted


def adapted_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear | LoRASwiGLUExperts]]:
    """(name, module) of every adapted module, in module order (FSDP2-wrapped models included)."""
    for name, module in model.named_modules():
        if isinstance(module, ADAPTED):
            yield name, module


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """{state-dict name: parameter} of every adapter, in module order."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


def initial_adapter_state(model: nn.Module, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """{adapter name: initial value} on the CPU in fp32: A as PEFT initialises it (kaiming-uniform, drawn
    module after module from one generator seeded with `seed`), B = 0, so the adapted model computes the
    base's outputs. Reads only the parameters' shapes (meta, sharded or full alike): what a sharded
    trainer broadcasts from rank 0 together with the base weights."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in adapted_modules(model):
        prefix = f"{name}." if name else ""
        for attr, value in module.initial_lora_state(generator).items():
            state[prefix + attr] = value
    return state


@torch.no_grad()
def reset_adapters(model: nn.Module, *, seed: int = 0) -> None:
    """Set every adapter of an unsharded model to `initial_adapter_state(model, seed=seed)`."""
    params = adapter_parameters(model)
    for name, value in initial_adapter_state(model, seed=seed).items():
        params[name].copy_(value)
