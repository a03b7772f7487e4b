"""Qwen3-MoE model for the trainer: single-device PyTorch port of transformers' Qwen3MoeForCausalLM with
packed varlen input, top-k router replay and the fp32 LM-head log-probs of zrl.modeling.

See zrl/qwen3_moe/README.md (public API, routing record layout). Names are exported lazily so that
`import zrl.qwen3_moe.config` does not import torch.
"""

import importlib

_EXPORTS = {
    "hf_state_dict": "checkpoint", "load_hf_checkpoint": "checkpoint", "save_hf_checkpoint": "checkpoint",
    "Qwen3MoEFamily": "family",
    "Qwen3MoEConfig": "config",
    "DecoderLayer": "model", "Qwen3MoEForCausalLM": "model", "TopKRouting": "model",
    "collect_routing": "routing", "validate_replay": "routing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zrl.qwen3_moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zrl.qwen3_moe.{_EXPORTS[name]}"), name)
