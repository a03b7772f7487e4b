"""ZAYA1 residual scaling: (h + b_h) * s_h + (r + b_r) * s_r, in fp32 (RESIDUAL of the FP32 op set).

Parameter names match the HF `zaya` checkpoint (`hidden_states_scale/bias`, `residual_scale/bias`). The
math lives in the fused op `zrl.modeling.kernels.residual_norm` (Triton kernel or its PyTorch reference,
by backend), which can also apply the next RMSNorm in the same pass (`add_and_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from zrl.modeling.blocks import RMSNorm
from zrl.modeling.kernels.residual_norm import scaled_residual_add_rmsnorm


class ResidualScaling(nn.Module):
    """ZAYA1 residual scaling: (h + b_h) * s_h + (r + b_r) * s_r, in fp32 (h: branch, r: residual)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(size))
        self.hidden_states_bias = nn.Parameter(torch.zeros(size))
        self.residual_scale = nn.Parameter(torch.ones(size))
        self.residual_bias = nn.Parameter(torch.zeros(size))

    def forward(self, branch: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """branch [..., D] (compute dtype), residual [..., D] fp32 -> the new residual stream, fp32."""
        x, _ = scaled_residual_add_rmsnorm(branch, residual, self.hidden_states_scale, self.hidden_states_bias,
                                           self.residual_scale, self.residual_bias, None, 0.0)
        return x

    def add_and_norm(self, branch: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` followed by `norm` of its result in one fused pass: (x, norm(x)), both fp32.

        Uses `norm`'s parameters directly (call it inside the module that owns both, e.g. the decoder
        layer, so FSDP2 has gathered them)."""
        x, normed = scaled_residual_add_rmsnorm(
            branch, residual, self.hidden_states_scale, self.hidden_states_bias, self.residual_scale,
            self.residual_bias, norm.weight, norm.eps)
        return x, normed

    def reset_parameters(self) -> None:
        nn.init.ones_(self.hidden_states_scale)
        nn.init.zeros_(self.hidden_states_bias)
        nn.init.ones_(self.residual_scale)
        nn.init.zeros_(self.residual_bias)
