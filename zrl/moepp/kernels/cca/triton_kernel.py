"""CCA preconditioner on CUDA: the grouped convolution as one batched cuBLAS GEMM (on the tensor cores when
the weights are bf16), everything around it in Triton, one autograd function.

Definition: reference.py (shapes: T tokens, Hq/Hk query/KV heads, d head dim, G = Hq / Hk query heads
per KV head, C = (Hq + Hk) d, r = rotary dim, k0/k1 the two kernel sizes; o(t) = doc_offset[t]).
Forward, three launches:
  _taps_fwd_kernel  the depthwise convolution at the k1 lags the grouped one reads, per (token block,
                    head): taps[h, t, tau d + i] = b0 + sum_a w0[:, k0-1-a] x(t - tau - a) [o(t) >= tau + a]
                    (zero history at the first input, so b0 alone before a document's start); fp32, or
                    its three bf16 parts side by side along K ("Precision")
  GEMM              conv [Hq + Hk, T, d] = taps [Hq + Hk, T, k1 d] x W1 [Hq + Hk, k1 d, d]
                    (library.gemm_weight's layout), its bias left to the epilogue
  _fwd_kernel       the epilogue, per (token block, KV head j), so for the KV head and its G query heads
                    at once (the mean skip needs them together):
                      q_res(g) = (q(g) + k) / 2      k_res = mean_g q_res(g) = (mean_g q(g) + k) / 2
                      y = conv + b1 + res            n = sqrt(d) y / max(|y|, eps)   (k: times temp[j])
                      out = RoPE(n): [a, b, rest] -> [a cos - b sin, b cos + a sin, rest]
                    Each head's d channels are three tiles (RoPE's two halves and the rest), so the
                    rotation is arithmetic between tiles; any d and r work (masked tiles).
Backward (saved: q, k, taps, conv and the parameters; nothing is recomputed but y in the epilogue):
  _bwd_kernel       g_n = RoPE^T(g_out); g_temp(j) = sum g_n . n / temp; g_m = g_n (q) or temp g_n (k);
                    g_y = sqrt(d) / max(|y|, eps) (g_m - (g_m . y) y / |y|^2) (no projection term when
                    |y| < eps, as the reference's clamp_min); g_conv = g_y (and its column sums, g_b1's
                    partials); the residuals' share of the input gradients, fp32:
                    g_q(g) = g_y(g) / 2 + g_y(k) / (2 G), g_k = sum_g g_y(g) / 2 + g_y(k) / 2
  2 GEMMs           g_W1 = taps^T g_conv, g_taps = g_conv W1^T
  _taps_bwd_kernel  g_x(s) = the residuals' share + sum_{tau, a} w0[:, k0-1-a] g_taps_tau(s + tau + a) over
                    rows of s's document, summed in fp32 and cast once to q's dtype (as the reference's
                    one cast); partials of g_w0 and g_b0 per program
Weight gradients are per-program partials summed by torch afterwards (deterministic, no atomics).

Precision (CCA_STATE and QK_NORM: fp32). The Triton kernels compute in fp32, elementwise and row sums
only. The GEMMs:
  - bf16 weights (the trainer's, under FSDP2's mixed precision): the taps kernel writes hi, mid and lo
    (bf16_split.py), taps = hi + mid + lo exactly, and W1's values are bf16, so one bf16 tensor-core GEMM
    of the parts stacked along K (K = 3 k1 d) against W1 repeated three times is the fp32 product up to
    summation order. The backward's two GEMMs are order 0, as every bf16 layer forms its gradients:
    g_conv rounded once to bf16 (the epilogue writes it so; g_b1 sums the fp32 values), the taps' hi part.
    Against float64 (test_cca.py, CPU): forward 4.2e-7 of the largest entry (the fp32 path: 3.9e-7);
    q/k gradients about one bf16 rounding (2.3e-3), the weights' bf16 gradients 4.4e-3 (the exact ones
    rounded to bf16: up to 3.6e-3). Saved taps: 6 bytes per element instead of 4.
  - any other weight dtype: fp32 GEMMs (cuBLAS, TF32 off: `precision.fp32_without_tf32`), on the FMA units.

T, the token count, changes every step: the kernels take it with `do_not_specialize`, so a new count
never compiles a new variant (Triton would otherwise specialise on T % 16 == 0 and T == 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zrl.modeling.kernels import bf16_split
from zrl.modeling.kernels.bf16_split_triton import as_int16, bf16_bits
from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.moepp.kernels.cca import library

_EPS = torch.finfo(torch.float32).eps


@triton.jit
def _load_head(ptr, base, ok, HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr,
               REST_P: tl.constexpr):
    """One head's d channels at row offsets `base` [BLOCK_T] as fp32 tiles (a, b, rest): RoPE's halves
    [BLOCK_T, HALF_P] and the channels after them [BLOCK_T, REST_P]; zero where masked."""
    ch, cr = tl.arange(0, HALF_P), tl.arange(0, REST_P)
    mh = ok[:, None] & (ch < HALF)[None, :]
    mr = ok[:, None] & (cr < REST)[None, :]
    a = tl.load(ptr + base[:, None] + ch[None, :], mask=mh, other=0.0).to(tl.float32)
    b = tl.load(ptr + base[:, None] + HALF + ch[None, :], mask=mh, other=0.0).to(tl.float32)
    r = tl.load(ptr + base[:, None] + 2 * HALF + cr[None, :], mask=mr, other=0.0).to(tl.float32)
    return a, b, r


@triton.jit
def _store_head(ptr, base, ok, a, b, r, HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr,
                REST_P: tl.constexpr):
    ch, cr = tl.arange(0, HALF_P), tl.arange(0, REST_P)
    mh = ok[:, None] & (ch < HALF)[None, :]
    mr = ok[:, None] & (cr < REST)[None, :]
    tl.store(ptr + base[:, None] + ch[None, :], a, mask=mh)
    tl.store(ptr + base[:, None] + HALF + ch[None, :], b, mask=mh)
    tl.store(ptr + base[:, None] + 2 * HALF + cr[None, :], r, mask=mr)


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, rows, ok, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """cos, sin [BLOCK_T, HALF_P] of the rows (zero where masked; no load at all when r = 0)."""
    ch = tl.arange(0, HALF_P)
    if HALF > 0:
        mh = ok[:, None] & (ch < HALF)[None, :]
        cos = tl.load(cos_ptr + rows[:, None] * HALF + ch[None, :], mask=mh, other=0.0)
        sin = tl.load(sin_ptr + rows[:, None] * HALF + ch[None, :], mask=mh, other=0.0)
    else:
        cos = tl.zeros((rows.shape[0], HALF_P), tl.float32)
        sin = tl.zeros((rows.shape[0], HALF_P), tl.float32)
    return cos, sin


@triton.jit
def _inv_norm(a, b, r, eps):
    """Per row: |y| and 1 / max(|y|, eps) of the head y = (a, b, r)."""
    norm = tl.sqrt(tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(r * r, axis=1))
    return norm, 1.0 / tl.maximum(norm, eps)


@triton.jit
def _norm_backward(ga, gb, gr, a, b, r, norm, inv, scale, eps):
    """Gradient at y of m = scale y / max(|y|, eps), given the gradient (ga, gb, gr) at m."""
    dot = tl.sum(ga * a, axis=1) + tl.sum(gb * b, axis=1) + tl.sum(gr * r, axis=1)
    proj = tl.where(norm >= eps, dot * inv * inv, 0.0)[:, None]  # below eps the scale is a constant
    s = (scale * inv)[:, None]
    return s * (ga - proj * a), s * (gb - proj * b), s * (gr - proj * r)


@triton.jit
def _load_conv(conv_ptr, b1_ptr, h, rows, ok, T, D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
               REST: tl.constexpr, REST_P: tl.constexpr):
    """Head h's grouped convolution at the rows, its bias b1 added: (a, b, rest) fp32 tiles."""
    ca, cb, cr = _load_head(conv_ptr, (h * T + rows) * D, ok, HALF, HALF_P, REST, REST_P)
    ch, cc = tl.arange(0, HALF_P), tl.arange(0, REST_P)
    ba = tl.load(b1_ptr + h * D + ch, mask=ch < HALF, other=0.0)
    bb = tl.load(b1_ptr + h * D + HALF + ch, mask=ch < HALF, other=0.0)
    br = tl.load(b1_ptr + h * D + 2 * HALF + cc, mask=cc < REST, other=0.0)
    return ca + ba[None, :], cb + bb[None, :], cr + br[None, :]


@triton.jit
def _store_g_conv(g_conv_ptr, g_b1_part_ptr, h, rows, ok, ga, gb, gr, T, HEADS: tl.constexpr, D: tl.constexpr,
                  HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr,
                  G_BITS: tl.constexpr):
    """Head h's gradient at its convolution's output: the tiles (bf16 bit patterns when G_BITS, else fp32)
    and their fp32 column sums, this program's row of the g_b1 partials [blocks, HEADS D] (rows past T
    hold zeros)."""
    base = (h * T + rows) * D
    if G_BITS:
        bits_a, _ = bf16_bits(ga)
        bits_b, _ = bf16_bits(gb)
        bits_r, _ = bf16_bits(gr)
        _store_head(g_conv_ptr, base, ok, as_int16(bits_a), as_int16(bits_b), as_int16(bits_r), HALF, HALF_P, REST,
                    REST_P)
    else:
        _store_head(g_conv_ptr, base, ok, ga, gb, gr, HALF, HALF_P, REST, REST_P)
    ch, cc = tl.arange(0, HALF_P), tl.arange(0, REST_P)
    part = g_b1_part_ptr + tl.program_id(0).to(tl.int64) * (HEADS * D) + h * D
    tl.store(part + ch, tl.sum(ga, axis=0), mask=ch < HALF)
    tl.store(part + HALF + ch, tl.sum(gb, axis=0), mask=ch < HALF)
    tl.store(part + 2 * HALF + cc, tl.sum(gr, axis=0), mask=cc < REST)


@triton.jit
def _key_head(conv_ptr, b1_ptr, q_ptr, k_ptr, rows, ok, j, T, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
              HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr):
    """KV head j's input k and its y = conv + b1 + the mean of its query heads' residuals, (a, b, rest) tiles
    each."""
    G: tl.constexpr = HQ // HK
    ka, kb, kr = _load_head(k_ptr, rows * (HK * D) + j * D, ok, HALF, HALF_P, REST, REST_P)
    sa, sb, sr = tl.zeros_like(ka), tl.zeros_like(kb), tl.zeros_like(kr)
    for g in tl.static_range(G):
        qa, qb, qr = _load_head(q_ptr, rows * (HQ * D) + (j * G + g) * D, ok, HALF, HALF_P, REST, REST_P)
        sa, sb, sr = sa + qa, sb + qb, sr + qr
    ca, cb, cr = _load_conv(conv_ptr, b1_ptr, HQ + j, rows, ok, T, D, HALF, HALF_P, REST, REST_P)
    return ka, kb, kr, ca + (sa / G + ka) * 0.5, cb + (sb / G + kb) * 0.5, cr + (sr / G + kr) * 0.5


@triton.jit(do_not_specialize=["T"])
def _fwd_kernel(conv_ptr, b1_ptr, q_ptr, k_ptr, temp_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, T, scale, eps,
                HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                REST: tl.constexpr, REST_P: tl.constexpr, BLOCK_T: tl.constexpr):
    G: tl.constexpr = HQ // HK
    j = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    cos, sin = _rope_tables(cos_ptr, sin_ptr, rows, ok, HALF, HALF_P)
    ka, kb, kr, ya, yb, yr = _key_head(conv_ptr, b1_ptr, q_ptr, k_ptr, rows, ok, j, T, HQ, HK, D, HALF, HALF_P,
                                       REST, REST_P)
    _, inv = _inv_norm(ya, yb, yr, eps)
    s = (scale * inv * tl.load(temp_ptr + j))[:, None]
    ya, yb, yr = ya * s, yb * s, yr * s
    _store_head(k_out_ptr, rows * (HK * D) + j * D, ok, ya * cos - yb * sin, yb * cos + ya * sin, yr,
                HALF, HALF_P, REST, REST_P)
    for g in tl.static_range(G):
        h = j * G + g
        qa, qb, qr = _load_head(q_ptr, rows * (HQ * D) + h * D, ok, HALF, HALF_P, REST, REST_P)
        ca, cb, cr = _load_conv(conv_ptr, b1_ptr, h, rows, ok, T, D, HALF, HALF_P, REST, REST_P)
        ya, yb, yr = ca + (qa + ka) * 0.5, cb + (qb + kb) * 0.5, cr + (qr + kr) * 0.5
        _, inv = _inv_norm(ya, yb, yr, eps)
        s = (scale * inv)[:, None]
        ya, yb, yr = ya * s, yb * s, yr * s
        _store_head(q_out_ptr, rows * (HQ * D) + h * D, ok, ya * cos - yb * sin, yb * cos + ya * sin, yr,
                    HALF, HALF_P, REST, REST_P)


@triton.jit(do_not_specialize=["T"])
def _bwd_kernel(conv_ptr, b1_ptr, q_ptr, k_ptr, temp_ptr, cos_ptr, sin_ptr, g_q_out_ptr, g_k_out_ptr, g_conv_ptr,
                g_b1_part_ptr, g_q_ptr, g_k_ptr, g_temp_part_ptr, T, scale, eps, HQ: tl.constexpr,
                HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, REST: tl.constexpr,
                REST_P: tl.constexpr, G_BITS: tl.constexpr, BLOCK_T: tl.constexpr):
    G: tl.constexpr = HQ // HK
    j = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < T
    cos, sin = _rope_tables(cos_ptr, sin_ptr, rows, ok, HALF, HALF_P)
    k_base = rows * (HK * D) + j * D
    ka, kb, kr, ya, yb, yr = _key_head(conv_ptr, b1_ptr, q_ptr, k_ptr, rows, ok, j, T, HQ, HK, D, HALF, HALF_P,
                                       REST, REST_P)
    norm, inv = _inv_norm(ya, yb, yr, eps)
    ga, gb, gr = _load_head(g_k_out_ptr, k_base, ok, HALF, HALF_P, REST, REST_P)
    ga, gb = ga * cos + gb * sin, gb * cos - ga * sin  # RoPE^T
    # g_temp = sum of g_n . m over the block, m = scale y inv (the key before its temperature)
    dot = tl.sum(ga * ya, axis=1) + tl.sum(gb * yb, axis=1) + tl.sum(gr * yr, axis=1)
    tl.store(g_temp_part_ptr + tl.program_id(0) * HK + j, tl.sum(dot * scale * inv, axis=0))
    temp = tl.load(temp_ptr + j)
    gka, gkb, gkr = _norm_backward(ga * temp, gb * temp, gr * temp, ya, yb, yr, norm, inv, scale, eps)
    _store_g_conv(g_conv_ptr, g_b1_part_ptr, HQ + j, rows, ok, gka, gkb, gkr, T, HQ + HK, D, HALF, HALF_P, REST,
                  REST_P, G_BITS)
    acc_a, acc_b, acc_r = gka * 0.5, gkb * 0.5, gkr * 0.5  # g_k: its own residual's share
    for g in tl.static_range(G):
        h = j * G + g
        q_base = rows * (HQ * D) + h * D
        qa, qb, qr = _load_head(q_ptr, q_base, ok, HALF, HALF_P, REST, REST_P)
        ca, cb, cr = _load_conv(conv_ptr, b1_ptr, h, rows, ok, T, D, HALF, HALF_P, REST, REST_P)
        ya, yb, yr = ca + (qa + ka) * 0.5, cb + (qb + kb) * 0.5, cr + (qr + kr) * 0.5
        norm, inv = _inv_norm(ya, yb, yr, eps)
        ga, gb, gr = _load_head(g_q_out_ptr, q_base, ok, HALF, HALF_P, REST, REST_P)
        ga, gb = ga * cos + gb * sin, gb * cos - ga * sin
        ga, gb, gr = _norm_backward(ga, gb, gr, ya, yb, yr, norm, inv, scale, eps)
        _store_g_conv(g_conv_ptr, g_b1_part_ptr, h, rows, ok, ga, gb, gr, T, HQ + HK, D, HALF, HALF_P, REST, REST_P,
                      G_BITS)
        w = 0.5 / G  # the query head's share of k_res
        _store_head(g_q_ptr, q_base, ok, ga * 0.5 + gka * w, gb * 0.5 + gkb * w, gr * 0.5 + gkr * w,
                    HALF, HALF_P, REST, REST_P)
        acc_a, acc_b, acc_r = acc_a + ga * 0.5, acc_b + gb * 0.5, acc_r + gr * 0.5
    _store_head(g_k_ptr, k_base, ok, acc_a, acc_b, acc_r, HALF, HALF_P, REST, REST_P)


@triton.jit
def _load_x(q_ptr, k_ptr, off_ptr, rows, cols, lag, h, T, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):
    """Input channels `cols` of head h (q's head h < Hq, else k's h - Hq) at rows - lag, fp32
    [BLOCK_T, D_P]; zero where that row is before its document's start."""
    off = tl.load(off_ptr + rows, mask=rows < T, other=-1)
    ok = ((rows < T) & (off >= lag))[:, None] & (cols < D)[None, :]
    if h < HQ:
        x = tl.load(q_ptr + (rows - lag)[:, None] * (HQ * D) + h * D + cols[None, :], mask=ok, other=0.0)
    else:
        x = tl.load(k_ptr + (rows - lag)[:, None] * (HK * D) + (h - HQ) * D + cols[None, :], mask=ok, other=0.0)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def _taps_fwd_kernel(q_ptr, k_ptr, off_ptr, w0_ptr, b0_ptr, taps_ptr, T, HQ: tl.constexpr, HK: tl.constexpr,
                     D: tl.constexpr, D_P: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, PARTS: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """taps_tau[h, t, i] = b0 + sum_a w0[:, K0-1-a] x(t - tau - a) [o(t) >= tau + a], channels of head h, at
    row (h, t) of taps, column tau d + i: fp32 (PARTS = 1), or its bf16 parts hi, mid, lo as bit patterns
    (PARTS = 3) at columns p K1 d + tau d + i, p = 0, 1, 2 (the K-stacked operand of the GEMM)."""
    h = tl.program_id(1)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D_P)
    cmask = cols < D
    b0 = tl.load(b0_ptr + h * D + cols, mask=cmask, other=0.0)
    ok = (rows < T)[:, None] & cmask[None, :]
    for tau in tl.static_range(K1):
        acc = tl.zeros((BLOCK_T, D_P), tl.float32) + b0[None, :]
        for a in tl.static_range(K0):
            w = tl.load(w0_ptr + (h * D + cols) * K0 + K0 - 1 - a, mask=cmask, other=0.0)
            acc += w[None, :] * _load_x(q_ptr, k_ptr, off_ptr, rows, cols, tau + a, h, T, HQ, HK, D)
        at = taps_ptr + (h * T + rows)[:, None] * (PARTS * K1 * D) + tau * D + cols[None, :]
        if PARTS == 1:
            tl.store(at, acc, mask=ok)
        else:
            bits, hi = bf16_bits(acc)
            tl.store(at, as_int16(bits), mask=ok)
            rest = acc - hi
            bits, mid = bf16_bits(rest)
            tl.store(at + K1 * D, as_int16(bits), mask=ok)
            bits, _ = bf16_bits(rest - mid)
            tl.store(at + 2 * K1 * D, as_int16(bits), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _taps_bwd_kernel(g_taps_ptr, g_q_res_ptr, g_k_res_ptr, q_ptr, k_ptr, off_ptr, w0_ptr, g_q_ptr, g_k_ptr,
                     g_w0_part_ptr, g_b0_part_ptr, T, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                     D_P: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, BLOCK_T: tl.constexpr):
    """From g_taps [Hq + Hk, T, K1 d] and the epilogue's fp32 gradients at q, k: the gradients at q and k
    (both sums in fp32, one cast to q's dtype) and this program's partials of g_w0 [C, K0] and g_b0 [C]:
      g_x(s)          = sum_{tau, a} w0[:, K0-1-a] g_taps_tau(s + tau + a) [o(s + tau + a) >= tau + a]
      g_w0[:, K0-1-a] = sum_t sum_tau g_taps_tau(t) x(t - tau - a) [o(t) >= tau + a]
      g_b0            = sum_t sum_tau g_taps_tau(t)
    ([o(s + tau + a) >= tau + a]: that row is in s's document.)"""
    h = tl.program_id(1)
    block = tl.program_id(0)
    rows = block.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D_P)
    cmask = cols < D
    ok = (rows < T)[:, None] & cmask[None, :]
    if h < HQ:
        x_at = rows[:, None] * (HQ * D) + h * D + cols[None, :]
        gx = tl.load(g_q_res_ptr + x_at, mask=ok, other=0.0)
    else:
        x_at = rows[:, None] * (HK * D) + (h - HQ) * D + cols[None, :]
        gx = tl.load(g_k_res_ptr + x_at, mask=ok, other=0.0)
    gb0 = tl.zeros((D_P,), tl.float32)
    part = (block * (HQ + HK) * D + h * D + cols)  # [D_P] rows of the [blocks, C] partials
    for a in tl.static_range(K0):
        w = tl.load(w0_ptr + (h * D + cols) * K0 + K0 - 1 - a, mask=cmask, other=0.0)
        gw = tl.zeros((D_P,), tl.float32)
        for tau in tl.static_range(K1):
            g = tl.load(g_taps_ptr + (h * T + rows)[:, None] * (K1 * D) + tau * D + cols[None, :], mask=ok,
                        other=0.0)
            if a == 0:
                gb0 += tl.sum(g, axis=0)
            gw += tl.sum(g * _load_x(q_ptr, k_ptr, off_ptr, rows, cols, tau + a, h, T, HQ, HK, D), axis=0)
            src = rows + tau + a
            src_off = tl.load(off_ptr + src, mask=src < T, other=-1)
            m = ((src < T) & (src_off >= tau + a))[:, None] & cmask[None, :]
            gs = tl.load(g_taps_ptr + (h * T + src)[:, None] * (K1 * D) + tau * D + cols[None, :], mask=m,
                         other=0.0)
            gx += w[None, :] * gs
        tl.store(g_w0_part_ptr + part * K0 + K0 - 1 - a, gw, mask=cmask)
    tl.store(g_b0_part_ptr + part, gb0, mask=cmask)
    if h < HQ:
        tl.store(g_q_ptr + x_at, gx.to(g_q_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(g_k_ptr + x_at, gx.to(g_k_ptr.dtype.element_ty), mask=ok)


def _tiles(head_dim: int, half: int) -> dict:
    """The constexprs of a head's three tiles in the epilogue (tl.arange lengths are powers of two)."""
    rest = head_dim - 2 * half
    return dict(HALF=half, HALF_P=triton.next_power_of_2(max(half, 1)), REST=rest,
                REST_P=triton.next_power_of_2(max(rest, 1)))


class _CCAPrecondition(torch.autograd.Function):
    """q [T, Hq d], k [T, Hk d] (compute dtype), w0 [C, k0], b0 [C] (fp32), w1 [G, k1 d, d] (bf16: the split
    GEMMs; else fp32), b1 [G, 1, d], temp [Hk] (fp32), doc_offset [T], cos/sin [T, r/2] -> the
    preconditioner's q [T, Hq, d] and k [T, Hk, d] (fp32)."""

    @staticmethod
    def forward(ctx, q, k, w0, b0, w1, b1, temp, doc_offset, cos, sin, num_q_heads, num_kv_heads, head_dim,
                block_t, num_warps):
        t, hq, hk, d = q.shape[0], num_q_heads, num_kv_heads, head_dim
        heads, k0, k1 = hq + hk, w0.shape[-1], w1.shape[1] // head_dim
        split = w1.dtype == torch.bfloat16  # "Precision" in the module docstring
        parts = 3 if split else 1
        blocks = triton.cdiv(t, block_t)
        taps_consts = dict(HQ=hq, HK=hk, D=d, D_P=triton.next_power_of_2(d), K0=k0, K1=k1, BLOCK_T=block_t,
                           num_warps=num_warps)
        epi_consts = dict(HQ=hq, HK=hk, D=d, **_tiles(d, cos.shape[-1]), BLOCK_T=block_t, num_warps=num_warps)
        taps = q.new_empty((heads, t, parts * k1 * d), dtype=torch.bfloat16 if split else torch.float32)
        q_out = q.new_empty((t, hq, d), dtype=torch.float32)
        k_out = q.new_empty((t, hk, d), dtype=torch.float32)
        if t:
            _taps_fwd_kernel[(blocks, heads)](q, k, doc_offset, w0, b0, taps.view(torch.int16) if split else taps, t,
                                              PARTS=parts, **taps_consts)
        # [G, T, d]: the grouped convolution without its bias (the epilogue adds it)
        if split:  # the parts [hi | mid | lo] along K, each times w1: one bf16 GEMM, fp32 result
            conv = bf16_split.bf16_gemm(taps, w1.repeat(1, parts, 1))
        else:  # cuBLAS fp32 (TF32 off)
            conv = torch.bmm(taps, w1)
        if t:
            _fwd_kernel[(blocks, hk)](conv, b1, q, k, temp, cos, sin, q_out, k_out, t, d ** 0.5, _EPS, **epi_consts)
        ctx.save_for_backward(q, k, w0, w1, b1, temp, doc_offset, cos, sin, taps, conv)
        ctx.consts = blocks, taps_consts, epi_consts
        return q_out, k_out

    @staticmethod
    def backward(ctx, g_q_out, g_k_out):
        q, k, w0, w1, b1, temp, doc_offset, cos, sin, taps, conv = ctx.saved_tensors
        blocks, taps_consts, epi_consts = ctx.consts
        t, hk, heads, d = q.shape[0], epi_consts["HK"], conv.shape[0], epi_consts["D"]
        split = w1.dtype == torch.bfloat16
        f32 = dict(device=q.device, dtype=torch.float32)
        g_q_out = torch.zeros((t, q.shape[1]), **f32) if g_q_out is None else g_q_out.contiguous()
        g_k_out = torch.zeros((t, k.shape[1]), **f32) if g_k_out is None else g_k_out.contiguous()
        g_conv = torch.empty(conv.shape, device=q.device, dtype=torch.bfloat16 if split else torch.float32)
        g_b1_part = torch.empty((blocks, heads * d), **f32)  # every program writes its heads' entries
        g_q_res, g_k_res = torch.empty(q.shape, **f32), torch.empty(k.shape, **f32)  # the epilogue's share
        g_temp_part = torch.empty((blocks, hk), **f32)  # every program writes its entry
        if t:
            _bwd_kernel[(blocks, hk)](conv, b1, q, k, temp, cos, sin, g_q_out, g_k_out,
                                      g_conv.view(torch.int16) if split else g_conv, g_b1_part, g_q_res, g_k_res,
                                      g_temp_part, t, d ** 0.5, _EPS, G_BITS=split, **epi_consts)
        if split:  # order 0: g_conv's and the taps' hi parts (the taps' first K block)
            g_w1 = bf16_split.bf16_gemm(taps[:, :, : w1.shape[1]].transpose(1, 2), g_conv).to(w1.dtype)
            g_taps = bf16_split.bf16_gemm(g_conv, w1.transpose(1, 2))
        else:
            g_w1 = torch.bmm(taps.transpose(1, 2), g_conv)  # [G, k1 d, d]
            g_taps = torch.bmm(g_conv, w1.transpose(1, 2))  # [G, T, k1 d]
        g_q, g_k = torch.empty_like(q), torch.empty_like(k)
        g_w0_part = torch.empty((blocks, heads * d, w0.shape[-1]), **f32)  # every entry written once
        g_b0_part = torch.empty((blocks, heads * d), **f32)
        if t:
            _taps_bwd_kernel[(blocks, heads)](g_taps, g_q_res, g_k_res, q, k, doc_offset, w0, g_q, g_k, g_w0_part,
                                              g_b0_part, t, **taps_consts)
        return (g_q, g_k, g_w0_part.sum(0), g_b0_part.sum(0), g_w1, g_b1_part.sum(0).view(b1.shape),
                g_temp_part.sum(0), None, None, None, None, None, None, None, None)


def _check(q: torch.Tensor, k: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
           block_t: int) -> None:
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if q.shape[1] != num_q_heads * head_dim or k.shape[1] != num_kv_heads * head_dim or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match Hq={num_q_heads}, "
                         f"Hk={num_kv_heads}, d={head_dim}")
    if block_t <= 0 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two (a tl.arange length), got {block_t}")


def cca_precondition(q: torch.Tensor, k: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
                     gr_weight: torch.Tensor, gr_bias: torch.Tensor, temp: torch.Tensor, doc_offset: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                     block_t: int = 16, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.cca_precondition's arguments and results (no document count needed).

    block_t: tokens per program (a power of two); num_warps: warps per program.
    """
    _check(q, k, num_q_heads, num_kv_heads, head_dim, block_t)
    heads = num_q_heads + num_kv_heads
    # The parameters in fp32 and the layouts the kernels and the GEMM take (autograd ops: gradients return
    # to the parameters in their own dtype and layout).
    w0 = to_op_dtype(dw_weight, Fp32Op.CCA_STATE)[:, 0].contiguous()  # [C, k0]
    b0 = to_op_dtype(dw_bias, Fp32Op.CCA_STATE).contiguous()
    # [G, k1 d, d]: a bf16 weight as it is (its value is one bf16 part: the split GEMMs), else in fp32
    w1 = library.gemm_weight(gr_weight if gr_weight.dtype == torch.bfloat16
                             else to_op_dtype(gr_weight, Fp32Op.CCA_STATE)).contiguous()
    b1 = to_op_dtype(gr_bias, Fp32Op.CCA_STATE).view(heads, 1, head_dim)
    return _CCAPrecondition.apply(q.contiguous(), k.contiguous(), w0, b0, w1, b1,
                                  to_op_dtype(temp, Fp32Op.QK_NORM).contiguous(), doc_offset.contiguous(),
                                  cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous(),
                                  num_q_heads, num_kv_heads, head_dim, block_t, num_warps)
