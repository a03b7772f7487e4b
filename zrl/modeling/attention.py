"""Causal attention inside each document of a packed token stream (grouped-query heads).

q [T, Hq, d], k/v [T, Hk, d] -> [T, Hq, d] (T tokens, Hq query heads, Hk KV heads, d head_dim), scale
d^-1/2, in the compute dtype. Every family's attention block projects, normalises and rotates its q and
k its own way and calls `causal_attention` for the attention itself.

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

from zrl.modeling.packing import PackedLayout

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch without it: attention runs per document
    varlen_attn = None

__all__ = ["causal_attention", "per_document_causal_attention", "varlen_attention_applies"]


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
