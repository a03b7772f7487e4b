"""Merging adapters into the base weights, tensor by tensor: W' = W + scale * B A, computed in fp32 and
returned in W's dtype.

`merged_tensors` walks the base's parameters and persistent buffers in the order the full-weight export
walks them (zrl.trainer.export.weight_tensors: parameters, shared ones once, then buffers), adapters
left out, and hands each over merged where an adapter sits on it. Each base tensor and its adapters go
through `full` one at a time (`DTensor.full_tensor` under FSDP2: one parameter all-gathered at a time,
never the whole model), so the merged tensors carry the base's names, shapes and dtypes: saved with the
family's `save_hf_checkpoint`, they make a checkpoint laid out as the base's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from zrl.modeling.lora.apply import adapted_modules, is_adapter
from zrl.modeling.lora.layers import LoRALinear

Full = Callable[[torch.Tensor], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


@torch.no_grad()
def merge_weight(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B A in fp32, cast to W's dtype. W [out, in] with A [r, in], B [out, r]; or experts
    W [E, out, in] with A [E or 1, r, in], B [E, out, r]."""
    return (weight.float() + torch.matmul(lora_B.float(), lora_A.float()) * scale).to(weight.dtype)


def _adapters_of(model: nn.Module) -> dict[str, tuple[str, str, str, float]]:
    """{base parameter name: (its module's name, A attribute, B attribute, scale)}."""
    found = {}
    for name, module in adapted_modules(model):
        prefix = f"{name}." if name else ""
        if isinstance(module, LoRALinear):
            found[f"{prefix}weight"] = (name, "lora_A", "lora_B", module.scale)
        else:
            for tensor in ("gate_up_proj", "down_proj"):
                found[f"{prefix}{tensor}"] = (name, f"{tensor}_lora_A", f"{tensor}_lora_B", module.scale)
    return found


@torch.no_grad()
def merged_tensors(model: nn.Module, *, full: Full = _local) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(base name, full tensor, is_parameter), adapters merged in, one tensor at a time; collective when
    `full` is (every rank iterates to the end)."""
    adapters = _adapters_of(model)
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        tensor = full(param)
        if name in adapters:
            module_name, a_name, b_name, scale = adapters[name]
            module = model.get_submodule(module_name)
            tensor = merge_weight(tensor, full(getattr(module, a_name)), full(getattr(module, b_name)), scale)
        yield name, tensor, True
    persistent = model.state_dict(keep_vars=True).keys()
    for name, buffer in model.named_buffers():
        if name in persistent:
            yield name, full(buffer), False


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base's full state dict (its own names) with the adapters merged in (a single-process model)."""
    return {name: tensor for name, tensor, _ in merged_tensors(model)}
