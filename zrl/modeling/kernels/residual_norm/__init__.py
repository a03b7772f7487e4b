"""Residual scaling + add + RMSNorm of the MoE++ model: the public ops and their backend dispatch.

`scaled_residual_add_rmsnorm` is ZAYA1's residual scaling followed by the next RMSNorm, in fp32
(RESIDUAL and RMSNORM of precision.py); `rms_norm` is the plain RMSNorm. Both are differentiable
w.r.t. every tensor argument. The Triton kernels (triton_kernel.py) run when `use_triton` (op
"residual_norm" of the kernels' switch) says so (CUDA + Triton under "auto", or forced); otherwise the
PyTorch reference (reference.py), which is the definition and gives the model's historical numbers
bitwise. Shapes: [..., D] activations (usually [T, D]), [D] vectors; outputs fp32 of the
activation's shape.
"""

from __future__ import annotations

import torch

from zrl.modeling import kernels
from zrl.modeling.kernels.residual_norm import reference

__all__ = ["rms_norm", "scaled_residual_add_rmsnorm"]


def use_triton(x: torch.Tensor) -> bool:
    """Whether both ops run their Triton kernels on `x` (the kernels' switch, op "residual_norm")."""
    return kernels.use_triton(x, "residual_norm")


def _check_vector(name: str, v: torch.Tensor, dim: int) -> None:
    if v.shape != (dim,):
        raise ValueError(f"{name} must have shape ({dim},) to match the activations' last dim, "
                         f"got {tuple(v.shape)}")


def scaled_residual_add_rmsnorm(
    branch: torch.Tensor, residual: torch.Tensor, hs_scale: torch.Tensor, hs_bias: torch.Tensor,
    res_scale: torch.Tensor, res_bias: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x = (branch + hs_bias) * hs_scale + (residual + res_bias) * res_scale and, unless `norm_weight`
    is None, normed = x / sqrt(mean(x^2) + eps) * norm_weight; both fp32.

    branch: [..., D] compute dtype (the block's output); residual: [..., D] fp32 (the stream);
    vectors: [D]. Returns (x, normed) with normed None when norm_weight is None.
    """
    if branch.shape != residual.shape or branch.dim() == 0:
        raise ValueError(f"branch {tuple(branch.shape)} and residual {tuple(residual.shape)} must have "
                         f"the same [..., D] shape")
    dim = branch.shape[-1]
    for name, v in (("hs_scale", hs_scale), ("hs_bias", hs_bias), ("res_scale", res_scale),
                    ("res_bias", res_bias), ("norm_weight", norm_weight)):
        if v is not None:
            _check_vector(name, v, dim)
    if use_triton(branch):
        from zrl.modeling.kernels.residual_norm.triton_kernel import scaled_residual_add_rmsnorm as fused
        return fused(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps)
    return reference.scaled_residual_add_rmsnorm(branch, residual, hs_scale, hs_bias, res_scale, res_bias,
                                                 norm_weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight in fp32. x: [..., C] any float dtype, weight [C] -> fp32, or
    `out_dtype`: the fp32 result rounded to it (the Triton kernel writes bf16 directly, for a consumer that
    computes in bf16: the same values as its own cast, half the bytes written, no cast pass)."""
    if x.dim() == 0:
        raise ValueError("rms_norm needs a [..., C] tensor, got a scalar")
    _check_vector("weight", weight, x.shape[-1])
    if use_triton(x):
        from zrl.modeling.kernels.residual_norm.triton_kernel import rms_norm as fused
        return fused(x, weight, eps, out_dtype)
    return reference.rms_norm(x, weight, eps, out_dtype)
