"""CCA preconditioner: mean skip + two causal convolutions + QK-norm + temperature + partial RoPE.

`cca_precondition` is the one entry point the model calls. Under `resolve("cca", q)`:
  "triton"     the grouped convolution as one batched cuBLAS GEMM, the depthwise convolution's taps
               before it and everything after it in Triton (triton_kernel.py)
  "library"    the same convolutions, with the reference's PyTorch ops after them
  "reference"  the definition (reference.py): cuDNN convolutions over a padded stream, PyTorch ops
"auto" runs the reference on CUDA until the probe measures one of the others faster (README, "Choice on
CUDA").
"""

from __future__ import annotations

import functools

import torch

from zrl.modeling import kernels
from zrl.moepp.kernels.cca import library, reference


def cca_precondition(q: torch.Tensor, k: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
                     gr_weight: torch.Tensor, gr_bias: torch.Tensor, temp: torch.Tensor, doc_offset: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, num_docs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k projections -> the q/k that enter attention (T tokens, C = (Hq + Hk) d channels).

    q [T, Hq d], k [T, Hk d]: the projections' outputs (compute dtype).
    dw_weight [C, 1, k0], dw_bias [C]: depthwise convolution; gr_weight [C, d, k1], gr_bias [C]:
    grouped convolution (Hq + Hk groups); temp [Hk]: key temperature.
    doc_offset [T] int64: tokens since the start of each token's document (no look-back past it).
    cos, sin [T, rotary_dim / 2] fp32 (rotary_dim may be 0): rotate-half RoPE tables.
    num_docs: the number of documents where the caller has it on the host (the reference then reads
    nothing from the device; without it, it reads the count once).
    Returns q [T, Hq, d], k [T, Hk, d] fp32. Differentiable w.r.t. q, k, the convolutions' weights and
    biases and temp (not cos/sin, not doc_offset).
    """
    choice = kernels.resolve("cca", q)
    if choice == "triton":
        from zrl.moepp.kernels.cca import triton_kernel  # lazy: Triton picks interpreter/compiler at import

        return triton_kernel.cca_precondition(q, k, dw_weight, dw_bias, gr_weight, gr_bias, temp, doc_offset, cos,
                                              sin, num_q_heads, num_kv_heads, head_dim)
    convs = library.causal_convs if choice == "library" else functools.partial(reference.causal_convs,
                                                                                num_docs=num_docs)
    return reference.cca_precondition(q, k, dw_weight, dw_bias, gr_weight, gr_bias, temp, doc_offset, cos, sin,
                                      num_q_heads, num_kv_heads, head_dim, convs=convs)


__all__ = ["cca_precondition"]
