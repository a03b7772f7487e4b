"""Compressed Convolutional Attention (CCA / CCGQA) of the ZAYA1 model, on packed token streams.

Per layer (shapes: T tokens, Hq query heads, Hk KV heads, d head_dim, C = (Hq + Hk) d):
  q = W_q x [T, Hq d], k = W_k x [T, Hk d]
  mean skip: q_res = (q + repeat_kv(k)) / 2 per query head, k_res = mean of q_res over each KV group
  [q, k] -> causal depthwise Conv1d (kernel k0) -> causal grouped Conv1d (kernel k1, Hq + Hk groups);
            history before a document is zero *at the input* of the first convolution, so the conv
            biases do flow into the first tokens (as in the reference, which left-pads with zeros)
  q = conv_q + q_res, k = conv_k + k_res
  v = [W_vc x_t, W_vd x_{t-1}] (x_{t-1} = 0 at a document start, so that half is W_vd's bias there)
  QK-norm: q, k scaled to L2 norm sqrt(d); k multiplied by a per-KV-head temperature (linear)
  partial RoPE (rotate-half) on the first `rotary_dim` channels of each head, causal GQA attention
Everything from the mean skip to RoPE runs in fp32 (CCA_STATE, QK_MEAN, QK_NORM) as one op,
`kernels.cca.cca_precondition` (the fused Triton kernel on CUDA, its PyTorch reference otherwise, which
holds the math); projections and attention run in the compute dtype. Parameter names match the HF `zaya` checkpoint (`qkv_proj.*`,
`qk_norm.temp`, `o_proj`).

Attention over a packed stream is one kernel launch on CUDA, however many documents it holds:
`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 with cumulative boundaries, causal inside
each document, grouped-query heads natively) when the compute dtype is bf16/fp16 on an sm80+ GPU and
torch's varlen_attn takes `window_size` (2.11 does; 2.12 added an `enable_gqa` flag, 2.11 passes the
grouped heads straight through to FlashAttention). Chosen over FlexAttention because it needs no
torch.compile: nothing is compiled per token count (which changes every step), no BlockMask is built
per microbatch, and forward and backward are FlashAttention's own; over SDPA with a mask because a
[T, T] mask at 131k tokens does not fit. It needs the longest document length on the host, which
`PackedLayout.seq_lens` already holds. Everywhere else (CPU, fp32, older torch or GPUs) attention runs
per document (`per_document_causal_attention`: SDPA, one batched call when all documents have the
same length), which is exact and is the reference the CUDA path is tested against.

Invariant: no operation mixes tokens of different documents (see packing.PackedLayout).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from zrl.moepp.blocks import linear
from zrl.moepp.config import MoEPPConfig
from zrl.moepp.kernels.cca import cca_precondition
from zrl.moepp.kernels.cca.reference import apply_partial_rope, cca_mix, qk_norm
from zrl.moepp.packing import PackedLayout

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without it: attention runs per document
    varlen_attn = None

__all__ = ["CCAProjection", "CCAttention", "QKNorm", "apply_partial_rope", "causal_attention",
           "per_document_causal_attention", "rope_cos_sin", "varlen_attention_applies"]


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] (fp32) for rotate-half RoPE at integer `positions` [T].

    Frequencies theta^(-2i / rotary_dim), computed in fp32 like the reference (and vLLM) so that
    angles at large positions round identically.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)  # [rotary_dim / 2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    return angles.cos(), angles.sin()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """Causal GQA attention inside each document. q [T, Hq, d], k/v [T, Hk, d] -> [T, Hq, d]. Scale d^-1/2.

    One varlen FlashAttention call where it applies (see the module docstring), else per document.
    """
    if varlen_attention_applies(q):
        return _varlen_causal_attention(q, k, v, layout)
    return per_document_causal_attention(q, k, v, layout)


def varlen_attention_applies(q: torch.Tensor) -> bool:
    """Whether `causal_attention` runs q [T, Hq, d] as one varlen FlashAttention call."""
    d = q.shape[-1]
    return (varlen_attn is not None and _varlen_gqa_kwargs() is not None and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and _flash_capable(q.device))


def per_document_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  layout: PackedLayout) -> torch.Tensor:
    """The reference path: one SDPA call per document (no padding, memory O(max document length^2) for
    the math kernel), or one batched call when all documents have the same length."""
    seq_len = layout.uniform_seq_len
    if seq_len is not None:
        n = layout.num_docs

        def heads_first(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n, seq_len, t.shape[1], t.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                             is_causal=True, enable_gqa=True)  # [N, Hq, S, d]
        return out.transpose(1, 2).reshape(q.shape)
    outs = []
    for qd, kd, vd in zip(q.split(layout.seq_lens), k.split(layout.seq_lens), v.split(layout.seq_lens)):
        o = F.scaled_dot_product_attention(qd.transpose(0, 1)[None], kd.transpose(0, 1)[None],
                                           vd.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [S_doc, Hq, d]
    return torch.cat(outs, dim=0)


def _varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             layout: PackedLayout) -> torch.Tensor:
    """All documents in one FlashAttention launch: boundaries from cu_seqlens, causal inside each."""
    cu = layout.cu_seqlens.to(torch.int32)  # [N + 1] on the device: FlashAttention's index type
    longest = max(layout.seq_lens)  # host int: sizes the kernel grid
    # window (-1, 0): unlimited to the left, nothing to the right, i.e. causal (the 2.11+ spelling)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest,
                       window_size=(-1, 0), **_varlen_gqa_kwargs())


@functools.cache
def _varlen_gqa_kwargs() -> dict[str, bool] | None:
    """Extra varlen_attn arguments for Hk < Hq on this torch; None when its varlen_attn is too old.

    torch 2.12+ checks the head counts unless `enable_gqa=True`; 2.10/2.11 have no such flag and hand
    grouped heads to FlashAttention, which supports them; 2.9's first version has no window_size.
    """
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params:
        return None
    return {"enable_gqa": True} if "enable_gqa" in params else {}


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    """FlashAttention-2 needs compute capability 8.0 (Ampere) or newer."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


class CCAProjection(nn.Module):
    """q/k/v of CCA: projections, causal convolutions, mean skip and the delayed value half."""

    def __init__(self, config: MoEPPConfig) -> None:
        super().__init__()
        d, hq, hk = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_q_heads, self.num_kv_heads = d, hq, hk
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, hk * d, bias=bias)
        self.v_proj_current = nn.Linear(config.hidden_size, hk * d // 2, bias=bias)
        self.v_proj_delayed = nn.Linear(config.hidden_size, hk * d // 2, bias=bias)
        channels = (hq + hk) * d
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, config.cca_time0, groups=channels)
        self.conv_qk_grouped = nn.Conv1d(channels, channels, config.cca_time1, groups=hq + hk)

    @property
    def conv_history(self) -> int:
        """Tokens of history the two stacked causal convolutions read (P)."""
        return self.conv_qk_depthwise.kernel_size[0] - 1 + self.conv_qk_grouped.kernel_size[0] - 1

    def project(self, x: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, Hq d], k [T, Hk d] (projections only), v [T, Hk, d]; all compute dtype."""
        t, d, hk = x.shape[0], self.head_dim, self.num_kv_heads
        q = linear(x, self.q_proj)  # [T, Hq d]
        k = linear(x, self.k_proj)  # [T, Hk d]
        v_current = linear(x, self.v_proj_current)  # [T, Hk d / 2]
        v_all = linear(x, self.v_proj_delayed)  # [T, Hk d / 2] projection of every token, used one step later
        # At a document start the previous token is zero history: W_vd 0 + b_vd.
        start_value = (self.v_proj_delayed.bias.to(v_all.dtype) if self.v_proj_delayed.bias is not None
                       else v_all.new_zeros(()))
        v_delayed = torch.where(layout.doc_start[:, None], start_value, torch.roll(v_all, 1, dims=0))
        v = torch.cat([v_current, v_delayed], dim=-1).view(t, hk, d)
        return q, k, v

    def forward(self, x: torch.Tensor, layout: PackedLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, Hq, d] fp32, k [T, Hk, d] fp32 (before QK-norm), v [T, Hk, d] compute dtype.

        The reference mean skip and convolutions; the model itself runs `project` and the fused
        `cca_precondition` (which continues through QK-norm and RoPE), so this is for inspection/tests.
        """
        q, k, v = self.project(x, layout)
        dw, gr = self.conv_qk_depthwise, self.conv_qk_grouped
        q, k = cca_mix(q, k, dw.weight, dw.bias, gr.weight, gr.bias, layout.doc_offset, self.num_q_heads,
                       self.num_kv_heads, self.head_dim)
        return q, k, v


class QKNorm(nn.Module):
    """L2-normalise q and k to norm sqrt(d) (fp32) and scale k by a learned per-KV-head temperature.

    The model runs this as the last step of the fused CCA preconditioner (CCAttention.forward); the
    module owns the `temp` parameter and its standalone forward serves the vLLM integration.
    """

    def __init__(self, config: MoEPPConfig) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.zeros(config.num_key_value_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, d], k [T, Hk, d] -> normalised, fp32."""
        return qk_norm(q, k, self.temp)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.temp)  # the reference's initial value


class CCAttention(nn.Module):
    """The attention block of a ZAYA1 layer: CCA projection, QK-norm, partial RoPE, GQA, o_proj."""

    def __init__(self, config: MoEPPConfig) -> None:
        super().__init__()
        self.qkv_proj = CCAProjection(config)
        self.qk_norm = QKNorm(config)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                bias=config.attention_bias)

    def forward(self, x: torch.Tensor, layout: PackedLayout, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D] in the compute dtype."""
        proj = self.qkv_proj
        q, k, v = proj.project(x, layout)  # [T, Hq d], [T, Hk d], [T, Hk, d]
        dw, gr = proj.conv_qk_depthwise, proj.conv_qk_grouped
        cos, sin = rope
        # mean skip, both convolutions, QK-norm with qk_norm.temp and partial RoPE in one op
        q, k = cca_precondition(q, k, dw.weight, dw.bias, gr.weight, gr.bias, self.qk_norm.temp, layout.doc_offset,
                                cos, sin, proj.num_q_heads, proj.num_kv_heads, proj.head_dim)  # fp32
        dtype = self.o_proj.weight.dtype
        out = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), layout)  # [T, Hq, d]
        return linear(out.reshape(out.shape[0], -1), self.o_proj)
