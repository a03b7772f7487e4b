"""SwiGLU experts and the MoE block of a ZAYA1 layer (top-1 routing with a skip class).

Experts are stored as two 3-D tensors, the HF `zaya` layout: `gate_up_proj` [E, 2F, D] (gate rows
first, then up rows) and `down_proj` [E, D, F]. Expert e maps x [D] to
  down_e (silu(gate_e x) * up_e x)        and the MoE output is gate_weight * that;
a token routed to the skip class (id E) gets a zero output and costs nothing.

The math lives in zrl/moepp/kernels/experts/ (`moe_experts`): on CUDA `torch._grouped_mm` (no host
synchronisation; the grouped-GEMM Triton kernels when forced), the pure-PyTorch reference elsewhere or
when forced (ZRL_KERNELS); all read the parameters in this layout, so the checkpoint never depends on
the backend.
"""

from __future__ import annotations

import torch
from torch import nn

from zrl.moepp.config import MoEPPConfig
from zrl.moepp.kernels.experts import moe_experts
from zrl.moepp.router import RouterOutput, ZayaRouter


class SwiGLUExperts(nn.Module):
    def __init__(self, config: MoEPPConfig) -> None:
        super().__init__()
        e, f, d = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, D] (compute dtype), expert_ids [T] in [0, E], gate [T] fp32 -> [T, D] fp32."""
        return moe_experts(x, expert_ids, gate, self.gate_up_proj, self.down_proj)

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)


class MoEBlock(nn.Module):
    """Router (`gate`) + experts; the checkpoint keys are `mlp.gate.*` and `mlp.experts.*`."""

    def __init__(self, config: MoEPPConfig, layer_idx: int) -> None:
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = SwiGLUExperts(config)

    def forward(self, x: torch.Tensor, prev_state: torch.Tensor | None,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterOutput]:
        """x [T, D] (normed) -> MoE output [T, D] fp32 and the routing decision."""
        routing = self.gate(x, prev_state, replay)
        return self.experts(x, routing.chosen, routing.gate), routing
