"""Small building blocks of the MoE++ model: RMSNorm and ZAYA1 residual scaling.

Both run in fp32 whatever the weight dtype (RMSNORM and RESIDUAL of the FP32 op set, precision.py):
they return fp32 and the consumer casts to its compute dtype. Parameter names match the HF `zaya`
checkpoint (`weight`; `hidden_states_scale/bias`, `residual_scale/bias`). The math lives in the
fused op `zrl.moepp.kernels.residual_norm` (Triton kernel or its PyTorch reference, by backend);
these modules hold the parameters and call it, so the checkpoint layout is the same on every backend.
"""

from __future__ import annotations

import torch
from torch import nn

from zrl.moepp.kernels.residual_norm import rms_norm, scaled_residual_add_rmsnorm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics and product in fp32. x: [..., C] -> fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


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


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`layer(x)` in the layer's weight dtype (the compute dtype), whatever dtype `x` arrives in."""
    return layer(x.to(layer.weight.dtype))
