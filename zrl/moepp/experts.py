"""SwiGLU experts and the MoE block of a ZAYA1 layer (top-1 routing with a skip class).

Experts are stored as two 3-D tensors, the HF `zaya` layout: `gate_up_proj` [E, 2F, D] (gate rows
first, then up rows) and `down_proj` [E, D, F]. Expert e maps x [D] to
  down_e (silu(gate_e x) * up_e x)        and the MoE output is gate_weight * that;
a token routed to the skip class (id E) gets a zero output and costs nothing.

This is the pure-PyTorch reference: tokens are sorted by expert once, each expert runs on its
contiguous slice, and outputs are put back in token order. It synchronises with the host once per
layer (the per-expert counts); fused grouped-GEMM kernels come later in zrl/moepp/kernels/.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zrl.moepp.config import MoEPPConfig
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
        order = torch.argsort(expert_ids, stable=True)  # [T] tokens grouped by expert
        counts = torch.bincount(expert_ids, minlength=self.num_experts + 1).tolist()
        x_sorted = x.index_select(0, order).to(self.gate_up_proj.dtype)
        gate_sorted = gate.index_select(0, order)
        outs = []
        for expert, (xe, ge) in enumerate(zip(x_sorted.split(counts), gate_sorted.split(counts))):
            if expert == self.num_experts or xe.shape[0] == 0:
                outs.append(xe.new_zeros(xe.shape, dtype=torch.float32))  # skip class: zero output
                continue
            g, u = F.linear(xe, self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, F] each
            y = F.linear(F.silu(g) * u, self.down_proj[expert])  # [n, D]
            outs.append(y.float() * ge[:, None])
        y_sorted = torch.cat(outs, dim=0)  # [T, D] fp32
        return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)

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
