"""The CCA preconditioner's two convolutions as shifted sums and one batched GEMM on the unpadded stream.

The reference (reference.py, the definition) lays the stream out with zero columns before each
document and runs two `F.conv1d`s (cuDNN on CUDA) over it, sized by the document count. Here the same
values come from the unpadded stream, with no count at all, for a token t at offset o(t) in its
document (w0 [C, k0], b0 the depthwise convolution; W1 [C, d, k1], b1 the grouped one):
  h(t)      = b0 + sum_{a < k0} w0[:, k0-1-a] x(t-a) [o(t) >= a]   zero history at the first input
  h_tau(t)  = h(t-tau) if o(t) >= tau, else b0                     the first convolution's output
                                                                   over that zero history
  out(t)    = b1 + sum_{tau < k1} W1[:, :, k1-1-tau] h_tau(t)       per group of d channels
The grouped products are one `torch.baddbmm` over the Hq + Hk groups: [G, T, k1 d] x [G, k1 d, d],
the k1 lagged copies of h side by side along K. Everything is fp32 (CCA_STATE; the trainer keeps cuBLAS's
fp32 GEMMs off TF32, `precision.fp32_without_tf32`). Mean skip, residual, QK-norm and RoPE stay the
reference's: it takes these as `convs`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zrl.modeling.precision import Fp32Op, to_op_dtype


def _lagged(x: torch.Tensor, lag: int, doc_offset: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
    """Row t: x(t - lag) where that token is in t's document (o(t) >= lag), else `fill`. x [T, C]."""
    if lag == 0:
        return x
    shifted = F.pad(x, (0, 0, lag, 0))[: x.shape[0]]
    return torch.where((doc_offset >= lag)[:, None], shifted, fill)


def causal_convs(qk: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor, gr_weight: torch.Tensor,
                 gr_bias: torch.Tensor, doc_offset: torch.Tensor) -> torch.Tensor:
    """`reference.causal_convs`'s contract and values: qk [T, C] -> [T, C] fp32, computed as above."""
    t, channels = qk.shape
    k0, (_, d, k1) = dw_weight.shape[-1], gr_weight.shape
    groups = channels // d
    x = to_op_dtype(qk, Fp32Op.CCA_STATE)
    w0, b0 = to_op_dtype(dw_weight, Fp32Op.CCA_STATE)[:, 0], to_op_dtype(dw_bias, Fp32Op.CCA_STATE)  # [C, k0], [C]
    h = b0 + sum(w0[:, k0 - 1 - a] * _lagged(x, a, doc_offset, 0.0) for a in range(k0))  # [T, C]
    taps = torch.stack([_lagged(h, tau, doc_offset, b0).view(t, groups, d) for tau in range(k1)], dim=2)
    b1 = to_op_dtype(gr_bias, Fp32Op.CCA_STATE).view(groups, 1, d)
    out = torch.baddbmm(b1, taps.view(t, groups, k1 * d).transpose(0, 1),
                        gemm_weight(to_op_dtype(gr_weight, Fp32Op.CCA_STATE)))
    return out.transpose(0, 1).reshape(t, channels)  # [G, T, d] -> [T, C]


def gemm_weight(gr_weight: torch.Tensor) -> torch.Tensor:
    """The grouped convolution's weight [C, d, k1] as the batched GEMM's [G, k1 d, d]: row tau d + i,
    column o of group g holds gr_weight[g d + o, i, k1-1-tau] (lag tau's taps at columns tau d .. tau d + d)."""
    channels, d, k1 = gr_weight.shape
    return gr_weight.view(channels // d, d, d, k1).flip(-1).permute(0, 3, 2, 1).reshape(channels // d, k1 * d, d)
