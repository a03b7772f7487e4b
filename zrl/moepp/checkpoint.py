"""Hugging Face `zaya` checkpoint interchange: load and save config.json + safetensors.

The names are the family's declaration (family.MoEPPFamily.hf_names; zrl.modeling.hf_names gives the
rules): `model.<name>` for every parameter and buffer, `lm_head.weight` for an untied head (a tied head
is not stored; transformers re-ties it on load), experts fused as the `zaya` layout stores them.
Loading takes every tensor from the checkpoint, balancing biases included — transformers'
`from_pretrained` resets the skip-class bias to -1 after loading (its `_init_weights` writes
`balancing_biases[-1]`; measured with transformers 5.19), this loader does not.

Invariants: a load checks that the checkpoint holds exactly the model's tensors with the model's
shapes (zrl.modeling.hf_io); balancing biases are kept in fp32 whatever `dtype` the weights load in; a
saved directory loads back into transformers' `ZayaForCausalLM`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from zrl.modeling import hf_io
from zrl.moepp.config import MoEPPConfig
from zrl.moepp.family import MoEPPFamily
from zrl.moepp.model import MoEPPForCausalLM


def load_hf_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                       strict_config: bool = True) -> MoEPPForCausalLM:
    """Build the model described by `path`/config.json and load every tensor of the checkpoint."""
    return MoEPPFamily().load_model(path, dtype=dtype, device=device, strict_config=strict_config)


def save_hf_checkpoint(model_or_state: MoEPPForCausalLM | Mapping[str, torch.Tensor], path: str | Path, *,
                       config: MoEPPConfig | None = None, dtype: torch.dtype | None = None,
                       max_shard_bytes: int | None = None) -> None:
    """Write config.json + safetensors (sharded with an index when larger than `max_shard_bytes`).

    Pass a model, or a full state dict of this package's keys plus its `config` (e.g. the state dict
    an FSDP2 trainer gathers on rank 0).
    """
    if isinstance(model_or_state, MoEPPForCausalLM):
        config = config or model_or_state.config
        state = model_or_state.state_dict()
    elif config is None:
        raise ValueError("saving a state dict needs its config")
    else:
        state = dict(model_or_state)
    MoEPPFamily().save_hf_checkpoint(state, path, config=config, dtype=dtype, max_shard_bytes=max_shard_bytes)


def hf_state_dict(state_dict: Mapping[str, torch.Tensor], *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A full state dict of this package's model -> its HF checkpoint tensors (contiguous CPU copies)."""
    return hf_io.hf_state_dict(state_dict, MoEPPFamily.hf_names, dtype=dtype)
