"""Shared helpers of the LoRA tests: a tiny model of every registered family built from its `tiny_config`
(no files), packed documents, adapters set to random values, and router-replay records."""

from __future__ import annotations

import torch

from zrl.config.schema import LoRASpec
from zrl.models import get_family, registered_types
from zrl.modeling.lora import adapter_parameters, apply_lora
from zrl.types import NO_ROUTE

VOCAB = 96
FAMILIES = registered_types()  # every family, those added later included


def tiny_config(model_type: str):
    family = get_family(model_type)
    return family.parse_config({**family.tiny_config, "model_type": model_type, "vocab_size": VOCAB,
                                "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's model on its tiny config, initialised from `seed`, in eval mode."""
    torch.manual_seed(seed)
    model = get_family(model_type).build(tiny_config(model_type))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("qk_norm.temp"):  # MoE++ key temperatures: 1, as its tiny checkpoint starts (at
                param.fill_(1.0)  # 0, attention is uniform and the query projections get no gradient)
    return model.to(dtype).eval()


def spec(model_type: str, **fields) -> LoRASpec:
    """Every target the family can adapt (the router too where it declares one), rank 4, alpha 8 unless given."""
    router = bool(get_family(model_type).lora_modules.router)
    targets = {"router": router, **fields.pop("targets", {})}
    return LoRASpec(**{"rank": 4, "alpha": 8.0, **fields}, targets=targets)


def adapted(model_type: str, seed: int = 0, *, adapter_seed: int | None = None, b_std: float = 0.0,
            **fields) -> torch.nn.Module:
    """`tiny_model(seed)` with adapters (A from `adapter_seed`, default `seed`); B drawn N(0, b_std) when
    b_std > 0 (the update then is of the order of the base weights, N(0, 0.02))."""
    model = tiny_model(model_type, seed)
    apply_lora(model, spec(model_type, **fields), seed=seed if adapter_seed is None else adapter_seed)
    if b_std:
        randomise_b(model, seed, b_std)
    return model


@torch.no_grad()
def randomise_b(model: torch.nn.Module, seed: int, std: float) -> None:
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, param in adapter_parameters(model).items():
        if name.endswith("lora_B"):
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def stream(seed: int = 0, lengths=(9, 15, 12)) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A packed stream of random documents: ids [T], next-token targets [T] (-1 at each document's end),
    cu_seqlens [N + 1]."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    targets = torch.cat([torch.cat([d[1:], d.new_tensor([-1])]) for d in docs])
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.cat(docs), targets, cu


def shifted_record(model_type: str, chosen: torch.Tensor) -> torch.Tensor:
    """A replay record [T, L * k] other than `chosen`: every recorded id moved to the next class (mod C,
    the skip class included where the family has one: distinct ids stay distinct), NO_ROUTE kept."""
    shape = get_family(model_type).shape(tiny_config(model_type))
    ids = chosen.long()
    moved = torch.where(ids == NO_ROUTE, NO_ROUTE, (ids + 1) % shape.count_classes)
    return moved.to(torch.uint8)
