"""Hugging Face `qwen3_moe` checkpoint interchange: load and save config.json + safetensors.

The names are the family's declaration (family.Qwen3MoEFamily.hf_names; zrl.modeling.hf_names gives
the rules): `model.<name>`, `lm_head.weight` for an untied head, experts one matrix per expert (the
Hub's files, what transformers 5.19's `save_pretrained` writes and vLLM's loader reads), a checkpoint
in transformers' fused in-memory layout also loading. Invariants: a saved directory loads back into
transformers' `Qwen3MoeForCausalLM` and into this loader unchanged; a load checks that the checkpoint
holds exactly the model's tensors with the model's shapes (zrl.modeling.hf_io).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from zrl.modeling import hf_io
from zrl.qwen3_moe.config import Qwen3MoEConfig
from zrl.qwen3_moe.family import Qwen3MoEFamily
from zrl.qwen3_moe.model import Qwen3MoEForCausalLM


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                       strict_config: bool = True) -> Qwen3MoEForCausalLM:
    """Build the model described by `path`/config.json and load every tensor of the checkpoint."""
    return Qwen3MoEFamily().load_model(path, dtype=dtype, device=device, strict_config=strict_config)


def save_hf_checkpoint(model_or_state: Qwen3MoEForCausalLM | Mapping[str, torch.Tensor], path: str | Path, *,
                       config: Qwen3MoEConfig | None = None, dtype: torch.dtype | None = None,
                       max_shard_bytes: int | None = None) -> None:
    """Write config.json + safetensors (sharded with an index when larger than `max_shard_bytes`).

    Pass a model, or a full state dict of this package's keys plus its `config`.
    """
    if isinstance(model_or_state, Qwen3MoEForCausalLM):
        config = config or model_or_state.config
        state = model_or_state.state_dict()
    elif config is None:
        raise ValueError("saving a state dict needs its config")
    else:
        state = dict(model_or_state)
    Qwen3MoEFamily().save_hf_checkpoint(state, path, config=config, dtype=dtype, max_shard_bytes=max_shard_bytes)


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A full state dict of this package's model -> its HF checkpoint tensors (contiguous CPU copies)."""
    return hf_io.hf_state_dict(state_dict, Qwen3MoEFamily.hf_names, dtype=dtype)
