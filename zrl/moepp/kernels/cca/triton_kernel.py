"""Fused Triton CCA preconditioner: mean skip, both causal convolutions, residual, QK-norm, temperature
and partial RoPE in one pass per (token block, head); backward in three Triton kernels.

Definition: reference.py (shapes: T tokens, Hq/Hk query/KV heads, d head dim, C = (Hq + Hk) d,
Hq / Hk query heads per KV head, r = rotary dim, k0/k1 the two kernel sizes, P = k0 + k1 - 2). Head h < Hq reads its
channels from q, head h >= Hq from k (channel block h of the concatenation [q, k]).

For a token t (o = doc_offset[t]) and a head, with x the head's input channels:
  h1(t - m) = b0 + sum_j w0[:, j] * x(t - m - (k0 - 1 - j))   x at lag l > o is zero (document start)
  y(t) = b1 + sum_tau W1_tau h1(t - (k1 - 1 - tau)) + res(t)   W1_tau = gr_weight[h d : h d + d, :, tau]
A look-back past the document start reads zero *inputs*, so h1 there is b0, as in the reference.

Backward (nothing but the inputs is saved; the kernels recompute):
  _bwd_gy   recompute y, undo RoPE, QK-norm and temperature: gy [T, C] fp32 (scratch) and per-block
            partial sums of gb1 [C] and g_temp [Hk]
  _bwd_gx   g_h1(t + a) = sum_tau gy(t + a + k1 - 1 - tau) W1_tau (k0 k1 products per block),
            gx = sum_a w0[:, k0 - 1 - a] g_h1(t + a) + mean-skip terms; per-block partial gw0 [C, k0];
            one BLOCK_C-column slice of g_h1 / gx at a time (a loop in the program)
  _bwd_gw1  gW1_tau = sum_t gy(t)^T h1(t - (k1 - 1 - tau)): split-T GEMM, one partial per split, one
            BLOCK_C-column slice of gW1_tau per program
Weight gradients are per-program partials summed by torch afterwards (deterministic, no atomics);
gb0 = sum_tau W1_tau^T gb1 in closed form (every h1, real or before the start, carries b0 once).

T, the token count, changes every step: the kernels take it with `do_not_specialize`, so a new count
never compiles a new variant (Triton would otherwise specialise on T % 16 == 0 and T == 1). T only
bounds row masks and loops; the vectorised axis is the channels, so the specialisation bought nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zrl.modeling.kernels import interpreting

_EPS = torch.finfo(torch.float32).eps
# 8 warps (with block_t 32): the fp32 [BLOCK_T, d] x [d, d] dots run on FMA units and keep whole d = 128
# rows per thread; Triton's default 4 warps at block_t 64 spilled ~70 KB per thread in the forward
# (sm_90a compile, sm90_check.py), 8 warps at block_t 32 spill 0.2 KB there. The backward's d x d
# products go by BLOCK_C = 32 output columns at 8 warps: 0 spills (4 warps spilled 1-3 KB, BLOCK_C 64 2-24 KB).
_NUM_WARPS = 8


@triton.jit
def _load_x(q_ptr, k_ptr, off_ptr, rows, cols, lag, h, T, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):
    """x of head h at rows - lag as fp32 [BLOCK_T, D]; zero where that row is before the document start."""
    off = tl.load(off_ptr + rows, mask=rows < T, other=-1)
    ok = ((rows < T) & (off >= lag))[:, None]
    src = rows - lag
    if h < HQ:
        x = tl.load(q_ptr + src[:, None] * (HQ * D) + h * D + cols[None, :], mask=ok, other=0.0)
    else:
        x = tl.load(k_ptr + src[:, None] * (HK * D) + (h - HQ) * D + cols[None, :], mask=ok, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _h1(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, rows, cols, m, h, T, HQ: tl.constexpr, HK: tl.constexpr,
        D: tl.constexpr, K0: tl.constexpr):
    """Depthwise-conv output at rows - m for head h, channels `cols` of it [BLOCK_T, len(cols)] (b0 alone
    before the start)."""
    h1 = tl.zeros((rows.shape[0], cols.shape[0]), tl.float32) + tl.load(dw_b_ptr + h * D + cols)[None, :]
    for j in tl.static_range(K0):
        w = tl.load(dw_w_ptr + (h * D + cols) * K0 + j)  # [D]
        h1 += w[None, :] * _load_x(q_ptr, k_ptr, off_ptr, rows, cols, m + K0 - 1 - j, h, T, HQ, HK, D)
    return h1


@triton.jit
def _forward_y(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, gr_w_ptr, gr_b_ptr, rows, cols, h, T,
               HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """conv(t) + res(t) for head h: [BLOCK_T, D] fp32, the quantity QK-norm normalises."""
    y = tl.zeros((rows.shape[0], D), tl.float32) + tl.load(gr_b_ptr + h * D + cols)[None, :]
    for tau in tl.static_range(K1):
        h1 = _h1(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, rows, cols, K1 - 1 - tau, h, T, HQ, HK, D, K0)
        # W1_tau^T [c, o] = gr_weight[h d + o, c, tau]
        w1t = tl.load(gr_w_ptr + (h * D + cols[None, :]) * (D * K1) + cols[:, None] * K1 + tau)
        y = tl.dot(h1, w1t, y, input_precision=DOT_PRECISION)
    groups: tl.constexpr = HQ // HK
    rmask = (rows < T)[:, None]
    if h < HQ:
        # h is a program id, so this `if` is a runtime branch: a name assigned in both arms must have one
        # type in both (kv is fp32 in the else arm), which the interpreter does not check.
        x = tl.load(q_ptr + rows[:, None] * (HQ * D) + h * D + cols[None, :], mask=rmask, other=0.0)
        kv = tl.load(k_ptr + rows[:, None] * (HK * D) + (h // groups) * D + cols[None, :], mask=rmask,
                     other=0.0).to(tl.float32)
        res = (x.to(tl.float32) + kv) * 0.5
    else:
        kv = tl.load(k_ptr + rows[:, None] * (HK * D) + (h - HQ) * D + cols[None, :], mask=rmask,
                     other=0.0).to(tl.float32)
        res = tl.zeros((rows.shape[0], D), tl.float32)
        for g in tl.static_range(groups):
            qg = tl.load(q_ptr + rows[:, None] * (HQ * D) + ((h - HQ) * groups + g) * D + cols[None, :],
                         mask=rmask, other=0.0)
            res += (qg.to(tl.float32) + kv) * 0.5
        res = res / groups
    return y + res


@triton.jit
def _rotate(x, cos_ptr, sin_ptr, rows, T, sign, D: tl.constexpr, HALF: tl.constexpr):
    """Rotate-half RoPE of x [BLOCK_T, D] on its first 2 HALF channels; sign -1 applies the inverse."""
    block_t: tl.constexpr = x.shape[0]
    nb: tl.constexpr = D // (2 * HALF)
    halves = tl.arange(0, HALF)
    rmask = (rows < T)[:, None]
    c = tl.load(cos_ptr + rows[:, None] * HALF + halves[None, :], mask=rmask, other=1.0)  # [BLOCK_T, HALF]
    s = tl.load(sin_ptr + rows[:, None] * HALF + halves[None, :], mask=rmask, other=0.0) * sign
    c = tl.reshape(c, (block_t, 1, HALF))
    s = tl.reshape(s, (block_t, 1, HALF))
    # [BLOCK_T, D] -> blocks of 2 HALF channels, each split into its two halves a, b [BLOCK_T, nb, HALF]
    a, b = tl.split(tl.permute(tl.reshape(x, (block_t, nb, 2, HALF)), (0, 1, 3, 2)))
    first = (tl.arange(0, nb) == 0)[None, :, None]  # only the first block is rotary
    ra = tl.where(first, a * c - b * s, a)
    rb = tl.where(first, b * c + a * s, b)
    return tl.reshape(tl.permute(tl.join(ra, rb), (0, 1, 3, 2)), (block_t, D))


@triton.jit(do_not_specialize=["T"])
def _fwd_kernel(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, gr_w_ptr, gr_b_ptr, temp_ptr, cos_ptr, sin_ptr,
                qo_ptr, ko_ptr, T, scale, eps, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                K0: tl.constexpr, K1: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    y = _forward_y(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, gr_w_ptr, gr_b_ptr, rows, cols, h, T, HQ, HK, D,
                   K0, K1, DOT_PRECISION)
    inv = scale / tl.maximum(tl.sqrt(tl.sum(y * y, axis=1)), eps)  # [BLOCK_T]
    z = y * inv[:, None]
    if HALF > 0:
        z = _rotate(z, cos_ptr, sin_ptr, rows, T, 1.0, D, HALF)
    rmask = (rows < T)[:, None]
    if h < HQ:
        tl.store(qo_ptr + rows[:, None] * (HQ * D) + h * D + cols[None, :], z, mask=rmask)
    else:
        z = z * tl.load(temp_ptr + h - HQ)
        tl.store(ko_ptr + rows[:, None] * (HK * D) + (h - HQ) * D + cols[None, :], z, mask=rmask)


@triton.jit(do_not_specialize=["T"])
def _bwd_gy_kernel(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, gr_w_ptr, gr_b_ptr, temp_ptr, cos_ptr, sin_ptr,
                   gqo_ptr, gko_ptr, gy_ptr, gb1_part_ptr, gtemp_part_ptr, T, scale, eps, HQ: tl.constexpr,
                   HK: tl.constexpr, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr):
    h = tl.program_id(1)
    block = tl.program_id(0)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)
    rmask = (rows < T)[:, None]
    y = _forward_y(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, gr_w_ptr, gr_b_ptr, rows, cols, h, T, HQ, HK, D,
                   K0, K1, DOT_PRECISION)
    norm = tl.sqrt(tl.sum(y * y, axis=1))  # [BLOCK_T]
    inv = scale / tl.maximum(norm, eps)
    if h < HQ:
        g = tl.load(gqo_ptr + rows[:, None] * (HQ * D) + h * D + cols[None, :], mask=rmask, other=0.0)
    else:
        g = tl.load(gko_ptr + rows[:, None] * (HK * D) + (h - HQ) * D + cols[None, :], mask=rmask, other=0.0)
    if HALF > 0:
        g = _rotate(g, cos_ptr, sin_ptr, rows, T, -1.0, D, HALF)  # RoPE is orthogonal: its inverse
    if h >= HQ:
        temp = tl.load(temp_ptr + h - HQ)
        tl.store(gtemp_part_ptr + block * HK + h - HQ, tl.sum(tl.sum(g * y * inv[:, None], axis=1), axis=0))
        g = g * temp
    # d(y inv)/dy: inv (I - y y^T / norm^2) while the norm is above eps, inv I where the clamp holds it.
    dot = tl.sum(y * g, axis=1)
    coef = tl.where(norm >= eps, dot / (norm * norm), 0.0)
    gy = inv[:, None] * (g - coef[:, None] * y)
    gy = tl.where(rmask, gy, 0.0)
    tl.store(gy_ptr + rows[:, None] * ((HQ + HK) * D) + h * D + cols[None, :], gy, mask=rmask)
    tl.store(gb1_part_ptr + block * ((HQ + HK) * D) + h * D + cols, tl.sum(gy, axis=0))


@triton.jit(do_not_specialize=["T"])
def _bwd_gx_kernel(q_ptr, k_ptr, off_ptr, dw_w_ptr, gr_w_ptr, gy_ptr, gq_ptr, gk_ptr, gw0_part_ptr, T,
                   HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr):
    h = tl.program_id(1)
    block = tl.program_id(0)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, D)  # o, the contraction index of gy W1_tau
    C: tl.constexpr = (HQ + HK) * D
    rmask = (rows < T)[:, None]
    groups: tl.constexpr = HQ // HK
    # One [BLOCK_T, BLOCK_C] slice of gx at a time (a runtime loop, so it is not unrolled): only that slice's
    # accumulators and a [d, BLOCK_C] slice of W1_tau are live. Whole [d, d] tiles spilled ~60 KB per thread
    # on sm_90a (fp32 IEEE dots run on the FMA units and hold operands in registers).
    for c0 in range(0, D, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)  # channels c of this slice
        gx = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for a in tl.static_range(K0):
            gh1 = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)  # g_h1(rows + a)[:, cc]
            for tau in tl.static_range(K1):
                lead = a + K1 - 1 - tau
                src = rows + lead
                off = tl.load(off_ptr + src, mask=src < T, other=-1)
                ok = ((src < T) & (off >= lead))[:, None]  # rows + lead is still in the row's document
                g = tl.load(gy_ptr + src[:, None] * C + h * D + cols[None, :], mask=ok, other=0.0)  # [BLOCK_T, D]
                # W1_tau [o, c] = gr_weight[h d + o, c, tau]
                w1 = tl.load(gr_w_ptr + (h * D + cols[:, None]) * (D * K1) + cc[None, :] * K1 + tau)
                gh1 = tl.dot(g, w1, gh1, input_precision=DOT_PRECISION)
            gx += tl.load(dw_w_ptr + (h * D + cc) * K0 + K0 - 1 - a)[None, :] * gh1
            if a == 0:
                for j in tl.static_range(K0):
                    x = _load_x(q_ptr, k_ptr, off_ptr, rows, cc, K0 - 1 - j, h, T, HQ, HK, D)
                    tl.store(gw0_part_ptr + (block * C + h * D + cc) * K0 + j, tl.sum(gh1 * x, axis=0))
        if h < HQ:
            gq_own = tl.load(gy_ptr + rows[:, None] * C + h * D + cc[None, :], mask=rmask, other=0.0)
            gk_grp = tl.load(gy_ptr + rows[:, None] * C + (HQ + h // groups) * D + cc[None, :], mask=rmask,
                             other=0.0)
            gx += (gq_own + gk_grp / groups) * 0.5
            tl.store(gq_ptr + rows[:, None] * (HQ * D) + h * D + cc[None, :], gx, mask=rmask)
        else:
            gk_own = tl.load(gy_ptr + rows[:, None] * C + h * D + cc[None, :], mask=rmask, other=0.0) / groups
            # `gi`, not `g`: `g` is a tensor of the loop above, and a runtime-if arm may not retype it.
            for gi in tl.static_range(groups):
                gq_g = tl.load(gy_ptr + rows[:, None] * C + ((h - HQ) * groups + gi) * D + cc[None, :],
                               mask=rmask, other=0.0)
                gx += (gq_g + gk_own) * 0.5
            tl.store(gk_ptr + rows[:, None] * (HK * D) + (h - HQ) * D + cc[None, :], gx, mask=rmask)


@triton.jit(do_not_specialize=["T"])
def _bwd_gw1_kernel(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, gy_ptr, gw1_part_ptr, T, tokens_per_split,
                    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, K0: tl.constexpr, K1: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr):
    split = tl.program_id(0)
    h = tl.program_id(1)
    tau = tl.program_id(2) % K1
    cc = tl.program_id(2) // K1 * BLOCK_C + tl.arange(0, BLOCK_C)  # this program's columns c of gW1_tau
    cols = tl.arange(0, D)
    C: tl.constexpr = (HQ + HK) * D
    # A [d, BLOCK_C] column slice per program: a whole [d, d] accumulator spilled ~19 KB per thread on sm_90a.
    acc = tl.zeros((D, BLOCK_C), tl.float32)  # [o, c]
    start = split * tokens_per_split
    for t0 in range(start, tl.minimum(start + tokens_per_split, T), BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        g = tl.load(gy_ptr + rows[:, None] * C + h * D + cols[None, :], mask=(rows < T)[:, None], other=0.0)
        h1 = _h1(q_ptr, k_ptr, off_ptr, dw_w_ptr, dw_b_ptr, rows, cc, K1 - 1 - tau, h, T, HQ, HK, D, K0)
        acc = tl.dot(tl.trans(g), h1, acc, input_precision=DOT_PRECISION)
    tl.store(gw1_part_ptr + ((split * C + h * D + cols[:, None]) * D + cc[None, :]) * K1 + tau, acc)


def _check(q: torch.Tensor, k: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int,
           half: int) -> None:
    """The shapes the kernel tiles need (`unsupported_reason` answers without raising) and q/k agreeing."""
    reason = unsupported_reason(num_q_heads, num_kv_heads, head_dim, 2 * half)
    if reason:
        raise ValueError(f"Triton CCA preconditioner: {reason}")
    if q.shape[1] != num_q_heads * head_dim or k.shape[1] != num_kv_heads * head_dim or q.shape[0] != k.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match Hq={num_q_heads}, "
                         f"Hk={num_kv_heads}, d={head_dim}")


def _check_tiles(block_t: int, block_c: int, tokens_per_split: int) -> None:
    """Tiles Triton can compile: block_t is a tl.dot M (forward, gy, gx) and K (gW1) dimension, block_c
    an N one. Powers of two >= 16: Triton 3.6 rejects a K below 16 for fp32 operands too (3.9 takes 8)."""
    for name, size in (("block_t", block_t), ("block_c", block_c)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot tiles), got {size}")
    if tokens_per_split <= 0 or tokens_per_split % block_t:
        raise ValueError(f"tokens_per_split must be a positive multiple of block_t {block_t}, got {tokens_per_split}")


def unsupported_reason(num_q_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int) -> str | None:
    """Why the kernel cannot take these shapes (None when it can)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    if not pow2(head_dim) or head_dim < 16:
        return f"head_dim must be a power of two >= 16 (tl.dot tiles), got {head_dim}"
    if rotary_dim and not pow2(rotary_dim // 2):
        return f"rotary_dim / 2 must be a power of two (or rotary_dim 0), got rotary_dim {rotary_dim}"
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
    return None


class _CCAPrecondition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, dw_weight, dw_bias, gr_weight, gr_bias, temp, doc_offset, cos, sin, num_q_heads,
                num_kv_heads, head_dim, block_t, block_c, tokens_per_split, dot_precision):
        t = q.shape[0]
        hq, hk, d = num_q_heads, num_kv_heads, head_dim
        half = cos.shape[-1]
        k0, k1 = dw_weight.shape[-1], gr_weight.shape[-1]
        q_out = q.new_empty((t, hq, d), dtype=torch.float32)
        k_out = q.new_empty((t, hk, d), dtype=torch.float32)
        if t:
            _fwd_kernel[(triton.cdiv(t, block_t), hq + hk)](
                q, k, doc_offset, dw_weight, dw_bias, gr_weight, gr_bias, temp, cos, sin, q_out, k_out, t,
                d ** 0.5, _EPS, HQ=hq, HK=hk, D=d, K0=k0, K1=k1, HALF=half, BLOCK_T=block_t,
                DOT_PRECISION=dot_precision, num_warps=_NUM_WARPS)
        ctx.save_for_backward(q, k, dw_weight, dw_bias, gr_weight, gr_bias, temp, doc_offset, cos, sin)
        ctx.config = (hq, hk, d, block_t, block_c, tokens_per_split, dot_precision)
        return q_out, k_out

    @staticmethod
    def backward(ctx, g_q_out, g_k_out):
        q, k, dw_weight, dw_bias, gr_weight, gr_bias, temp, doc_offset, cos, sin = ctx.saved_tensors
        hq, hk, d, block_t, block_c, tokens_per_split, dot_precision = ctx.config
        t, channels, heads = q.shape[0], (hq + hk) * d, hq + hk
        half = cos.shape[-1]
        k0, k1 = dw_weight.shape[-1], gr_weight.shape[-1]
        g_q_out = g_q_out.to(torch.float32).contiguous() if g_q_out is not None else q.new_zeros(
            (t, hq, d), dtype=torch.float32)
        g_k_out = g_k_out.to(torch.float32).contiguous() if g_k_out is not None else q.new_zeros(
            (t, hk, d), dtype=torch.float32)
        blocks = triton.cdiv(t, block_t)
        splits = triton.cdiv(t, tokens_per_split)
        f32 = dict(device=q.device, dtype=torch.float32)
        gy = torch.empty((t, channels), **f32)
        gb1_part = torch.empty((blocks, channels), **f32)
        gtemp_part = torch.empty((blocks, hk), **f32)
        gw0_part = torch.empty((blocks, channels, k0), **f32)
        gw1_part = torch.empty((splits, channels, d, k1), **f32)
        g_q, g_k = torch.empty_like(q), torch.empty_like(k)
        consts = dict(HQ=hq, HK=hk, D=d, K0=k0, K1=k1, BLOCK_T=block_t, DOT_PRECISION=dot_precision,
                      num_warps=_NUM_WARPS)
        block_c = min(block_c, d)
        sliced = dict(consts, BLOCK_C=block_c)
        if t:
            _bwd_gy_kernel[(blocks, heads)](
                q, k, doc_offset, dw_weight, dw_bias, gr_weight, gr_bias, temp, cos, sin, g_q_out, g_k_out, gy,
                gb1_part, gtemp_part, t, d ** 0.5, _EPS, HALF=half, **consts)
            _bwd_gx_kernel[(blocks, heads)](q, k, doc_offset, dw_weight, gr_weight, gy, g_q, g_k, gw0_part, t,
                                            **sliced)
            _bwd_gw1_kernel[(splits, heads, k1 * (d // block_c))](q, k, doc_offset, dw_weight, dw_bias, gy,
                                                                  gw1_part, t, tokens_per_split, **sliced)
        gb1 = gb1_part.sum(0)  # [C]
        # every h1 (also the ones before a document start) carries b0 once into each of the k1 taps
        gb0 = torch.einsum("hoct,ho->hc", gr_weight.view(heads, d, d, k1), gb1.view(heads, d)).reshape(channels)
        return (g_q, g_k, gw0_part.sum(0).view_as(dw_weight), gb0, gw1_part.sum(0), gb1, gtemp_part.sum(0),
                None, None, None, None, None, None, None, None, None, None)


def cca_precondition(q: torch.Tensor, k: torch.Tensor, dw_weight: torch.Tensor, dw_bias: torch.Tensor,
                     gr_weight: torch.Tensor, gr_bias: torch.Tensor, temp: torch.Tensor, doc_offset: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                     block_t: int = 32, block_c: int = 32, tokens_per_split: int = 4096,
                     dot_precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.cca_precondition (same arguments and results).

    block_t: tokens per program (power of two >= 16); block_c: output columns per d x d product slice in the
    backward (power of two >= 16, capped at d); tokens_per_split: tokens per partial of gr_weight's
    gradient (a multiple of block_t); dot_precision: tl.dot input precision of the fp32 grouped-conv
    products, "ieee" by default (fp32 parity; "tf32x3" is the faster near-fp32 alternative on GPU).
    """
    _check(q, k, num_q_heads, num_kv_heads, head_dim, cos.shape[-1])
    _check_tiles(block_t, block_c, tokens_per_split)
    if interpreting():
        dot_precision = "ieee"  # the interpreter multiplies in plain fp32 whatever is asked
    # The fp32 casts are autograd ops: gradients return to the parameters in their own dtype.
    f32 = [p.to(torch.float32).contiguous() for p in (dw_weight, dw_bias, gr_weight, gr_bias, temp)]
    return _CCAPrecondition.apply(
        q.contiguous(), k.contiguous(), *f32, doc_offset.contiguous(), cos.to(torch.float32).contiguous(),
        sin.to(torch.float32).contiguous(), num_q_heads, num_kv_heads, head_dim, block_t, block_c,
        tokens_per_split, dot_precision)
