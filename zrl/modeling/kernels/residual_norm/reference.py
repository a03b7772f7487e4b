"""Pure-PyTorch definition of ZAYA1 residual scaling + add + RMSNorm (any device, autograd backward).

This is the model's math moved here from `zrl.moepp.blocks` unchanged, op for op, so the reference
backend gives the numbers the model always gave (bitwise). Everything runs in fp32 whatever the input
dtypes (RESIDUAL and RMSNORM of the FP32 op set, precision.py): inputs are cast to fp32 first, outputs
are fp32 and the consumer casts to its compute dtype.

  x      = (branch + hs_bias) * hs_scale + (residual + res_bias) * res_scale      [T, D] fp32
  normed = x * rsqrt(mean(x^2, -1) + eps) * norm_weight                           [T, D] fp32
"""

from __future__ import annotations

import torch

from zrl.modeling.precision import Fp32Op, to_op_dtype


def residual_scaling(branch: torch.Tensor, residual: torch.Tensor, hs_scale: torch.Tensor,
                     hs_bias: torch.Tensor, res_scale: torch.Tensor, res_bias: torch.Tensor) -> torch.Tensor:
    """(branch + hs_bias) * hs_scale + (residual + res_bias) * res_scale in fp32. [..., D] -> fp32."""
    def f32(t: torch.Tensor) -> torch.Tensor:
        return to_op_dtype(t, Fp32Op.RESIDUAL)

    scaled_branch = (f32(branch) + f32(hs_bias)) * f32(hs_scale)
    return scaled_branch + (f32(residual) + f32(res_bias)) * f32(res_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, statistics and product in fp32. [..., C] -> fp32, then cast to
    `out_dtype` if given."""
    x = to_op_dtype(x, Fp32Op.RMSNORM)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = x * to_op_dtype(weight, Fp32Op.RMSNORM)
    return y if out_dtype is None else y.to(out_dtype)


def scaled_residual_add_rmsnorm(
    branch: torch.Tensor, residual: torch.Tensor, hs_scale: torch.Tensor, hs_bias: torch.Tensor,
    res_scale: torch.Tensor, res_bias: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Residual scaling, then RMSNorm of its result (skipped when `norm_weight` is None).

    branch [..., D] (compute dtype), residual [..., D] (fp32), the vectors [D] -> (x, normed) fp32.
    """
    x = residual_scaling(branch, residual, hs_scale, hs_bias, res_scale, res_bias)
    return x, (None if norm_weight is None else rms_norm(x, norm_weight, eps))
