"""Qwen3-MoE model for the trainer: single-device PyTorch port of transformers' Qwen3MoeForCausalLM with
packed varlen input, top-k router replay and the fp32 LM-head log-probs of zrl.modeling.

See zrl/qwen3_moe/README.md (public API, routing record layout). Names are exported lazily so that
`import zrl.qwen3_moe.config` does not import torch.
"""

from zrl.lazy_exports import module_getattr

_EXPORTS = {
    "hf_state_dict": "checkpoint", "load_hf_checkpoint": "checkpoint", "save_hf_checkpoint": "checkpoint",
    "Qwen3MoEFamily": "family",
    "Qwen3MoEConfig": "config",
    "DecoderLayer": "model", "Qwen3MoEForCausalLM": "model", "TopKRouting": "model",
    "collect_routing": "routing", "validate_replay": "routing",
}

__all__ = sorted(_EXPORTS)

__getattr__ = module_getattr(__name__, _EXPORTS)
