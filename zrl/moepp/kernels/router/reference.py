"""Pure-PyTorch router head: the definition of what the fused router kernel computes.

From the post-EDA latent r [T, R] (compute dtype) to the routing decision (E + 1 = C classes):
  xn     = RMSNorm(r)                              fp32 (RMSNORM), then cast to the compute dtype
  h1     = gelu(fc1(xn)), h2 = gelu(fc2(h1))       compute dtype (the weights' dtype), exact-erf GELU
  logits = out(h2)                                 [T, C] compute dtype, no bias
  probs  = softmax(logits)                         fp32 (ROUTER_SOFTMAX)
  native = argmax(probs + balancing_biases)        first index on ties; no gradient through the biases
  chosen = native where replay is None or NO_ROUTE (no record), else replay
  gate   = probs[chosen]                           fp32, the only differentiable output

The casts are those the model used before the kernel existed (RouterMLP + ZayaRouter), so this path
reproduces its numbers bitwise. Replay ids must be in [0, C - 1] or NO_ROUTE (the model checks
them once per forward in routing.validate_replay); an id outside that range fails in the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zrl.modeling.kernels.residual_norm.reference import rms_norm
from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.types import NO_ROUTE


def router_logits(r: torch.Tensor, norm_weight: torch.Tensor, fc1_weight: torch.Tensor,
                  fc1_bias: torch.Tensor, fc2_weight: torch.Tensor, fc2_bias: torch.Tensor,
                  out_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm -> fc1 -> GELU -> fc2 -> GELU -> out: r [T, R] -> logits [T, C] in the weights' dtype."""
    xn = rms_norm(r, norm_weight, eps)  # [T, R] fp32 (the model's RMSNorm, RMSNORM op)
    h = F.gelu(F.linear(xn.to(fc1_weight.dtype), fc1_weight, fc1_bias))  # [T, R]
    h = F.gelu(F.linear(h.to(fc2_weight.dtype), fc2_weight, fc2_bias))  # [T, R]
    return F.linear(h.to(out_weight.dtype), out_weight)  # [T, C]


def route_from_logits(logits: torch.Tensor, balancing_biases: torch.Tensor,
                      replay: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax, biased argmax, replay override and gather: logits [T, C] -> (gate, chosen, native) [T]."""
    probs = torch.softmax(to_op_dtype(logits, Fp32Op.ROUTER_SOFTMAX), dim=-1)  # [T, C] fp32
    native = torch.argmax(probs.detach() + balancing_biases.float(), dim=-1)  # [T]
    chosen = native if replay is None else torch.where(replay == NO_ROUTE, native, replay)
    # Advanced indexing (not gather + select) returns a fresh tensor, not a view: FSDP2 warns on
    # views returned from a wrapped layer.
    gate = probs[torch.arange(probs.shape[0], device=probs.device), chosen]  # [T]
    return gate, chosen, native


def route(r: torch.Tensor, norm_weight: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
          fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
          balancing_biases: torch.Tensor, replay: torch.Tensor | None,
          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole router head, see the module docstring. Returns gate [T] fp32, chosen and native [T] int64."""
    logits = router_logits(r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, eps)
    return route_from_logits(logits, balancing_biases, replay)
