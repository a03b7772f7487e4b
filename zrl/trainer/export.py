"""Full-weight export of the sharded policy: versioned buckets for weight sync, and HF checkpoint files.

`iter_full_tensors` walks the model's parameters (tied embedding once) and buffers in module order,
all-gathers ONE parameter at a time (`DTensor.full_tensor`) and casts it to the engine dtype;
`weight_specs` lists the same names, shapes and dtypes without gathering anything (the layout a weight
sync announces before it streams). `iter_weight_buckets` groups the tensors into buckets of about
`bucket_bytes`, so a rank never holds more than one bucket plus one gathered parameter beyond its
shards. All ranks must iterate to the end together (each gather is a collective); ranks that do not
send weights simply drop what they gathered.

A model with LoRA adapters (zrl.modeling.lora) exports its base's names, shapes and dtypes: each adapted
tensor is merged (W + scale B A, fp32) right after it and its adapters are gathered; `export_peft_adapter`
writes the adapters alone as a PEFT directory, `adapter_tensors` returns them (an adapter-only sync).

Names are the Hugging Face checkpoint keys the rollout engine's loader reads, from the model family's
`hf_tensors` (zrl/models: MoE++ prefixes `model.`; Qwen3-MoE also splits a fused expert tensor into
per-expert matrices). Parameters are cast to `dtype`; buffers (the fp32 balancing biases) keep
their dtype, as in the HF export (zrl/moepp/README.md).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from zrl.config.schema import Asynchrony
from zrl.modeling.lora import is_adapter, merged_tensors, peft_adapter, write_peft_adapter
from zrl.models import family_of

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = int(Asynchrony.model_fields["sync_bucket_mib"].default * 2**20)  # the recipe's default
# Files besides the weights that make an exported directory loadable by tokenizer and engine.
_COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


@dataclass(frozen=True)
class WeightBucket:
    """One slice of the policy's weights for the rollout engines, stamped with the policy version."""

    version: int  # optimizer steps applied to these weights
    index: int  # 0, 1, ... within one export
    tensors: tuple[tuple[str, torch.Tensor], ...]  # (HF key, full tensor) on the trainer's device
    last: bool  # no bucket follows in this export

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def weight_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every parameter (shared ones once) and persistent buffer: what the
    trainer's copy of a synced version holds (zrl.trainer.onpolicy); a weight sync sends the same without
    the adapters, merged into their base tensors."""
    yield from ((name, p, True) for name, p in model.named_parameters())
    persistent = model.state_dict(keep_vars=True).keys()
    yield from ((name, b, False) for name, b in model.named_buffers() if name in persistent)


def _exported_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """`weight_tensors` without the adapters (zrl.modeling.lora): what the engine and an HF export hold."""
    return ((name, t, is_param) for name, t, is_param in weight_tensors(model) if not is_adapter(name))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _resharded(model: nn.Module) -> nn.Module:
    """`model` with every FSDP2 unit in its sharded state. A forward without backward (the trainer's no-grad
    scoring) leaves the root unit unsharded, its parameters then being views of an all-gather buffer that
    FSDP2 has freed: exported from there they have zero-byte storage (measured: a segfault in the engine's
    in-place load of a 1-rank trainer's export after a no-grad forward). Local, not collective."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def _export_dtype(tensor: torch.Tensor, is_param: bool, dtype: torch.dtype | None) -> torch.dtype:
    """Parameters are cast to `dtype`; buffers (the fp32 balancing biases) keep theirs."""
    return dtype if is_param and dtype is not None and tensor.is_floating_point() else tensor.dtype


def weight_specs(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF key, full shape, exported dtype) of every exported tensor, in export order; local, no gather
    (the family's naming runs on a meta tensor of the full shape)."""
    family = family_of(model)
    specs = []
    for name, tensor, is_param in _exported_tensors(model):
        out_dtype = _export_dtype(tensor, is_param, dtype)
        shell = torch.empty(tensor.shape, dtype=out_dtype, device="meta")
        specs += [(key, tuple(part.shape), out_dtype) for key, part in family.hf_tensors(name, shell)]
    return specs


@torch.no_grad()
def _iter_gathered(model: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict name, full tensor in its export dtype) one at a time; collective (each sharded
    parameter is all-gathered when its turn comes). Adapters are merged into their base tensors in fp32
    first (zrl.modeling.lora.merged_tensors: the tensor and its adapters gathered, one at a time)."""
    for name, full, is_param in merged_tensors(_resharded(model), full=_full):
        yield name, full.to(_export_dtype(full, is_param, dtype))


@torch.no_grad()
def iter_full_tensors(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, full tensor) one at a time, in `weight_specs` order; collective: every rank iterates
    to the end."""
    family = family_of(model)
    for name, full in _iter_gathered(model, dtype):
        yield from family.hf_tensors(name, full)


def iter_weight_buckets(model: nn.Module, *, version: int, dtype: torch.dtype | None = torch.bfloat16,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """Yield the full weights in HF key names, bucketed; collective (every rank iterates to the end)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size, index = 0, 0
    for name, full in iter_full_tensors(model, dtype):
        nbytes = full.numel() * full.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield WeightBucket(version=version, index=index, tensors=tuple(pending), last=False)
            pending, size, index = [], 0, index + 1
        pending.append((name, full))
        size += nbytes
    yield WeightBucket(version=version, index=index, tensors=tuple(pending), last=True)


def adapter_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT key -> full fp32 CPU tensor, adapter_config.json content) of the adapters: what an adapter-only
    weight sync sends (serving/lora_sync.py); collective (gathered module by module), every rank gets them."""
    return peft_adapter(_resharded(model), full=_full)


def export_peft_adapter(model: nn.Module, path: str | Path, *, version: int, base_model: str | None) -> None:
    """Collective: the adapters gathered module by module, rank 0 writes them as a PEFT adapter directory."""
    tensors, config = peft_adapter(_resharded(model), base_model=base_model, full=_full)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_peft_adapter(tensors, config, path)
        logger.info("exported the adapters of policy version %d to %s", version, path)
    if dist.is_initialized():
        dist.barrier()


def export_hf_checkpoint(model: nn.Module, path: str | Path, *, version: int, dtype: torch.dtype | None,
                         companion_dir: str | Path | None = None) -> None:
    """Collective: rank 0 writes config.json + safetensors (+ tokenizer files from `companion_dir`) with
    the model family's `save_hf_checkpoint`; the other ranks gather with it and drop what they got."""
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    state: dict[str, torch.Tensor] = {}
    for name, full in _iter_gathered(model, dtype):
        if is_writer:
            state[name] = full.cpu()
    if is_writer:
        path = Path(path)
        family_of(model).save_hf_checkpoint(state, path, config=model.config, dtype=dtype)
        if companion_dir is not None:
            for name in _COMPANION_FILES:
                src = Path(companion_dir) / name
                if src.exists():
                    shutil.copy2(src, path / name)
        logger.info("exported policy version %d to %s", version, path)
    if dist.is_initialized():
        dist.barrier()
