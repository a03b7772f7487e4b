"""Hugging Face checkpoint interchange of every family: config.json + safetensors, keyed by the family's
declared names (hf_names.HFNames).

Loading reads safetensors directly (one file, or shards listed in model.safetensors.index.json) into a
model built on the meta device from the checkpoint's config, and takes every tensor from the checkpoint
(buffers such as MoE++'s balancing biases included; transformers' `from_pretrained` may re-initialise
some after loading, this loader does not). Saving writes what transformers and vLLM read.

Invariants: a load checks that the checkpoint holds exactly the model's tensors with the model's shapes
(missing, unexpected, incomplete or mis-shaped keys raise); tensors the names keep in fp32 stay fp32
whatever `dtype` the weights load or save in; a tied head is not saved.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zrl.modeling.hf_names import EXPERT_PROJECTIONS, HFNames

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def iter_checkpoint_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) for every tensor of a checkpoint directory, single-file or sharded."""
    path = Path(path)
    if (path / INDEX_FILE).exists():
        with open(path / INDEX_FILE, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_FILE).exists():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for file in files:
        with safe_open(path / file, framework="pt") as f:
            for key in f.keys():
                if weight_map and weight_map.get(key) != file:
                    raise ValueError(f"{file} holds {key!r}, which the index maps to {weight_map.get(key)!r}")
                yield key, f.get_tensor(key)


def load_into(model: torch.nn.Module, path: str | Path, names: HFNames, *, dtype: torch.dtype,
              device: torch.device | str) -> torch.nn.Module:
    """Load every tensor of checkpoint directory `path` into `model` (built on the meta device from the
    checkpoint's config; its `config.tie_word_embeddings` says whether the head is tied); returns it."""
    tie = model.config.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # module -> projection -> expert -> tensor
    tied_head = None
    skipped = 0
    for hf_key, tensor in iter_checkpoint_tensors(path):
        name = names.param_name(hf_key)
        if names.unused(name, len(model.layers)):
            skipped += 1
            continue
        if name == names.lm_head and tie:
            # Some exporters store the tied head anyway; accept it only if it is the embedding.
            tied_head = tensor
            continue
        target = torch.float32 if names.keeps_fp32(name) else dtype
        tensor = tensor.to(device=device, dtype=target if tensor.is_floating_point() else tensor.dtype)
        part = names.expert_part(name)
        if part is None:
            state[name] = tensor
        else:
            module, expert, projection = part
            experts.setdefault(module, {}).setdefault(projection, {})[expert] = tensor
    expected = model.state_dict()
    for module, projections in experts.items():
        num_experts = expected[f"{module}.down_proj"].shape[0] if f"{module}.down_proj" in expected else 0
        state.update(_fused_experts(names.hf_key(module), module, projections, num_experts))
    _check_keys(expected, state, names)
    if skipped:
        logger.info("skipped %d tensors of layers past the config's %d (%s does not run them)", skipped,
                    len(model.layers), names.model_type)
    model.load_state_dict(state, strict=True, assign=True)
    embedding = model.embed_tokens.weight
    if tied_head is not None and not torch.equal(tied_head.to(embedding), embedding):
        raise ValueError(f"config ties the LM head to the embedding but {names.lm_head} differs from it")
    return model


def _fused_experts(hf_module: str, module: str, projections: dict[str, dict[int, torch.Tensor]],
                   num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down matrices -> `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]."""
    for projection in EXPERT_PROJECTIONS:
        found = sorted(projections.get(projection, {}))
        if found != list(range(num_experts)):
            raise KeyError(f"{hf_module}.<e>.{projection}.weight must exist for experts 0..{num_experts - 1}, "
                           f"found {found}")

    def stacked(projection: str) -> torch.Tensor:
        return torch.stack([projections[projection][e] for e in range(num_experts)])

    return {f"{module}.gate_up_proj": torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1),
            f"{module}.down_proj": stacked("down_proj")}


def _check_keys(expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], names: HFNames) -> None:
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"checkpoint does not match the config: missing {[names.hf_key(k) for k in missing]}, "
                       f"unexpected {[names.hf_key(k) for k in unexpected]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{names.hf_key(name)} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(expected[name].shape)}")


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], names: HFNames, *,
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A (full, unsharded) state dict -> HF keys, contiguous CPU tensors, optionally cast (tensors the
    names keep in fp32 excepted). Tensors that share storage are copied (safetensors refuses aliases)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and not names.keeps_fp32(name):
            t = t.to(dtype)
        out.update((key, part.to("cpu").contiguous().clone()) for key, part in names.hf_tensors(name, t))
    return out


def hf_checkpoint_keys(model: torch.nn.Module, names: HFNames) -> frozenset[str]:
    """The HF keys of a complete checkpoint of `model` (built on the meta device: only names and shapes)."""
    return frozenset(key for name, tensor in model.state_dict().items() for key, _ in names.hf_tensors(name, tensor))


def save_hf_checkpoint(state: Mapping[str, torch.Tensor], path: str | Path, names: HFNames, *, config: Any,
                       dtype: torch.dtype | None = None, max_shard_bytes: int | None = None) -> None:
    """Write config.json (the family config's `save_json`) + safetensors of a full state dict (sharded with
    an index when larger than `max_shard_bytes`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_json(path)
    save_safetensors(hf_state_dict(state, names, dtype=dtype), path, max_shard_bytes)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None) -> None:
    """`tensors` (HF names) as safetensors in `path`: one file, or shards with an index when larger than
    `max_shard_bytes` (the layout transformers reads)."""
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], path / SINGLE_FILE, metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(path / INDEX_FILE, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    logger.info("saved %d tensors in %d shards to %s", len(tensors), len(shards), path)


def _split_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_bytes is None:
        return [tensors]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    return shards
