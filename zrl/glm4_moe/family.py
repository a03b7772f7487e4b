"""GLM-4.5 (HF `glm4_moe`) as a zrl.models `ModelFamily`: an adapter over this package.

Served by vLLM's built-in `Glm4MoeForCausalLM`; the routing is captured by a capture function bound on
every MoE layer's router (the grouped top-k ids vLLM selected with the correction bias), a [T, L * k]
record with no skip class. Its HF names: `model.<name>`, the fused expert tensors stored one matrix per
expert (the Hub's files), `e_score_correction_bias` kept fp32, multi-token-prediction layers stored
after the decoder skipped. The correction bias is frozen during RL unless the recipe sets
`algorithm.router_bias_update`, which runs DeepSeek-V3's update (routing.SignBiasUpdate).
"""

from __future__ import annotations

from typing import Any

from zrl.glm4_moe.config import MODEL_TYPE, Glm4MoEConfig
from zrl.modeling.hf_names import HFNames
from zrl.models.family import ROUTING_CAPTURE_ROUTER_HOOK, ModelFamily, ModelShape


class Glm4MoEFamily(ModelFamily):
    model_type = MODEL_TYPE
    vllm_architecture = "Glm4MoeForCausalLM"
    routing_capture = ROUTING_CAPTURE_ROUTER_HOOK
    hf_names = HFNames(MODEL_TYPE, per_expert=True, fp32=("e_score_correction_bias",),
                       layers_beyond_config_unused=True)

    def parse_config(self, raw: dict[str, Any], *, strict: bool = True) -> Glm4MoEConfig:
        return Glm4MoEConfig.from_hf_dict(raw, strict=strict)

    def shape(self, config: Glm4MoEConfig) -> ModelShape:
        return ModelShape(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                          num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok,
                          skip_class=False)

    def build(self, config: Glm4MoEConfig):
        from zrl.glm4_moe.model import Glm4MoEForCausalLM

        return Glm4MoEForCausalLM(config)

    def bias_balancer(self, model, *, lr: float):
        """DeepSeek-V3's correction-bias update, `lr` its speed u (routing.SignBiasUpdate)."""
        from zrl.glm4_moe.routing import SignBiasUpdate

        return SignBiasUpdate.for_model(model, update_speed=lr)

    def routing_metrics(self, expert_counts) -> dict[str, float]:
        """Load entropy (normalised by ln E) and max load over the sparse layers (dense layers' rows are 0)."""
        from zrl.modeling.routing import routing_stats

        rows = expert_counts[expert_counts.sum(dim=1) > 0]  # [Lm, E]
        if rows.shape[0] == 0:
            return {}
        rs = routing_stats(rows, skip_class=False)
        return {"routing/load_entropy_mean": float(rs.load_entropy.mean()), "routing/load_max": float(rs.load.max())}
