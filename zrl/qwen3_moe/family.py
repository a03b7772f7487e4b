"""Qwen3-MoE (HF `qwen3_moe`) as a zrl.models `ModelFamily`: an adapter over this package.

Served by vLLM's built-in `Qwen3MoeForCausalLM`; the routing is captured by a capture function bound
on every MoE layer's router (README "Rollout side"), a [T, L * k] record with no skip class. Its HF
names: `model.<name>`, the fused expert tensors stored one matrix per expert (the Hub's files, what
transformers and vLLM's loader read). There are no router balancing biases:
`algorithm.router_bias_update` is refused.
"""

from __future__ import annotations

from typing import Any

from zrl.modeling.hf_names import HFNames
from zrl.models.family import ROUTING_CAPTURE_ROUTER_HOOK, LoRAModules, ModelFamily, ModelShape
from zrl.qwen3_moe.config import MODEL_TYPE, Qwen3MoEConfig


class Qwen3MoEFamily(ModelFamily):
    model_type = MODEL_TYPE
    vllm_architecture = "Qwen3MoeForCausalLM"
    routing_capture = ROUTING_CAPTURE_ROUTER_HOOK
    hf_names = HFNames(MODEL_TYPE, per_expert=True)
    lora_modules = LoRAModules(
        attention=("layers.*.self_attn.q_proj", "layers.*.self_attn.k_proj", "layers.*.self_attn.v_proj",
                   "layers.*.self_attn.o_proj"),
        experts=("layers.*.mlp.experts",),
        dense_mlp=("layers.*.mlp.gate_proj", "layers.*.mlp.up_proj", "layers.*.mlp.down_proj"),
        router=("layers.*.mlp.gate",))
    tiny_config = dict(
        hidden_size=64,
        intermediate_size=96,  # the dense layers' MLP width
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention backend supports head sizes from 32 up
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # one dense layer between two sparse ones
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )

    def parse_config(self, raw: dict[str, Any], *, strict: bool = True) -> Qwen3MoEConfig:
        return Qwen3MoEConfig.from_hf_dict(raw, strict=strict)

    def shape(self, config: Qwen3MoEConfig) -> ModelShape:
        return ModelShape(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                          num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                          skip_class=False)

    def build(self, config: Qwen3MoEConfig):
        from zrl.qwen3_moe.model import Qwen3MoEForCausalLM

        return Qwen3MoEForCausalLM(config)

    def routing_metrics(self, expert_counts) -> dict[str, float]:
        """Load entropy (normalised by ln E) and max load over the sparse layers (dense layers' rows are 0)."""
        from zrl.modeling.routing import routing_stats

        rows = expert_counts[expert_counts.sum(dim=1) > 0]  # [Lm, E]
        if rows.shape[0] == 0:
            return {}
        rs = routing_stats(rows, skip_class=False)
        return {"routing/load_entropy_mean": float(rs.load_entropy.mean()), "routing/load_max": float(rs.load.max())}

    def new_tiny_model(self, hf_config: dict[str, Any]):
        """transformers' own `Qwen3MoeForCausalLM` (random initialisation; transformers 5.19 saves the
        experts one by one, the Hub's layout)."""
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config))
