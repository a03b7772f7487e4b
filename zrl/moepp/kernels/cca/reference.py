"""CCA preconditioner in pure PyTorch: the definition of what the Triton kernel computes.

From the q/k projections' outputs to the q/k that enter attention (shapes: T tokens, Hq query heads,
Hk KV heads, d head dim, C = (Hq + Hk) d, Hq / Hk query heads per KV head):
  mean skip     q_res = (q + repeat_kv(k)) / 2 [T, Hq, d], k_res = mean of q_res over each KV group
  convolutions  [q, k] [T, C] -> causal depthwise Conv1d (kernel k0) -> causal grouped Conv1d
                (kernel k1, Hq + Hk groups of d channels); the history before a document is zero at
                the *input* of the first convolution, so both biases reach the first tokens
  residual      q = conv_q + q_res, k = conv_k + k_res
  QK-norm       q, k scaled to L2 norm sqrt(d), k multiplied by temp[kv head]
  partial RoPE  rotate-half on the first rotary_dim channels of every head

Everything runs in fp32 (precision.py: QK_MEAN, CCA_STATE, QK_NORM); the casts below are the model's
own, so the model's reference path gives the numbers it gave before the kernel existed (bitwise).

Invariant: no token reads a token of another document (`doc_offset` bounds every look-back).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.modeling.rope import apply_partial_rope


def mean_skip(q: torch.Tensor, k: torch.Tensor, num_q_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq d], k [T, Hk d] -> q_res [T, Hq, d], k_res [T, Hk, d] (fp32, QK_MEAN)."""
    t, groups = q.shape[0], num_q_heads // num_kv_heads
    q, k = to_op_dtype(q, Fp32Op.QK_MEAN), to_op_dtype(k, Fp32Op.QK_MEAN)
    q_res = (q.view(t, num_q_heads, head_dim)
             + k.view(t, num_kv_heads, head_dim).repeat_interleave(groups, dim=1)) * 0.5  # [T, Hq, d]
    k_res = q_res.view(t, num_kv_heads, groups, head_dim).mean(dim=2)  # [T, Hk, d]
    return q_res, k_res


def causal_convs(qk: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor, gr_weight: torch.Tensor,
                 gr_bias: torch.Tensor, doc_offset: torch.Tensor, num_docs: int | None = None) -> torch.Tensor:
    """Both causal convolutions with zero history per document. qk [T, C] -> [T, C] fp32 (CCA_STATE).

    dw_weight [C, 1, k0], dw_bias [C], gr_weight [C, d, k1], gr_bias [C]; `doc_offset` [T] = tokens
    since the token's document start; `num_docs` the number of documents, when the caller has it on the
    host (`PackedLayout.num_docs`). The stream is laid out with P = k0 + k1 - 2 zero columns before
    each document; running the convolutions without padding over it gives, for a token at padded
    column p, the window [p - P, p], which never reaches into the previous document. The document count
    sizes the padded stream: without `num_docs` it is read from the device, a host synchronisation. This
    layout is also the fastest of the PyTorch formulations tried on CPU (a per-token window gather was
    about 2x slower and its backward was not bitwise reproducible under thread contention).
    """
    t, channels = qk.shape
    history = dw_weight.shape[-1] - 1 + gr_weight.shape[-1] - 1
    doc_idx = torch.cumsum(doc_offset == 0, dim=0) - 1  # [T] document of each token
    if num_docs is None:
        num_docs = int(doc_idx[-1]) + 1 if t else 0
    conv_index = torch.arange(t, device=qk.device) + history * (doc_idx + 1)  # [T] column in the padded stream
    padded = qk.new_zeros(t + history * num_docs, channels, dtype=torch.float32)
    padded = padded.index_copy(0, conv_index, to_op_dtype(qk, Fp32Op.CCA_STATE))  # [T + N P, C]
    h = F.conv1d(padded.t()[None], to_op_dtype(dw_weight, Fp32Op.CCA_STATE), to_op_dtype(dw_bias, Fp32Op.CCA_STATE),
                 groups=channels)
    h = F.conv1d(h, to_op_dtype(gr_weight, Fp32Op.CCA_STATE), to_op_dtype(gr_bias, Fp32Op.CCA_STATE),
                 groups=channels // gr_weight.shape[1])  # [1, C, T + N P - P]
    return h[0].t().index_select(0, conv_index - history)


def cca_mix(q: torch.Tensor, k: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
            gr_weight: torch.Tensor, gr_bias: torch.Tensor, doc_offset: torch.Tensor, num_q_heads: int,
            num_kv_heads: int, head_dim: int, convs: Callable = causal_convs) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean skip + convolutions + residual: q [T, Hq d], k [T, Hk d] -> [T, Hq, d], [T, Hk, d] fp32.
    `convs`: how the convolutions run (`causal_convs`'s contract; library.py has the GEMM formulation)."""
    t = q.shape[0]
    # One cast each: both uses' gradients then add up in fp32 before the single cast back (bf16 mode).
    q, k = to_op_dtype(q, Fp32Op.QK_MEAN), to_op_dtype(k, Fp32Op.QK_MEAN)
    q_res, k_res = mean_skip(q, k, num_q_heads, num_kv_heads, head_dim)
    qk = torch.cat([q, k], dim=-1)  # [T, C]
    conv = convs(qk, dw_weight, dw_bias, gr_weight, gr_bias, doc_offset)  # [T, C]
    q_out = conv[:, : num_q_heads * head_dim].view(t, num_q_heads, head_dim) + q_res
    k_out = conv[:, num_q_heads * head_dim:].view(t, num_kv_heads, head_dim) + k_res
    return q_out, k_out


def qk_norm(q: torch.Tensor, k: torch.Tensor, temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, d], k [T, Hk, d] -> L2 norm sqrt(d) each (fp32, QK_NORM), k times temp [Hk]."""
    q, k = to_op_dtype(q, Fp32Op.QK_NORM), to_op_dtype(k, Fp32Op.QK_NORM)
    scale = q.shape[-1] ** 0.5
    eps = torch.finfo(torch.float32).eps  # only guards an all-zero vector
    q = q * (scale / q.norm(dim=-1, keepdim=True).clamp_min(eps))
    k = k * (scale / k.norm(dim=-1, keepdim=True).clamp_min(eps))
    return q, k * to_op_dtype(temp, Fp32Op.QK_NORM)[None, :, None]


def cca_precondition(q: torch.Tensor, k: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
                     gr_weight: torch.Tensor, gr_bias: torch.Tensor, temp: torch.Tensor, doc_offset: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, convs: Callable = causal_convs) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole preconditioner (see the module docstring): -> q [T, Hq, d], k [T, Hk, d] fp32."""
    q_out, k_out = cca_mix(q, k, dw_weight, dw_bias, gr_weight, gr_bias, doc_offset, num_q_heads, num_kv_heads,
                           head_dim, convs)
    q_out, k_out = qk_norm(q_out, k_out, temp)
    return apply_partial_rope(q_out, cos, sin), apply_partial_rope(k_out, cos, sin)
