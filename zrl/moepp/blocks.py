"""Small building blocks of the MoE++ model: RMSNorm and ZAYA1 residual scaling.

Both run in fp32 whatever the weight dtype (RMSNORM and RESIDUAL of the FP32 op set, precision.py):
they return fp32 and the consumer casts to its compute dtype. Parameter names match the HF `zaya`
checkpoint (`weight`; `hidden_states_scale/bias`, `residual_scale/bias`).
"""

from __future__ import annotations

import torch
from torch import nn

from zrl.moepp.precision import Fp32Op, to_op_dtype


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics and product in fp32. x: [..., C] -> fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_op_dtype(x, Fp32Op.RMSNORM)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * to_op_dtype(self.weight, Fp32Op.RMSNORM)

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
        def f32(t: torch.Tensor) -> torch.Tensor:
            return to_op_dtype(t, Fp32Op.RESIDUAL)

        scaled_branch = (f32(branch) + f32(self.hidden_states_bias)) * f32(self.hidden_states_scale)
        return scaled_branch + (f32(residual) + f32(self.residual_bias)) * f32(self.residual_scale)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.hidden_states_scale)
        nn.init.zeros_(self.hidden_states_bias)
        nn.init.ones_(self.residual_scale)
        nn.init.zeros_(self.residual_bias)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`layer(x)` in the layer's weight dtype (the compute dtype), whatever dtype `x` arrives in."""
    return layer(x.to(layer.weight.dtype))
