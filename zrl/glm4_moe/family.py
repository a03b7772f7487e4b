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
from zrl.models.family import ROUTING_CAPTURE_ROUTER_HOOK, LoRAModules, ModelFamily, ModelShape


class Glm4MoEFamily(ModelFamily):
    model_type = MODEL_TYPE
    vllm_architecture = "Glm4MoeForCausalLM"
    routing_capture = ROUTING_CAPTURE_ROUTER_HOOK
    hf_names = HFNames(MODEL_TYPE, per_expert=True, fp32=("e_score_correction_bias",),
                       layers_beyond_config_unused=True)
    # The router is absent: its forward reads `weight` itself (fp32 logits for the grouped top-k).
    lora_modules = LoRAModules(
        attention=("layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj",
                   "layers.*.self_attn.o_proj"),
        experts=("layers.*.mlp.experts",),
        dense_mlp=("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj",
                   "layers.*.mlp.shared_experts.gate_proj", "layers.*.mlp.shared_experts.up_proj",
                   "layers.*.mlp.shared_experts.down_proj"))
    tiny_config = dict(
        hidden_size=64,
        intermediate_size=96,  # the dense first layer's MLP width
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention backend supports head sizes from 32 up
        partial_rotary_factor=0.5,  # GLM-4.5's: RoPE on the first half of each head
        attention_bias=True,
        use_qk_norm=False,  # as GLM-4.5-Air
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,  # group-limited routing: the best 2 of 4 groups of 2 experts
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,  # one dense layer before two sparse ones
        num_nextn_predict_layers=0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )

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

    def new_tiny_model(self, hf_config: dict[str, Any]):
        """transformers' own `Glm4MoeForCausalLM` (random initialisation, correction biases 0 as at the
        start of pre-training; experts saved one by one, the Hub's layout)."""
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        return Glm4MoeForCausalLM(Glm4MoeConfig(**hf_config))
