"""The ZAYA1 router head as one op: RMSNorm -> fc1+GELU -> fc2+GELU -> logits -> softmax -> biased
argmax -> replay override -> gate. The down-projection and EDA stay outside (a GEMM and an axpy).

`route` validates shapes and dispatches (zrl.moepp.kernels, op "router") to the fused Triton kernels
(triton_kernel.py) or to the PyTorch reference (reference.py, the definition, which gives the
model's historical numbers bitwise). Both take and return the same things; the gradient reaches r
and every weight/bias through `gate` only.
"""

from __future__ import annotations

import torch

from zrl.modeling.kernels import use_triton
from zrl.moepp.kernels.router.reference import route_from_logits, router_logits
from zrl.moepp.kernels.router.reference import route as route_reference

__all__ = ["route", "route_from_logits", "router_logits"]


def route(r: torch.Tensor, norm_weight: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
          fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
          balancing_biases: torch.Tensor, replay: torch.Tensor | None,
          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing decision of T tokens among C = E + 1 classes (the last is the skip class).

    r [T, R] post-EDA latent (compute dtype); norm_weight, fc1_bias, fc2_bias [R]; fc1_weight,
    fc2_weight [R, R]; out_weight [C, R]; balancing_biases [C] fp32 (no gradient); replay [T] int ids
    in [0, C - 1] or zrl.types.NO_ROUTE (not range-checked here: that needs a host sync; the model
    checks once per forward), or None. Returns gate [T] fp32 = softmax(logits)[chosen], chosen [T]
    int64 (replay where given, else native), native [T] int64 = argmax(probs + balancing_biases).
    """
    if r.dim() != 2:
        raise ValueError(f"r must be [T, R], got shape {tuple(r.shape)}")
    t, size = r.shape
    expected = {"norm_weight": (norm_weight, (size,)), "fc1_weight": (fc1_weight, (size, size)),
                "fc1_bias": (fc1_bias, (size,)), "fc2_weight": (fc2_weight, (size, size)),
                "fc2_bias": (fc2_bias, (size,)), "out_weight": (out_weight, (out_weight.shape[0], size)),
                "balancing_biases": (balancing_biases, (out_weight.shape[0],))}
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for R = {size}, got {tuple(tensor.shape)}")
    if replay is not None and (replay.shape != (t,) or replay.dtype.is_floating_point):
        raise ValueError(f"replay must be [T] = [{t}] integer ids, got {tuple(replay.shape)} {replay.dtype}")
    if use_triton(r, "router"):
        from zrl.moepp.kernels.router.triton_kernel import route as route_triton

        return route_triton(r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
                            balancing_biases, replay, eps)
    return route_reference(r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
                           balancing_biases, replay, eps)
