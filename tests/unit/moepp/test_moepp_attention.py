"""Causal attention over packed documents: the per-document path (CPU, fp32) and the one-call varlen
FlashAttention path (CUDA, bf16) against a float64 block-diagonal reference, forward and backward.

Shapes: T tokens, Hq = 8 query heads sharing Hk = 2 KV heads (GQA, group 4), d head_dim.
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zrl.modeling.attention import causal_attention, per_document_causal_attention, varlen_attention_applies
from zrl.modeling.packing import build_layout

HQ, HK = 8, 2
# ragged, with length-1 documents at the start, in the middle and at the end
RAGGED = [1, 7, 1, 1, 12, 3, 30, 1]


def qkv(lens, d, *, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=gen, dtype=torch.float64) for h in (HQ, HK, HK))
    return [x.to(device=device, dtype=dtype).requires_grad_() for x in (q, k, v)]


def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])


def dense_reference(q, k, v, lens):
    """float64 attention with an explicit [T, T] mask: same document and key position <= query position."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    t, group = q.shape[0], q.shape[1] // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(lens), device=q.device), torch.tensor(lens, device=q.device))
    pos = torch.arange(t, device=q.device)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])  # [T, T]
    # query head h reads KV head h // group
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", probs, vv), (q, k, v)


def max_errors(out, inputs, ref_out, ref_inputs, grad_out):
    """Max |difference| of the output and of dq, dk, dv against the float64 reference."""
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_out, retain_graph=True)
    return [(a.double() - b).abs().max().item() for a, b in zip([out, *grads], [ref_out, *ref_grads])]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lens", [RAGGED, [6, 6, 6]], ids=["ragged", "uniform"])
def test_per_document_attention_matches_block_diagonal_reference(lens):
    q, k, v = qkv(lens, d=16)
    layout = build_layout(sum(lens), device=torch.device("cpu"), cu_seqlens=cu_of(lens))
    assert not varlen_attention_applies(q)  # CPU: causal_attention is the per-document path
    with OpCounter() as ops:
        out = causal_attention(q, k, v, layout)
    sdpa_calls = sum("scaled_dot_product" in n for n in ops.names)
    assert sdpa_calls == (1 if len(set(lens)) == 1 else len(lens))  # batched when uniform, else per document
    ref_out, ref_inputs = dense_reference(q, k, v, lens)
    grad_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    errors = max_errors(out, (q, k, v), ref_out, ref_inputs, grad_out)
    # fp32 against float64: measured max 4.1e-7 (output) and 1.2e-6 (dq, dk, dv) over both layouts
    assert max(errors) < 1e-5, errors
    torch.testing.assert_close(out, per_document_causal_attention(q, k, v, layout), rtol=0, atol=0)


@pytest.mark.gpu
def test_varlen_attention_is_one_launch_and_as_accurate_as_the_per_document_loop():
    lens = [1, 300, 1, 77, 1024, 5, 1, 130, 1]
    d = 128  # the ZAYA1-8B head_dim
    q, k, v = qkv(lens, d, dtype=torch.bfloat16, device="cuda")
    layout = build_layout(sum(lens), device=q.device, cu_seqlens=cu_of(lens))
    assert varlen_attention_applies(q)
    with OpCounter() as ops:
        out = causal_attention(q, k, v, layout)
    assert ops.names.count("torch_attn._varlen_attn") == 1
    assert not [n for n in ops.names if "scaled_dot_product" in n]
    ref_out, ref_inputs = dense_reference(q, k, v, lens)
    grad_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).cuda()
    one_call = max_errors(out, (q, k, v), ref_out, ref_inputs, grad_out)
    loop = max_errors(per_document_causal_attention(q, k, v, layout), (q, k, v), ref_out, ref_inputs, grad_out)
    # Both run bf16 FlashAttention tiles; the one-call path may round differently but not worse. Not yet
    # measured on a GPU (the bf16 loop on CPU is off by 1.1e-2..3.6e-2 here): 1.5x the loop's error plus
    # 2^-7 bounds it.
    for name, a, b in zip(["out", "dq", "dk", "dv"], one_call, loop):
        assert a <= 1.5 * b + 2 ** -7, (name, one_call, loop)
