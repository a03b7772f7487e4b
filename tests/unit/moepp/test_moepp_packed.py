"""Packed variable-length batches: layouts, CCA boundary handling, packed == each document alone."""

import math

import pytest
import torch
import torch.nn.functional as F

from moepp_testlib import config_of, ours_from_reference, random_reference, relative_error
from zrl.modeling.rope import apply_partial_rope, rope_cos_sin
from zrl.moepp.cca import CCAProjection
from zrl.modeling.packing import build_layout, cu_seqlens_from_position_ids

# Lengths 1 and 2 are shorter than the conv history (P = 3 below): their whole window is padding.
DOC_LENS = [5, 1, 2, 9, 3]
# attention biases make the delayed value at a document start non-zero (it is W_vd 0 + b_vd).
REF_KW = dict(seed=4, skip_bias=0.05, attention_bias=True, cca_time0=3, cca_time1=2)


def doc_tokens(lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=gen) for n in lens]


def cu_of(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))


def test_cu_seqlens_from_position_ids_hand_values():
    pos = torch.tensor([0, 1, 2, 0, 1, 0, 0, 1, 2, 3])
    assert cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 5, 6, 10]
    # A stream not starting at 0 still starts a document; each row of [B, S] starts one.
    assert cu_seqlens_from_position_ids(torch.tensor([4, 5, 0, 1])).tolist() == [0, 2, 4]
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0, 1], [2, 3, 4, 5]])).tolist() == [0, 2, 4, 8]
    with pytest.raises(ValueError, match="increase by 1"):
        cu_seqlens_from_position_ids(torch.tensor([0, 1, 3]))


def test_layout_hand_values():
    layout = build_layout(6, device=torch.device("cpu"), cu_seqlens=torch.tensor([0, 2, 2, 3, 6]))
    assert layout.seq_lens == (2, 1, 3)  # the empty document is dropped
    assert layout.cu_seqlens.tolist() == [0, 2, 3, 6]
    assert layout.positions.tolist() == [0, 1, 0, 0, 1, 2]
    assert layout.doc_start.tolist() == [True, False, True, True, False, False]
    assert layout.doc_offset.tolist() == [0, 1, 0, 0, 1, 2]
    assert layout.uniform_seq_len is None
    rows = build_layout(6, device=torch.device("cpu"), row_length=3)
    assert rows.seq_lens == (3, 3) and rows.uniform_seq_len == 3


@pytest.mark.parametrize("cu, match", [([0, 2, 5], "end at the token count 6"), ([1, 6], "start at 0"),
                                       ([0, 4, 2, 6], "non-decreasing")])
def test_layout_rejects_bad_boundaries(cu, match):
    with pytest.raises(ValueError, match=match):
        build_layout(6, device=torch.device("cpu"), cu_seqlens=torch.tensor(cu))


def test_partial_rope_hand_values():
    # rotary_dim 2: one frequency theta^0 = 1, so the first channel pair turns by `position` radians.
    cos, sin = rope_cos_sin(torch.tensor([0, 3]), rotary_dim=2, theta=10_000.0)
    x = torch.tensor([[[1.0, 0.0, 5.0]], [[1.0, 0.0, 5.0]]])  # [T=2, H=1, d=3]
    out = apply_partial_rope(x, cos, sin)
    assert torch.allclose(out[0, 0], torch.tensor([1.0, 0.0, 5.0]))
    assert torch.allclose(out[1, 0], torch.tensor([math.cos(3.0), math.sin(3.0), 5.0]))
    # rotary_dim 4: frequencies 1 and theta^-1/2 = 0.01; pairs are (0, 2) and (1, 3) (rotate-half).
    cos, sin = rope_cos_sin(torch.tensor([2]), rotary_dim=4, theta=10_000.0)
    out = apply_partial_rope(torch.tensor([[[0.0, 1.0, 0.0, 0.0]]]), cos, sin)
    assert torch.allclose(out[0, 0], torch.tensor([0.0, math.cos(0.02), 0.0, math.sin(0.02)]))


@torch.no_grad()
def test_cca_projection_restarts_at_document_boundaries():
    """Packed CCA q/k/v == the reference recipe per document: left-pad P zeros, convolve, shift v."""
    ref = random_reference(**REF_KW)
    proj: CCAProjection = ours_from_reference(ref).layers[1].self_attn.qkv_proj
    cfg = config_of(ref)
    x = torch.randn(sum(DOC_LENS), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    layout = build_layout(x.shape[0], device=x.device, cu_seqlens=cu_of(DOC_LENS))
    q, k, v = proj(x, layout)
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    for xd, qd, kd, vd in zip(x.split(DOC_LENS), q.split(DOC_LENS), k.split(DOC_LENS), v.split(DOC_LENS)):
        qk = torch.cat([proj.q_proj(xd), proj.k_proj(xd)], -1).t()[None]  # [1, C, S]
        qk = F.pad(qk, (proj.conv_history, 0))
        qk = proj.conv_qk_grouped(proj.conv_qk_depthwise(qk))[0].t()  # [S, C]
        q_lin, k_lin = proj.q_proj(xd).view(-1, hq, d), proj.k_proj(xd).view(-1, hk, d)
        q_res = (q_lin + k_lin.repeat_interleave(hq // hk, 1)) / 2
        k_res = q_res.view(-1, hk, hq // hk, d).mean(2)
        torch.testing.assert_close(qd, qk[:, : hq * d].view(-1, hq, d) + q_res, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kd, qk[:, hq * d:].view(-1, hk, d) + k_res, rtol=1e-6, atol=1e-6)
        delayed = proj.v_proj_delayed(F.pad(xd, (0, 0, 1, 0))[:-1])  # previous token, zero before the start
        expected_v = torch.cat([proj.v_proj_current(xd), delayed], -1).view(-1, hk, d)
        torch.testing.assert_close(vd, expected_v, rtol=1e-6, atol=1e-6)
        # the first token's delayed half is exactly the bias of v_proj_delayed
        assert torch.equal(vd[0].reshape(-1)[hk * d // 2:], proj.v_proj_delayed.bias)


@torch.no_grad()
def test_packed_equals_documents_alone_and_reference():
    ref = random_reference(**REF_KW)
    ours = ours_from_reference(ref)
    docs = doc_tokens(DOC_LENS)
    packed = ours(torch.cat(docs), cu_seqlens=cu_of(DOC_LENS))
    alone = [ours(doc) for doc in docs]
    # packed vs alone differ only by SDPA/BLAS blocking: measured 4.8e-7 relative.
    assert relative_error(packed.logits, torch.cat([a.logits for a in alone])) < 1e-5
    assert torch.equal(packed.routing.native_ids, torch.cat([a.routing.native_ids for a in alone]))
    for logits, doc in zip(packed.logits.split(DOC_LENS), docs):
        assert relative_error(logits, ref(doc[None]).logits[0]) < 1e-5


@torch.no_grad()
def test_boundaries_from_position_ids_and_batch_form():
    ours = ours_from_reference(random_reference(**REF_KW))
    docs = doc_tokens(DOC_LENS, seed=1)
    ids = torch.cat(docs)
    by_cu = ours(ids, cu_seqlens=cu_of(DOC_LENS)).logits
    positions = torch.cat([torch.arange(n) for n in DOC_LENS])
    torch.testing.assert_close(ours(ids, position_ids=positions).logits, by_cu, rtol=0, atol=0)

    # [B, S]: each row a document, the same as the flat stream with equal lengths.
    rows = torch.stack(doc_tokens([7, 7, 7], seed=2))
    as_rows = ours(rows).logits  # [3, 7, V]
    as_stream = ours(rows.reshape(-1), cu_seqlens=torch.tensor([0, 7, 14, 21])).logits
    torch.testing.assert_close(as_rows.reshape(21, -1), as_stream, rtol=0, atol=0)
    # [B, S] with position ids restarting inside a row: row 0 holds documents of 3 and 4 tokens.
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    split = ours(rows[:2], position_ids=pos).logits
    expected = ours(rows[:2].reshape(-1), cu_seqlens=torch.tensor([0, 3, 7, 14])).logits
    assert relative_error(split.reshape(14, -1), expected) < 1e-5


def test_documents_do_not_see_each_other():
    """Gradient of a later document's logits w.r.t. an earlier document's embeddings is exactly 0."""
    ours = ours_from_reference(random_reference(**REF_KW))
    docs = doc_tokens([4, 6])
    ids = torch.cat(docs)
    emb = ours.embed_tokens
    captured = {}

    def keep(module, args, out):
        out.retain_grad()
        captured["emb"] = out

    emb.register_forward_hook(keep)
    logits = ours(ids, cu_seqlens=torch.tensor([0, 4, 10])).logits
    logits[4:].sum().backward()
    grad = captured["emb"].grad  # [T, D]
    assert grad[:4].abs().max() == 0
    assert grad[4:].abs().max() > 0


def test_cca_projections_run_as_one_gemm_with_one_cast():
    """The four projections run as one GEMM over their concatenated weights, x cast to the compute dtype once;
    x's gradient is one GEMM too (where four summed in three more passes over [T, D] before). A projection
    with a forward of its own (a LoRA adapter) makes them run one by one, with that module's values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zrl.modeling.kernels.gemm_count import GemmCounter
    from zrl.modeling.lora.layers import LoRALinear

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten._to_copy and args[0].shape == x.shape
            return func(*args, **(kwargs or {}))

    ref = random_reference(**REF_KW)
    proj: CCAProjection = ours_from_reference(ref).layers[1].self_attn.qkv_proj.to(torch.bfloat16)
    x = torch.randn(sum(DOC_LENS), config_of(ref).hidden_size, generator=torch.Generator().manual_seed(2),
                    requires_grad=True)  # fp32, as the input norm gives it
    layout = build_layout(x.shape[0], device=x.device, cu_seqlens=cu_of(DOC_LENS))
    with GemmCounter() as gemms, Casts() as casts:
        q, k, v = proj.project(x, layout)
        forward_gemms, forward_casts = gemms.total_launches, casts.count
        torch.autograd.grad(q.sum() + k.sum() + v.sum(), [x])
    assert (forward_gemms, forward_casts) == (1, 1)
    assert gemms.total_launches == 2 and casts.count == 2  # backward: x's gradient and its cast back to fp32
    xb = x.detach().bfloat16()
    torch.testing.assert_close(q, proj.q_proj(xb), rtol=0, atol=1e-2)  # one bf16 rounding apart at most
    # LoRA on q_proj: one by one, q with its adapter
    proj.q_proj = LoRALinear(proj.q_proj, rank=2, alpha=4.0, dropout=0.0)
    for adapter in (proj.q_proj.lora_A, proj.q_proj.lora_B):
        torch.nn.init.normal_(adapter, std=0.1)
    with torch.no_grad(), GemmCounter() as gemms:
        q_lora, k_lora, _ = proj.project(x, layout)
    assert gemms.total_launches >= 4
    assert torch.equal(q_lora, proj.q_proj(xb)) and torch.equal(k_lora, proj.k_proj(xb))
    assert not torch.equal(q_lora, q)
