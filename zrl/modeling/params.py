"""Optimizer parameter groups and parameter accounting of a model (every family's).

Grouping (the AMD platform paper §IV-B, the ZAYA1-8B report §IV-E; docs/algorithms.md §5): Muon for
matrix-valued hidden weights — every `nn.Linear` weight inside the decoder layers (q/k/v/o
projections, router down-projection and router MLP) and the 3-D expert tensors (E matrices each); AdamW for everything else —
embeddings, an untied LM head, all 1-D parameters (norms, biases, residual scales, key temperatures,
EDA coefficients) and the CCA convolution kernels. Balancing biases are buffers, not parameters:
they belong to MoE++'s routing.BiasBalancer.

Works on the meta device (for counting) and on FSDP2-wrapped models (names are unchanged).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from zrl.modeling.experts import SwiGLUExperts


def optimizer_param_groups(model: nn.Module) -> dict[str, dict[str, nn.Parameter]]:
    """{"muon": {name: param}, "adamw": {name: param}}, each trainable parameter exactly once."""
    muon_ids: set[int] = set()
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                muon_ids.add(id(module.weight))
            elif isinstance(module, SwiGLUExperts):
                muon_ids.update((id(module.gate_up_proj), id(module.down_proj)))
    groups: dict[str, dict[str, nn.Parameter]] = {"muon": {}, "adamw": {}}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups["muon" if id(param) in muon_ids else "adamw"][name] = param
    return groups


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter once (the tied embedding/LM head counted once)
    embedding: int  # embedding matrix (+ an untied LM head)
    expert: int  # all expert weights of all layers
    active: int  # used per token under top-k routing: total - (E - k)/E of the expert weights

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def active_non_embedding(self) -> int:
        return self.active - self.embedding


def count_parameters(model: nn.Module, *, experts_per_token: int = 1) -> ParameterCounts:
    """Parameter counts of a model with `embed_tokens`, `lm_head` (None when tied) and SwiGLUExperts of E
    experts each, of which a token uses `experts_per_token` (meta-device models included)."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed_tokens.weight.numel() + (0 if model.lm_head is None else model.lm_head.weight.numel())
    expert_ops = [m for m in model.modules() if isinstance(m, SwiGLUExperts)]
    expert = sum(p.numel() for m in expert_ops for p in m.parameters())
    num_experts = expert_ops[0].num_experts if expert_ops else 1
    inactive = expert // num_experts * (num_experts - experts_per_token)
    return ParameterCounts(total=total, embedding=embedding, expert=expert, active=total - inactive)
