"""Hugging Face `zaya` checkpoint interchange: load and save config.json + safetensors.

Key names: the HF checkpoint is `model.<name>` for every parameter of this package's model and
`lm_head.weight` for an untied head; a tied head is not stored (transformers re-ties it on load).
Loading reads safetensors directly (one file, or shards listed in model.safetensors.index.json) and
takes every tensor from the checkpoint, balancing biases included — transformers' `from_pretrained`
resets the skip-class bias to -1 after loading (its `_init_weights` writes `balancing_biases[-1]`;
measured with transformers 5.19), this loader does not.

Invariants: a load checks that the checkpoint holds exactly the model's tensors with the model's
shapes (missing, unexpected or mis-shaped keys raise); balancing biases are kept in fp32 whatever
`dtype` the weights load in; a saved directory loads back into transformers' `ZayaForCausalLM`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from zrl.moepp.config import MoEPPConfig
from zrl.moepp.model import MoEPPForCausalLM

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_HF_PREFIX = "model."
_HF_LM_HEAD = "lm_head.weight"


def to_hf_name(name: str) -> str:
    """This package's state-dict key -> the HF checkpoint key."""
    return name if name == _HF_LM_HEAD else _HF_PREFIX + name


def from_hf_name(name: str) -> str:
    """HF checkpoint key -> this package's state-dict key."""
    if name == _HF_LM_HEAD:
        return name
    if not name.startswith(_HF_PREFIX):
        raise KeyError(f"unexpected checkpoint key {name!r} (zaya keys start with {_HF_PREFIX!r} or are "
                       f"{_HF_LM_HEAD!r})")
    return name[len(_HF_PREFIX):]


def _keeps_fp32(name: str) -> bool:
    return name.endswith("balancing_biases")


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


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    strict_config: bool = True,
) -> MoEPPForCausalLM:
    """Build the model described by `path`/config.json and load every tensor of the checkpoint."""
    config = MoEPPConfig.from_pretrained_dir(path, strict=strict_config)
    with torch.device("meta"):
        model = MoEPPForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    tied_head = None
    for hf_key, tensor in iter_checkpoint_tensors(path):
        name = from_hf_name(hf_key)
        if name == _HF_LM_HEAD and config.tie_word_embeddings:
            # Some exporters store the tied head anyway; accept it only if it is the embedding.
            tied_head = tensor
            continue
        target = torch.float32 if _keeps_fp32(name) else dtype
        state[name] = tensor.to(device=device, dtype=target if tensor.is_floating_point() else tensor.dtype)
    _check_keys(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    if tied_head is not None and not torch.equal(tied_head.to(model.embed_tokens.weight), model.embed_tokens.weight):
        raise ValueError(f"config ties the LM head to the embedding but {_HF_LM_HEAD} differs from it")
    return model


def _check_keys(model: MoEPPForCausalLM, state: Mapping[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"checkpoint does not match the config: missing {[to_hf_name(k) for k in missing]}, "
                       f"unexpected {[to_hf_name(k) for k in unexpected]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"{to_hf_name(name)} has shape {tuple(tensor.shape)}, the config implies "
                             f"{tuple(expected[name].shape)}")


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This package's (full, unsharded) state dict -> HF keys, contiguous CPU tensors, optionally cast.

    Balancing biases stay fp32. Tensors that share storage are copied (safetensors refuses aliases).
    """
    out = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point() and not _keeps_fp32(name):
            t = t.to(dtype)
        out[to_hf_name(name)] = t.to("cpu").contiguous().clone()
    return out


def save_hf_checkpoint(
    model_or_state: MoEPPForCausalLM | Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    config: MoEPPConfig | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json + safetensors (sharded with an index when larger than `max_shard_bytes`).

    Pass a model, or a full state dict of this package's keys plus its `config` (e.g. the state dict
    an FSDP2 trainer gathers on rank 0).
    """
    if isinstance(model_or_state, MoEPPForCausalLM):
        config = config or model_or_state.config
        state = model_or_state.state_dict()
    else:
        if config is None:
            raise ValueError("saving a state dict needs its config")
        state = dict(model_or_state)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_json(path)
    save_safetensors(hf_state_dict(state, dtype=dtype), path, max_shard_bytes)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, max_shard_bytes: int | None) -> None:
    """`tensors` (HF names) as safetensors in `path`: one file, or shards with an index when larger than
    `max_shard_bytes` (the layout transformers reads); shared by every architecture's checkpoints."""
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
