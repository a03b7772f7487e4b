"""Hugging Face `qwen3_moe` checkpoint interchange: load and save config.json + safetensors.

Key names: `model.<name>` for this package's parameters, `lm_head.weight` for an untied head (as
zrl.moepp.checkpoint). Experts are read in either layout a checkpoint may hold:
- per expert (the Hub's Qwen3 files, and what transformers 5.19's `save_pretrained` writes):
  `...mlp.experts.<e>.gate_proj.weight` [F, D], `up_proj.weight` [F, D], `down_proj.weight` [D, F];
- fused (transformers' in-memory layout, this model's parameters): `...mlp.experts.gate_up_proj`
  [E, 2F, D] (gate rows, then up rows) and `...mlp.experts.down_proj` [E, D, F].
Saving writes the per-expert layout (what the Hub's files, transformers and vLLM's Qwen3-MoE loader
read). Invariants: a saved directory loads back into transformers' `Qwen3MoeForCausalLM` and into this
loader unchanged; a load checks that the checkpoint holds exactly the model's tensors with the model's
shapes (missing, unexpected, incomplete or mis-shaped experts raise).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from zrl.moepp.checkpoint import from_hf_name, iter_checkpoint_tensors, save_safetensors, to_hf_name
from zrl.qwen3_moe.config import Qwen3MoEConfig
from zrl.qwen3_moe.model import Qwen3MoEForCausalLM

_HF_LM_HEAD = "lm_head.weight"
_FUSED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_hf_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    strict_config: bool = True,
) -> Qwen3MoEForCausalLM:
    """Build the model described by `path`/config.json and load every tensor of the checkpoint."""
    config = Qwen3MoEConfig.from_pretrained_dir(path, strict=strict_config)
    with torch.device("meta"):
        model = Qwen3MoEForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # prefix -> projection -> expert -> tensor
    tied_head = None
    for hf_key, tensor in iter_checkpoint_tensors(path):
        name = from_hf_name(hf_key)
        tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        if name == _HF_LM_HEAD and config.tie_word_embeddings:
            tied_head = tensor  # some exporters store the tied head anyway; accepted if equal
            continue
        match = _PER_EXPERT.match(name)
        if match:
            prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
            experts.setdefault(prefix, {}).setdefault(projection, {})[expert] = tensor
        else:
            state[name] = tensor
    for prefix, projections in experts.items():
        state.update(_fused_experts(prefix, projections, config.num_experts))
    _check_keys(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    if tied_head is not None and not torch.equal(tied_head, model.embed_tokens.weight):
        raise ValueError(f"config ties the LM head to the embedding but {_HF_LM_HEAD} differs from it")
    return model


def _fused_experts(prefix: str, projections: dict[str, dict[int, torch.Tensor]],
                   num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down matrices -> `gate_up_proj` [E, 2F, D] and `down_proj` [E, D, F]."""
    for projection in ("gate_proj", "up_proj", "down_proj"):
        found = sorted(projections.get(projection, {}))
        if found != list(range(num_experts)):
            raise KeyError(f"model.{prefix}.<e>.{projection}.weight must exist for experts 0..{num_experts - 1}, "
                           f"found {found}")

    def stacked(projection: str) -> torch.Tensor:
        return torch.stack([projections[projection][e] for e in range(num_experts)])

    return {f"{prefix}.gate_up_proj": torch.cat([stacked("gate_proj"), stacked("up_proj")], dim=1),
            f"{prefix}.down_proj": stacked("down_proj")}


def _check_keys(model: Qwen3MoEForCausalLM, state: dict[str, torch.Tensor]) -> None:
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


def hf_named_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One tensor of this package's state dict -> its HF key(s) and tensor(s), on the same device: a
    fused expert tensor becomes per-expert matrices (views), anything else is renamed."""
    match = _FUSED.match(name)
    if match is None:
        return [(to_hf_name(name), tensor)]
    prefix, fused = f"model.{match.group(1)}", match.group(2)
    out = []
    for expert, matrix in enumerate(tensor):
        if fused == "down_proj":  # [D, F]
            out.append((f"{prefix}.{expert}.down_proj.weight", matrix))
        else:  # [2F, D]: gate rows, then up rows
            gate, up = matrix.chunk(2, dim=0)
            out += [(f"{prefix}.{expert}.gate_proj.weight", gate), (f"{prefix}.{expert}.up_proj.weight", up)]
    return out


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This package's (full, unsharded) state dict -> HF keys with per-expert matrices, contiguous CPU
    tensors, optionally cast. A tied head is not stored (transformers re-ties it on load)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out.update((key, part.to("cpu").contiguous().clone()) for key, part in hf_named_tensors(name, t))
    return out


def save_hf_checkpoint(
    model_or_state: Qwen3MoEForCausalLM | Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    config: Qwen3MoEConfig | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json + safetensors (sharded with an index when larger than `max_shard_bytes`).

    Pass a model, or a full state dict of this package's keys plus its `config`.
    """
    if isinstance(model_or_state, Qwen3MoEForCausalLM):
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
