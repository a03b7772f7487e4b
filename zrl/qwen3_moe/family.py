"""Qwen3-MoE (HF `qwen3_moe`) as a zrl.models `ModelFamily`: an adapter over this package.

Served by vLLM's built-in `Qwen3MoeForCausalLM`; the routing is captured by a capture function bound
on every MoE layer's router (README "Rollout side"), a [T, L * k] record with no skip class. Weight
sync and export send the per-expert HF keys that loader reads (checkpoint.hf_named_tensors). There
are no router balancing biases: `algorithm.router_bias_update` is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zrl.models.family import ROUTING_CAPTURE_ROUTER_HOOK, FlopModel, ModelFamily, ModelShape
from zrl.qwen3_moe.config import MODEL_TYPE, Qwen3MoEConfig


class Qwen3MoEFamily(ModelFamily):
    model_type = MODEL_TYPE
    vllm_architecture = "Qwen3MoeForCausalLM"
    routing_capture = ROUTING_CAPTURE_ROUTER_HOOK

    def parse_config(self, raw: dict[str, Any], *, strict: bool = True) -> Qwen3MoEConfig:
        return Qwen3MoEConfig.from_hf_dict(raw, strict=strict)

    def shape(self, config: Qwen3MoEConfig) -> ModelShape:
        return ModelShape(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                          num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                          skip_class=False)

    def flop_model(self, config: Qwen3MoEConfig) -> FlopModel:
        import torch

        from zrl.moepp.experts import SwiGLUExperts
        from zrl.qwen3_moe.model import Qwen3MoEForCausalLM

        with torch.device("meta"):
            model = Qwen3MoEForCausalLM(config)
        total = sum(p.numel() for p in model.parameters())
        embedding = model.embed_tokens.weight.numel() + (0 if model.lm_head is None else model.lm_head.weight.numel())
        expert = sum(p.numel() for m in model.modules() if isinstance(m, SwiGLUExperts) for p in m.parameters())
        inactive = expert // config.num_experts * (config.num_experts - config.num_experts_per_tok)
        return FlopModel(total_params=total, active_params=total - embedding - inactive,
                         num_layers=config.num_hidden_layers,
                         attention_dim=config.num_attention_heads * config.head_dim)

    def build(self, config: Qwen3MoEConfig):
        from zrl.qwen3_moe.model import Qwen3MoEForCausalLM

        return Qwen3MoEForCausalLM(config)

    def load_state_dict(self, path: str | Path, *, dtype):
        from zrl.qwen3_moe.checkpoint import load_hf_checkpoint

        return load_hf_checkpoint(path, dtype=dtype).state_dict()

    def routing_metrics(self, expert_counts) -> dict[str, float]:
        """Load entropy (normalised by ln E) and max load over the sparse layers (dense layers' rows are 0)."""
        import torch

        from zrl.moepp.routing import routing_stats

        rows = expert_counts[expert_counts.sum(dim=1) > 0]  # [Lm, E]
        if rows.shape[0] == 0:
            return {}
        # MoE++'s statistics of the routed experts, with an empty skip column appended
        rs = routing_stats(torch.cat([rows, rows.new_zeros(rows.shape[0], 1)], dim=1))
        return {"routing/load_entropy_mean": float(rs.load_entropy.mean()), "routing/load_max": float(rs.load.max())}

    def hf_tensors(self, name: str, tensor):
        from zrl.qwen3_moe.checkpoint import hf_named_tensors

        return hf_named_tensors(name, tensor)

    def save_hf_checkpoint(self, state, path: str | Path, *, config: Qwen3MoEConfig, dtype) -> None:
        from zrl.qwen3_moe.checkpoint import save_hf_checkpoint

        save_hf_checkpoint(state, path, config=config, dtype=dtype)
