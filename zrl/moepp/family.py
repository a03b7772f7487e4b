"""MoE++ (ZAYA1, HF `zaya`) as a zrl.models `ModelFamily`: a thin adapter over this package.

Nothing here computes anything new: every method calls what the trainer called before the contract
(load_hf_checkpoint, optimizer_param_groups, BiasBalancer, routing_stats, save_hf_checkpoint,
to_hf_name), so MoE++ numbers are unchanged. Served by zrl's out-of-tree vLLM model
(serving/zaya_vllm.py), whose forward returns the routing: top-1 with a skip class, a [T, L] record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zrl.models.family import ROUTING_CAPTURE_MODEL_FORWARD, FlopModel, ModelFamily, ModelShape
from zrl.moepp.config import MODEL_TYPE, MoEPPConfig


class MoEPPFamily(ModelFamily):
    model_type = MODEL_TYPE
    vllm_architecture = "ZayaForCausalLM"
    routing_capture = ROUTING_CAPTURE_MODEL_FORWARD

    def parse_config(self, raw: dict[str, Any], *, strict: bool = True) -> MoEPPConfig:
        return MoEPPConfig.from_hf_dict(raw, strict=strict)

    def shape(self, config: MoEPPConfig) -> ModelShape:
        return ModelShape(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                          num_experts=config.num_experts, experts_per_token=1, skip_class=True)

    def flop_model(self, config: MoEPPConfig) -> FlopModel:
        import torch

        from zrl.moepp.model import MoEPPForCausalLM
        from zrl.moepp.params import count_parameters

        with torch.device("meta"):
            counts = count_parameters(MoEPPForCausalLM(config))
        return FlopModel(total_params=counts.total, active_params=counts.active_non_embedding,
                         num_layers=config.num_hidden_layers,
                         attention_dim=config.num_attention_heads * config.head_dim)

    def build(self, config: MoEPPConfig):
        from zrl.moepp.model import MoEPPForCausalLM

        return MoEPPForCausalLM(config)

    def load_state_dict(self, path: str | Path, *, dtype):
        from zrl.moepp.checkpoint import load_hf_checkpoint

        return load_hf_checkpoint(path, dtype=dtype).state_dict()

    def bias_balancer(self, model, *, lr: float):
        from zrl.moepp.routing import BiasBalancer

        return BiasBalancer.for_model(model, lr=lr)

    def routing_metrics(self, expert_counts) -> dict[str, float]:
        from zrl.moepp.routing import routing_stats

        rs = routing_stats(expert_counts)
        return {"routing/load_entropy_mean": float(rs.load_entropy.mean()),
                "routing/load_max": float(rs.load.max()),
                "routing/skip_frac_mean": float(rs.skip_fraction.mean())}

    def hf_tensors(self, name: str, tensor):
        from zrl.moepp.checkpoint import to_hf_name

        return [(to_hf_name(name), tensor)]

    def save_hf_checkpoint(self, state, path: str | Path, *, config: MoEPPConfig, dtype) -> None:
        from zrl.moepp.checkpoint import save_hf_checkpoint

        save_hf_checkpoint(state, path, config=config, dtype=dtype)
