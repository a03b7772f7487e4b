"""MoE++ (ZAYA1) model: single-device PyTorch implementation, HF `zaya` interchange, training hooks.

See zrl/moepp/README.md for the FP32 op set and the public API (shape letters: docs/shapes.md). Names are
exported lazily so that `import zrl.moepp.config` (the vLLM plugin, recipe validation) does not
import torch.
"""

import importlib

_EXPORTS = {
    "load_hf_checkpoint": "checkpoint", "save_hf_checkpoint": "checkpoint",
    "ConfigError": "config", "MoEPPConfig": "config", "zaya1_8b_config": "config",
    "MoEPPFamily": "family",
    "chunked_token_logprobs": "logprobs",
    "CausalLMOutput": "model", "DecoderLayer": "model", "MoEPPForCausalLM": "model", "TokenLogprobs": "model",
    "ParameterCounts": "params", "count_parameters": "params", "optimizer_param_groups": "params",
    "FP32_OPS": "precision", "Fp32Op": "precision",
    "BiasBalancer": "routing", "RoutingInfo": "routing", "RoutingStats": "routing",
    "balancing_error": "routing", "routing_stats": "routing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zrl.moepp' has no attribute {name!r}")
    return getattr(importlib.import_module(f"zrl.moepp.{_EXPORTS[name]}"), name)
