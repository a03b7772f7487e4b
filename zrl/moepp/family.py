"""MoE++ (ZAYA1, HF `zaya`) as a zrl.models `ModelFamily`: a thin adapter over this package.

Nothing here computes anything new: every method calls this package's functions (the model, its
parameter counts, BiasBalancer, routing statistics with a skip class), or transformers' own
`ZayaForCausalLM` for the tiny CPU checkpoint. Its HF names: every tensor is
`model.<name>` (experts stay fused, as the `zaya` layout stores them), the balancing biases stay fp32.
Served by zrl's out-of-tree vLLM model (serving/zaya_vllm.py), whose forward returns the routing:
top-1 with a skip class, a [T, L] record.
"""

from __future__ import annotations

from typing import Any

from zrl.modeling.hf_names import HFNames
from zrl.models.family import ROUTING_CAPTURE_MODEL_FORWARD, LoRAModules, ModelFamily, ModelShape
from zrl.moepp.config import MODEL_TYPE, MoEPPConfig


class MoEPPFamily(ModelFamily):
    model_type = MODEL_TYPE
    vllm_architecture = "ZayaForCausalLM"
    routing_capture = ROUTING_CAPTURE_MODEL_FORWARD
    hf_names = HFNames(MODEL_TYPE, fp32=("balancing_biases",))
    # CCA's convolutions and the router MLP (read by the fused routing op) take no adapters; the router's
    # down-projection is an ordinary Linear.
    lora_modules = LoRAModules(
        attention=("layers.*.self_attn.qkv_proj.q_proj", "layers.*.self_attn.qkv_proj.k_proj",
                   "layers.*.self_attn.qkv_proj.v_proj_current", "layers.*.self_attn.qkv_proj.v_proj_delayed",
                   "layers.*.self_attn.o_proj"),
        experts=("layers.*.mlp.experts",),
        router=("layers.*.mlp.gate.down_proj",))
    tiny_config = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention backend supports head sizes from 32 up
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=1,
        router_hidden_size=32,
        max_position_embeddings=1024,
        cca_time0=2,
        cca_time1=2,
        tie_word_embeddings=True,
    )

    def parse_config(self, raw: dict[str, Any], *, strict: bool = True) -> MoEPPConfig:
        return MoEPPConfig.from_hf_dict(raw, strict=strict)

    def shape(self, config: MoEPPConfig) -> ModelShape:
        return ModelShape(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                          num_experts=config.num_experts, experts_per_token=1, skip_class=True)

    def build(self, config: MoEPPConfig):
        from zrl.moepp.model import MoEPPForCausalLM

        return MoEPPForCausalLM(config)

    def bias_balancer(self, model, *, lr: float):
        from zrl.moepp.routing import BiasBalancer

        return BiasBalancer.for_model(model, lr=lr)

    def routing_metrics(self, expert_counts) -> dict[str, float]:
        from zrl.modeling.routing import routing_stats

        rs = routing_stats(expert_counts, skip_class=True)
        return {"routing/load_entropy_mean": float(rs.load_entropy.mean()),
                "routing/load_max": float(rs.load.max()),
                "routing/skip_frac_mean": float(rs.skip_fraction.mean())}

    def new_tiny_model(self, hf_config: dict[str, Any]):
        """transformers' own `ZayaForCausalLM` (the `zaya` layout is the interchange format, README), key
        temperatures set to 1."""
        import torch
        from transformers import ZayaConfig, ZayaForCausalLM

        model = ZayaForCausalLM(ZayaConfig(**hf_config))
        with torch.no_grad():
            # transformers initialises the per-KV-head key temperature to 0, i.e. uniform attention until
            # it is learned; the tiny demo model must learn in minutes, so it starts at 1.
            for name, param in model.named_parameters():
                if name.endswith("qk_norm.temp"):
                    param.fill_(1.0)
        return model
