"""Small building blocks every model shares: RMSNorm, and linear layers in their weights' dtype.

RMSNorm runs in fp32 whatever the weight dtype (RMSNORM of the FP32 op set, precision.py): it returns
fp32 and the consumer casts to its compute dtype. Its parameter is `weight`, as in Hugging Face
checkpoints. The math lives in the fused op `zrl.modeling.kernels.residual_norm` (Triton kernel or its
PyTorch reference, by backend); the module holds the parameter and calls it, so the checkpoint layout is
the same on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from zrl.modeling.kernels.residual_norm import rms_norm
from zrl.modeling.precision import Fp32Op, to_op_dtype


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics and product in fp32. x: [..., C] -> fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """fp32 (RMSNORM), or rounded to `out_dtype` for a consumer that would cast it so (see `rms_norm`)."""
        return rms_norm(x, self.weight, self.eps, out_dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """`layer(x)` in the layer's weight dtype (the compute dtype), whatever dtype `x` arrives in."""
    return layer(x.to(layer.weight.dtype))


def linears(x: torch.Tensor, layers: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """`layer(x)` for each of `layers` (one input, e.g. an attention block's q, k, v), x cast once to their
    weights' dtype. Plain `nn.Linear`s (their forward is nn.Linear's) of one bias kind run as one GEMM over
    their weights concatenated, as a serving engine's merged projection does: the backward then forms x's
    gradient in one GEMM, where one per layer would be summed in more passes over x's shape. Otherwise (a
    LoRA adapter's forward, say) they run one by one. The outputs of the one GEMM are column slices of it."""
    x = x.to(layers[0].weight.dtype)
    biases = [layer.bias for layer in layers]
    if (all(type(layer).forward is nn.Linear.forward for layer in layers)
            and len({bias is None for bias in biases}) == 1):
        bias = None if biases[0] is None else torch.cat(biases)
        out = F.linear(x, torch.cat([layer.weight for layer in layers]), bias)
        return list(out.split([layer.out_features for layer in layers], dim=-1))
    return [layer(x) for layer in layers]


class PreNormDecoderLayer(nn.Module):
    """The forward pass of the decoder layers laid out as Llama's: x + attn(norm(x)), then x + mlp(norm(x)),
    the residual stream in fp32. A family's layer builds, in its own order (the parameters' order is the
    checkpoint's and the optimizer's), `input_layernorm`, `self_attn(x, layout, rope)` (x in its `q_proj`'s
    dtype), `post_attention_layernorm` and `mlp`: a dense MLP(x), or where `is_moe` a MoE block (x, replay) ->
    (fp32 output, routing)."""

    is_moe: bool

    def forward(self, x: torch.Tensor, layout, rope, replay: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, object]:
        """x [T, D] fp32 -> x [T, D] fp32 and this layer's routing (None for a dense layer)."""
        # the norm written in the q, k, v projections' dtype: what they would cast it to (no cast pass, half the bytes)
        normed = self.input_layernorm(x, self.self_attn.q_proj.weight.dtype)
        x = x + to_op_dtype(self.self_attn(normed, layout, rope), Fp32Op.RESIDUAL)
        normed = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + to_op_dtype(self.mlp(normed), Fp32Op.RESIDUAL), None
        h, routing = self.mlp(normed, replay)
        return x + h, routing
