"""E SwiGLU experts as two fused tensors, applied to tokens routed to one expert each.

Experts are stored as two 3-D tensors (the HF `zaya` layout, and transformers' in-memory layout of
other MoE families): `gate_up_proj` [E, 2F, D] (gate rows first, then up rows) and `down_proj`
[E, D, F]. Expert e maps x [D] to
  down_e (silu(gate_e x) * up_e x)        and the output is gate_weight * that;
a token routed to id E (a skip class, where the family has one) gets a zero output and costs nothing.
A top-k family repeats each token k times (one row per chosen expert) and sums the k outputs.

The math lives in zrl/modeling/kernels/experts/ (`moe_experts`): on CUDA `torch._grouped_mm` (no host
synchronisation; the grouped-GEMM Triton kernels when forced), the pure-PyTorch reference elsewhere or
when forced (ZRL_KERNELS); all read the parameters in this layout, so the checkpoint never depends on
the backend.
"""

from __future__ import annotations

import torch
from torch import nn

from zrl.modeling.kernels.experts import moe_experts


class SwiGLUExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, f, d = num_experts, intermediate_size, hidden_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, f))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, D] (compute dtype), expert_ids [T] in [0, E], gate [T] fp32 -> [T, D] fp32."""
        return moe_experts(x, expert_ids, gate, self.gate_up_proj, self.down_proj)

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)
