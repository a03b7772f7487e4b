"""Fused Triton router head: one forward kernel and one backward kernel per block of tokens.

Forward (`_route_fwd`, one program per BLOCK_T tokens): RMSNorm (fp32) -> fc1 + GELU -> fc2 + GELU ->
logits -> fp32 softmax -> + balancing biases -> argmax (first index on ties) -> replay override ->
gate = probs[chosen]. fc1 and fc2 are fused over fc1's output features: for each chunk of BLOCK_K
features, h1[:, chunk] = gelu(xn @ W1[chunk].T + b1[chunk]) is computed and immediately multiplied
into the fc2 accumulator (h1[:, chunk] @ W2[:, chunk].T), so no [BLOCK_T, R] h1 is ever assembled.
Weights (3 R^2 + C R values, 0.4 MB in bf16 at R = 256) are re-read by every program and stay in L2.

Saved for backward: r, the weights and `chosen` [T] (int64). No [T, R] activation is saved: the
backward recomputes them in-kernel (3 R^2 MACs per token, the same as the forward, cheaper than
writing and re-reading 4-5 [T, R] tensors from HBM between the passes).

Backward (`_route_bwd`, same token blocks): recomputes the forward, then
  dlogits = g p (onehot(c) - p_c)     (softmax-of-gather backward, fp32, = g p_c (onehot(c) - p))
  dz2 = (dlogits @ Wout) gelu'(z2),   dz1 = (dz2 @ W2) gelu'(z1),   dxn = dz1 @ W1
  grad_r = RMSNorm backward of dxn (fp32), written in r's dtype.
Weight gradients are reductions over T. The kernel writes the operands (xn, h1, h2, dz1, dz2 in the
compute dtype, dlogits [T, C]) and the weight gradients are cuBLAS GEMMs with K = T (split-K,
tensor cores, deterministic): per token that is 5 R + C compute-dtype values (2.6 KB at R = 256)
against 3 R^2 fp32 = 768 KB of per-program partials (24 KB per token at BLOCK_T = 32) or the same
traffic as contended atomics. The [R] gradients (fc1/fc2 biases, RMSNorm weight) are per-program
fp32 partial sums [T / BLOCK_T, R] summed afterwards (deterministic, 1/BLOCK_T of a [T, R] re-read).

T, the token count, changes every step: both kernels take it with `do_not_specialize`, so a new count
never compiles a new variant (Triton would specialise on T % 16 == 0 and T == 1). T only masks rows; the
vectorised axis of every [BLOCK_T, R] tile is R (sm_90a PTX: the same vector widths either way, but for
one or two [BLOCK_T] index loads of the fp32 path, v2 before).

Casts follow the reference (reference.py): every linear output and GELU output is rounded to the
compute dtype (the weights' dtype), softmax and the norm in fp32; tl.dot accumulates in fp32 and
uses IEEE fp32 (not TF32) when the compute dtype is fp32. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zrl.types import NO_ROUTE

# tl.constexpr: a compiled kernel may read a module global only as a constexpr (plain floats raise
# NameError at compile time; the interpreter accepts them, so only an sm_90a compile catches it).
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _gelu(z):
    """Exact-erf GELU of fp32 z (the formula of torch's gelu)."""
    return z * 0.5 * (1.0 + tl.erf(z * _SQRT1_2))


@triton.jit
def _gelu_grad(z):
    """d gelu / dz at fp32 z."""
    cdf = 0.5 * (1.0 + tl.erf(z * _SQRT1_2))
    pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return cdf + z * pdf


@triton.jit
def _normed(R_ptr, NW, rows, row_ok, cols, col_ok, stride_r, R, eps):
    """x [BT, BR] fp32, rstd [BT], xn = x * rstd * w [BT, BR] fp32 (zero in padded lanes)."""
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(R_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(NW + cols, mask=col_ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / R + eps)
    return x, rstd, (x * rstd[:, None]) * w[None, :]


@triton.jit
def _fc1_chunk(xn_c, W1, B1, k0, cols, col_ok, R, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """z1[:, k0:k0+BK] = xn @ W1[k0:k0+BK].T + b1, rounded to the compute dtype, returned as fp32."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < R
    w1t = tl.load(W1 + ks[None, :] * R + cols[:, None], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
    b1 = tl.load(B1 + ks, mask=k_ok, other=0.0).to(tl.float32)
    z1 = tl.dot(xn_c, w1t, input_precision=DOT_PRECISION) + b1[None, :]  # [BT, BK]
    return z1.to(xn_c.dtype).to(tl.float32), ks, k_ok


@triton.jit
def _probs(h2_c, WO, cols, col_ok, cls, cls_ok, R, DOT_PRECISION: tl.constexpr):
    """softmax(h2 @ Wout.T) in fp32 over the C real classes: [BT, BC], zero in padded classes."""
    wot = tl.load(WO + cls[None, :] * R + cols[:, None], mask=col_ok[:, None] & cls_ok[None, :], other=0.0)
    logits = tl.dot(h2_c, wot, input_precision=DOT_PRECISION).to(h2_c.dtype).to(tl.float32)  # [BT, BC]
    logits = tl.where(cls_ok[None, :], logits, float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit(do_not_specialize=["T"])
def _route_fwd(R_ptr, NW, W1, B1, W2, B2, WO, BIAS, REPLAY, GATE, CHOSEN, NATIVE,
               T, R, C, stride_r, eps,
               HAS_REPLAY: tl.constexpr, SENTINEL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_R)
    col_ok = cols < R
    cls = tl.arange(0, BLOCK_C)
    cls_ok = cls < C
    cdtype = W1.dtype.element_ty

    _, _, xn = _normed(R_ptr, NW, rows, row_ok, cols, col_ok, stride_r, R, eps)
    xn_c = xn.to(cdtype)  # [BT, BR]
    acc2 = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)  # fc2 pre-activation, summed over fc1 chunks
    for k0 in range(0, BLOCK_R, BLOCK_K):
        z1, ks, k_ok = _fc1_chunk(xn_c, W1, B1, k0, cols, col_ok, R, BLOCK_K, DOT_PRECISION)
        h1 = _gelu(z1).to(cdtype)  # [BT, BK]
        w2t = tl.load(W2 + cols[None, :] * R + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc2 = tl.dot(h1, w2t, acc2, input_precision=DOT_PRECISION)
    b2 = tl.load(B2 + cols, mask=col_ok, other=0.0).to(tl.float32)
    z2 = (acc2 + b2[None, :]).to(cdtype).to(tl.float32)
    p = _probs(_gelu(z2).to(cdtype), WO, cols, col_ok, cls, cls_ok, R, DOT_PRECISION)  # [BT, BC]

    bias = tl.load(BIAS + cls, mask=cls_ok, other=0.0).to(tl.float32)
    scored = tl.where(cls_ok[None, :], p + bias[None, :], float("-inf"))
    native = tl.argmax(scored, axis=1, tie_break_left=True).to(tl.int64)  # [BT]
    chosen = native
    if HAS_REPLAY:
        replay = tl.load(REPLAY + rows, mask=row_ok, other=SENTINEL).to(tl.int64)
        chosen = tl.where(replay == SENTINEL, native, replay)
    gate = tl.sum(tl.where(cls[None, :] == chosen[:, None], p, 0.0), axis=1)
    tl.store(GATE + rows, gate, mask=row_ok)
    tl.store(CHOSEN + rows, chosen, mask=row_ok)
    tl.store(NATIVE + rows, native, mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _route_bwd(R_ptr, NW, W1, B1, W2, B2, WO, CHOSEN, DGATE,
               DR, XN, H1, H2, DZ1, DZ2, DLOGITS, DNW_PART, DB1_PART, DB2_PART,
               T, R, C, stride_r, stride_dr, eps,
               DOT_PRECISION: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_R)
    col_ok = cols < R
    cls = tl.arange(0, BLOCK_C)
    cls_ok = cls < C
    tile_ok = row_ok[:, None] & col_ok[None, :]
    tile = rows[:, None] * R + cols[None, :]  # offsets into the [T, R] operand outputs
    cdtype = W1.dtype.element_ty

    # Recompute the forward; store the weight-gradient operands xn, h1, h2.
    x, rstd, xn = _normed(R_ptr, NW, rows, row_ok, cols, col_ok, stride_r, R, eps)
    xn_c = xn.to(cdtype)
    tl.store(XN + tile, xn_c, mask=tile_ok)
    acc2 = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, BLOCK_R, BLOCK_K):
        z1, ks, k_ok = _fc1_chunk(xn_c, W1, B1, k0, cols, col_ok, R, BLOCK_K, DOT_PRECISION)
        h1 = _gelu(z1).to(cdtype)
        tl.store(H1 + rows[:, None] * R + ks[None, :], h1, mask=row_ok[:, None] & k_ok[None, :])
        w2t = tl.load(W2 + cols[None, :] * R + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc2 = tl.dot(h1, w2t, acc2, input_precision=DOT_PRECISION)
    b2 = tl.load(B2 + cols, mask=col_ok, other=0.0).to(tl.float32)
    z2 = (acc2 + b2[None, :]).to(cdtype).to(tl.float32)  # [BT, BR]
    h2_c = _gelu(z2).to(cdtype)
    tl.store(H2 + tile, h2_c, mask=tile_ok)
    p = _probs(h2_c, WO, cols, col_ok, cls, cls_ok, R, DOT_PRECISION)  # [BT, BC]

    # Softmax-of-gather backward in fp32, as autograd does it: p * (dprobs - sum(dprobs * p)).
    chosen = tl.load(CHOSEN + rows, mask=row_ok, other=0)
    g = tl.load(DGATE + rows, mask=row_ok, other=0.0)  # [BT]; zero for padded rows
    onehot = cls[None, :] == chosen[:, None]
    p_c = tl.sum(tl.where(onehot, p, 0.0), axis=1)
    dl = p * (tl.where(onehot, g[:, None], 0.0) - (g * p_c)[:, None])
    dl_c = tl.where(cls_ok[None, :], dl, 0.0).to(cdtype)  # [BT, BC]
    tl.store(DLOGITS + rows[:, None] * C + cls[None, :], dl_c, mask=row_ok[:, None] & cls_ok[None, :])

    wo = tl.load(WO + cls[:, None] * R + cols[None, :], mask=cls_ok[:, None] & col_ok[None, :], other=0.0)
    dh2 = tl.dot(dl_c, wo, input_precision=DOT_PRECISION).to(cdtype).to(tl.float32)  # [BT, BR]
    dz2_c = (dh2 * _gelu_grad(z2)).to(cdtype)
    tl.store(DZ2 + tile, dz2_c, mask=tile_ok)
    tl.store(DB2_PART + pid * R + cols, tl.sum(dz2_c.to(tl.float32), axis=0), mask=col_ok)

    dxn = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, BLOCK_R, BLOCK_K):
        z1, ks, k_ok = _fc1_chunk(xn_c, W1, B1, k0, cols, col_ok, R, BLOCK_K, DOT_PRECISION)
        w2 = tl.load(W2 + cols[:, None] * R + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        dh1 = tl.dot(dz2_c, w2, input_precision=DOT_PRECISION).to(cdtype).to(tl.float32)  # [BT, BK]
        dz1_c = (dh1 * _gelu_grad(z1)).to(cdtype)
        tl.store(DZ1 + rows[:, None] * R + ks[None, :], dz1_c, mask=row_ok[:, None] & k_ok[None, :])
        tl.store(DB1_PART + pid * R + ks, tl.sum(dz1_c.to(tl.float32), axis=0), mask=k_ok)
        w1 = tl.load(W1 + ks[:, None] * R + cols[None, :], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        dxn = tl.dot(dz1_c, w1, dxn, input_precision=DOT_PRECISION)
    # fc1's input gradient is produced in the compute dtype, then cast back to fp32 for the norm.
    dy = dxn.to(cdtype).to(tl.float32)

    # RMSNorm backward (fp32): y = u w with u = x rstd; dx = rstd (dy w - u mean(dy w u)).
    w = tl.load(NW + cols, mask=col_ok, other=0.0).to(tl.float32)
    u = x * rstd[:, None]
    tl.store(DNW_PART + pid * R + cols, tl.sum(dy * u, axis=0), mask=col_ok)
    du = dy * w[None, :]
    dx = rstd[:, None] * (du - u * (tl.sum(du * u, axis=1) / R)[:, None])
    tl.store(DR + rows[:, None] * stride_dr + cols[None, :], dx.to(DR.dtype.element_ty), mask=tile_ok)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: IEEE products (parity with torch, whose fp32 matmuls do not use TF32 by default);
    # 16-bit operands ignore the setting and use the tensor cores with fp32 accumulation.
    return "ieee" if dtype == torch.float32 else "tf32"


def _blocks(r_size: int, num_classes: int, block_t: int, block_k: int) -> dict[str, int]:
    block_r = max(16, triton.next_power_of_2(r_size))  # tl.dot needs every dimension >= 16
    return dict(BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=min(block_k, block_r),
                BLOCK_C=max(16, triton.next_power_of_2(num_classes)))


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
                balancing_biases, replay, eps, block_t, block_k, num_warps, num_stages):
        t, r_size = r.shape
        num_classes = out_weight.shape[0]
        r = r if r.stride(-1) == 1 else r.contiguous()
        weights = [w.contiguous()
                   for w in (norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight)]
        gate = torch.empty(t, dtype=torch.float32, device=r.device)
        chosen = torch.empty(t, dtype=torch.int64, device=r.device)
        native = torch.empty(t, dtype=torch.int64, device=r.device)
        blocks = _blocks(r_size, num_classes, block_t, block_k)
        if t > 0:
            _route_fwd[(triton.cdiv(t, block_t),)](
                # replay is often a column of the [T, L] record: a strided view, made contiguous ([T] bytes)
                r, *weights, balancing_biases.contiguous(), replay.contiguous() if replay is not None else chosen,
                gate, chosen, native, t, r_size, num_classes, r.stride(0), eps,
                HAS_REPLAY=replay is not None, SENTINEL=NO_ROUTE,
                DOT_PRECISION=_dot_precision(fc1_weight.dtype), num_warps=num_warps, num_stages=num_stages,
                **blocks)
        ctx.save_for_backward(r, *weights, chosen)
        ctx.eps, ctx.blocks, ctx.num_warps, ctx.num_stages = eps, blocks, num_warps, num_stages
        ctx.mark_non_differentiable(chosen, native)
        return gate, chosen, native

    @staticmethod
    def backward(ctx, grad_gate, _grad_chosen, _grad_native):
        r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, chosen = ctx.saved_tensors
        t, r_size = r.shape
        num_classes = out_weight.shape[0]
        blocks = ctx.blocks
        num_blocks = triton.cdiv(t, blocks["BLOCK_T"])
        cdtype = fc1_weight.dtype

        def act(width: int) -> torch.Tensor:
            return torch.empty(t, width, dtype=cdtype, device=r.device)

        grad_r = torch.empty_like(r)
        xn, h1, h2, dz1, dz2, dlogits = act(r_size), act(r_size), act(r_size), act(r_size), act(r_size), \
            act(num_classes)
        # Per-program partial sums over tokens of the [R] gradients: [T / BLOCK_T, R] fp32 each.
        dnw_part, db1_part, db2_part = (torch.zeros(num_blocks, r_size, dtype=torch.float32, device=r.device)
                                        for _ in range(3))
        if t > 0:
            _route_bwd[(num_blocks,)](
                r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight, chosen,
                grad_gate.contiguous().float(), grad_r, xn, h1, h2, dz1, dz2, dlogits, dnw_part, db1_part,
                db2_part,
                t, r_size, num_classes, r.stride(0), grad_r.stride(0), ctx.eps,
                DOT_PRECISION=_dot_precision(cdtype), num_warps=ctx.num_warps, num_stages=ctx.num_stages,
                **blocks)
        need = ctx.needs_input_grad
        grads = (
            grad_r if need[0] else None,
            dnw_part.sum(0).to(norm_weight.dtype) if need[1] else None,
            dz1.t() @ xn if need[2] else None,  # [R, R]
            db1_part.sum(0).to(fc1_bias.dtype) if need[3] else None,  # [R]
            dz2.t() @ h1 if need[4] else None,  # [R, R]
            db2_part.sum(0).to(fc2_bias.dtype) if need[5] else None,  # [R]
            dlogits.t() @ h2 if need[6] else None,  # [C, R]
        )
        return (*grads, None, None, None, None, None, None, None)


def route(r: torch.Tensor, norm_weight: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor,
          fc2_weight: torch.Tensor, fc2_bias: torch.Tensor, out_weight: torch.Tensor,
          balancing_biases: torch.Tensor, replay: torch.Tensor | None, eps: float, *,
          block_t: int = 32, block_k: int | None = None, num_warps: int = 8,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused router head (see reference.route for the definition). Block sizes: tokens per
    program and fc1 features per chunk (powers of two, >= 16; block_k defaults by dtype).

    fp32 weights get block_k 16 and 2 pipeline stages: fp32 dots run on FMA units (no tensor cores),
    and with bf16's 64 / 3 stages the sm_90a compile asked 296 KiB (forward) and 456 KiB (backward) of
    shared memory, over the 227 KiB limit, and spilled tens of KB; at 16 / 2 it needs 66 / 114 KiB and
    spills 0 / 0.8 KB (sm90_check.py)."""
    fp32 = fc1_weight.dtype == torch.float32
    if block_k is None:
        block_k = 16 if fp32 else 64
    num_stages = 2 if fp32 else 3
    if not fc1_weight.dtype == fc2_weight.dtype == out_weight.dtype:
        raise ValueError(f"the fused router needs fc1, fc2 and out weights of one dtype, got "
                         f"{fc1_weight.dtype}, {fc2_weight.dtype}, {out_weight.dtype}")
    for name, block in (("block_t", block_t), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot tiles), got {block}")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    return _Route.apply(r, norm_weight, fc1_weight, fc1_bias, fc2_weight, fc2_bias, out_weight,
                        balancing_biases, replay, eps, block_t, block_k, num_warps, num_stages)
