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
holds the math); projections and attention (zrl.modeling.attention) run in the compute dtype. Parameter
names match the HF `zaya` checkpoint (`qkv_proj.*`, `qk_norm.temp`, `o_proj`).

Invariant: no operation mixes tokens of different documents (see zrl.modeling.packing.PackedLayout).
"""

from __future__ import annotations

import torch
from torch import nn

from zrl.modeling.attention import causal_attention
from zrl.modeling.blocks import linear, linears
from zrl.modeling.packing import PackedLayout
from zrl.moepp.config import MoEPPConfig
from zrl.moepp.kernels.cca import cca_precondition
from zrl.moepp.kernels.cca.reference import cca_mix, qk_norm


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
        """x [T, D] -> q [T, Hq d], k [T, Hk d] (projections only), v [T, Hk, d]; all compute dtype.

        The four projections run as one GEMM over their weights concatenated (`linears`, as the serving
        model's merged projection does); the parameters stay four (the checkpoint's)."""
        t, d, hk = x.shape[0], self.head_dim, self.num_kv_heads
        # q [T, Hq d], k [T, Hk d], v_current [T, Hk d / 2]; v_all [T, Hk d / 2], the delayed projection of
        # every token, used one step later
        q, k, v_current, v_all = linears(x, (self.q_proj, self.k_proj, self.v_proj_current,
                                             self.v_proj_delayed))
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

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype the projections take x in (they cast it to this)."""
        return self.qkv_proj.q_proj.weight.dtype

    def forward(self, x: torch.Tensor, layout: PackedLayout, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D] in the compute dtype."""
        proj = self.qkv_proj
        q, k, v = proj.project(x, layout)  # [T, Hq d], [T, Hk d], [T, Hk, d]
        dw, gr = proj.conv_qk_depthwise, proj.conv_qk_grouped
        cos, sin = rope
        # mean skip, both convolutions, QK-norm with qk_norm.temp and partial RoPE in one op
        q, k = cca_precondition(q, k, dw.weight, dw.bias, gr.weight, gr.bias, self.qk_norm.temp, layout.doc_offset,
                                cos, sin, proj.num_q_heads, proj.num_kv_heads, proj.head_dim,
                                num_docs=layout.num_docs)  # fp32
        dtype = self.o_proj.weight.dtype
        out = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), layout)  # [T, Hq, d]
        return linear(out.reshape(out.shape[0], -1), self.o_proj)
