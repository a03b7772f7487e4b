"""MoE++ (ZAYA1) model: single-device PyTorch implementation, HF `zaya` interchange, training hooks.

What is MoE++'s own: its config, CCA attention, the router with a skip class and EDA, residual scaling,
the decoder layer and model, its routing records and bias balancer, its family. What it shares with
other families (packing, log-probs, attention, experts, the FP32 op set...) is zrl.modeling's.
See zrl/moepp/README.md for the public API (shape letters: docs/shapes.md). Names are
exported lazily so that `import zrl.moepp.config` (the vLLM plugin, recipe validation) does not
import torch.
"""

from zrl.lazy_exports import module_getattr

_EXPORTS = {
    "hf_state_dict": "checkpoint", "load_hf_checkpoint": "checkpoint", "save_hf_checkpoint": "checkpoint",
    "MoEPPConfig": "config", "zaya1_8b_config": "config",
    "MoEPPFamily": "family",
    "DecoderLayer": "model", "MoEPPForCausalLM": "model",
    "BiasBalancer": "routing", "balancing_error": "routing",
}

__all__ = sorted(_EXPORTS)

__getattr__ = module_getattr(__name__, _EXPORTS)
