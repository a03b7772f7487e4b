"""GLM-4.5 model for the trainer: single-device PyTorch port of transformers' Glm4MoeForCausalLM
(DeepSeek-V3-style routing: sigmoid scores, a selection-only correction bias, group-limited top-k,
shared experts, dense first layers; partial RoPE) with packed varlen input, top-k router replay and the
fp32 LM-head log-probs of zrl.modeling.

See zrl/glm4_moe/README.md. Names are exported lazily so that `import zrl.glm4_moe.config` does not
import torch.
"""

from zrl.lazy_exports import module_getattr

_EXPORTS = {
    "Glm4MoEFamily": "family",
    "Glm4MoEConfig": "config",
    "DecoderLayer": "model", "Glm4MoEForCausalLM": "model", "Router": "model", "TopKRouting": "model",
    "SignBiasUpdate": "routing",
}

__all__ = sorted(_EXPORTS)

__getattr__ = module_getattr(__name__, _EXPORTS)
