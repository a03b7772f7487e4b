"""Triton residual scaling + add + RMSNorm: one pass over each row block forward, one backward.

Forward (`_forward_kernel`), one program per block of BLOCK_T rows, each row whole in registers
(BLOCK_D = next power of two >= D, masked):
  x      = (b + hs_bias) * hs_scale + (r + res_bias) * res_scale       fp32, stored     [T, D]
  rstd   = 1 / sqrt(sum(x^2) / D + eps)                                fp32, saved      [T]
  normed = x * rstd * norm_weight                                      fp32, stored     [T, D]
normed is stored in fp32 or, with `out_dtype=torch.bfloat16`, rounded to bf16 in the kernel (nearest even, on
the fp32 bits, as `Tensor.to` rounds: exact in Triton's interpreter too) for a consumer that would cast it
so: a GEMM in bf16. Its gradient then arrives in bf16 and is read as such.
The same kernel runs the two other modes with constexpr switches: scaling alone (no norm weight:
no statistics, nothing saved) and RMSNorm alone (`rms_norm`: x is the input itself, not stored).

Backward (`_backward_kernel`) recomputes x from branch and residual (both are needed anyway for the
scale gradients, so storing x would only add [T, D] fp32 of memory) and reads rstd:
  gn = g_normed * w;   g_x += rstd * (gn - n * mean(gn * n))           n = x * rstd
  g_branch = g_x * hs_scale (branch dtype);   g_residual = g_x * res_scale (residual dtype)
The [D] parameter gradients are row sums. A fixed number of programs P (a few per SM) each strides
over the row blocks, accumulates its partial sums in fp32 registers and writes one row of a
[5, P, D] buffer; torch sums over P afterwards (the usual fused-layernorm split: no atomics, so the
result is deterministic, and P is small enough that the extra reduction costs ~P/T of the main pass).
With `stages` > 1 the row loop is software-pipelined (Triton's `tl.range(num_stages=...)`): the loads
of the next stages - 1 row blocks go to shared memory (cp.async) while one block computes. Registers
hold one resident program per SM at D = 2048 (~165 per thread x 256 threads), so without it one row of
~28 KB is in flight per SM, which caps the pass near a quarter of HBM's bandwidth.

T, the row count, changes every step: both kernels take it with `do_not_specialize`, so a new count
never compiles a new variant (Triton would specialise on T % 16 == 0 and T == 1). T only masks rows and
bounds the backward's row loop; the vectorised axis is D, which stays specialised (its divisibility
decides the width of every load and store). The default BLOCK_T depends on T only below
tile / next_power_of_2(D) rows (2 forward, 1 backward at D = 2048).

No host synchronisation: grids come from shapes only. All statistics and products are fp32 whatever
the input dtypes (branch usually bf16, residual fp32, parameters bf16 under FSDP2 mixed precision).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from zrl.modeling.kernels.bf16_split_triton import as_int16, bf16_bits

# Elements of one [BLOCK_T, BLOCK_D] tile (GPU defaults; tests pass small block_t). The backward
# holds about twice as many live tiles per row (b, r, x, g_x, g_normed, n), hence the smaller tile.
_FORWARD_TILE = 4096
_BACKWARD_TILE = 2048
_PROGRAMS_PER_SM = 4  # backward programs per SM: enough warps in flight to hide memory latency
_PARTIALS = 5  # rows of the partial-sum buffer: hs_scale, hs_bias, res_scale, res_bias, norm_weight
# Row blocks the backward's loop keeps in flight (see the docstring). 1: no pipelining, what the H200
# timed (bf16 scaling + norm at 64k tokens: backward ~2.4 ms, ~1.1 TB/s; forward 3.3 TB/s). PIPELINED_STAGES
# is the candidate: 3 blocks in flight, 64 KiB of shared memory per program at D = 2048 (sm_90a, Triton
# 3.6 and 3.9: 171 registers, no spills). The GPU probe times both ("triton pipelined" rows) and runs the
# trainer with it ("+pipelined_norm"); BACKWARD_STAGES takes it when it wins.
BACKWARD_STAGES = 1
PIPELINED_STAGES = 3


@triton.jit(do_not_specialize=["T"])
def _forward_kernel(B, R, HS, HB, RS, RB, W, X, Y, RSTD, T, D, eps,
                    HAS_SCALING: tl.constexpr, HAS_NORM: tl.constexpr, Y_BF16: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_ok = rows < T
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]  # int64: T * D can pass 2^31
    x = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALING:
        r = tl.load(R + offsets, mask=mask, other=0.0).to(tl.float32)
        hs = tl.load(HS + cols, mask=col_ok, other=0.0).to(tl.float32)
        hb = tl.load(HB + cols, mask=col_ok, other=0.0).to(tl.float32)
        rs = tl.load(RS + cols, mask=col_ok, other=0.0).to(tl.float32)
        rb = tl.load(RB + cols, mask=col_ok, other=0.0).to(tl.float32)
        # masked columns give 0, so they add nothing to the statistics below
        x = (x + hb[None, :]) * hs[None, :] + (r + rb[None, :]) * rs[None, :]
        tl.store(X + offsets, x, mask=mask)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_T]
        tl.store(RSTD + rows, rstd, mask=row_ok)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        if Y_BF16:  # Y: the bf16 output viewed as int16
            tl.store(Y + offsets, as_int16(bf16_bits(y)[0]), mask=mask)
        else:
            tl.store(Y + offsets, y, mask=mask)


@triton.jit(do_not_specialize=["T"])
def _backward_kernel(B, R, HS, HB, RS, RB, W, RSTD, GX, GY, GB, GR, PARTIAL, T, D,
                     HAS_SCALING: tl.constexpr, HAS_NORM: tl.constexpr, HAS_GX: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if HAS_SCALING:
        hs = tl.load(HS + cols, mask=col_ok, other=0.0).to(tl.float32)
        hb = tl.load(HB + cols, mask=col_ok, other=0.0).to(tl.float32)
        rs = tl.load(RS + cols, mask=col_ok, other=0.0).to(tl.float32)
        rb = tl.load(RB + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc_hs = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_hb = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_rs = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_rb = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in tl.range(pid * BLOCK_T, T, programs * BLOCK_T, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        row_ok = rows < T
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]
        x = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALING:
            a = x + hb[None, :]
            c = tl.load(R + offsets, mask=mask, other=0.0).to(tl.float32) + rb[None, :]
            x = a * hs[None, :] + c * rs[None, :]
        if HAS_GX:
            gx = tl.load(GX + offsets, mask=mask, other=0.0).to(tl.float32)
        else:
            gx = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        if HAS_NORM:
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]  # [BLOCK_T, 1]
            gy = tl.load(GY + offsets, mask=mask, other=0.0).to(tl.float32)
            n = x * rstd
            gn = gy * w[None, :]
            acc_w += tl.sum(gy * n, axis=0)
            gx += (gn - n * (tl.sum(gn * n, axis=1) / D)[:, None]) * rstd
        if HAS_SCALING:
            gb = gx * hs[None, :]
            gr = gx * rs[None, :]
            tl.store(GB + offsets, gb.to(GB.dtype.element_ty), mask=mask)
            tl.store(GR + offsets, gr.to(GR.dtype.element_ty), mask=mask)
            acc_hs += tl.sum(gx * a, axis=0)
            acc_hb += tl.sum(gb, axis=0)
            acc_rs += tl.sum(gx * c, axis=0)
            acc_rb += tl.sum(gr, axis=0)
        else:
            tl.store(GB + offsets, gx.to(GB.dtype.element_ty), mask=mask)
    row = PARTIAL + pid * D + cols  # PARTIAL: [5, P, D]
    plane = programs * D
    if HAS_SCALING:
        tl.store(row, acc_hs, mask=col_ok)
        tl.store(row + plane, acc_hb, mask=col_ok)
        tl.store(row + 2 * plane, acc_rs, mask=col_ok)
        tl.store(row + 3 * plane, acc_rb, mask=col_ok)
    if HAS_NORM:
        tl.store(row + 4 * plane, acc_w, mask=col_ok)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_warps(tile: int) -> int:
    return 4 if tile <= 2048 else 8 if tile <= 8192 else 16


def _block_t(block_t: int | None, tile: int, block_d: int, rows: int) -> int:
    if block_t is None:
        block_t = min(max(tile // block_d, 1), triton.next_power_of_2(max(rows, 1)))
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 1, got {block_t}")
    if block_t * block_d > tl.TRITON_MAX_TENSOR_NUMEL:  # Triton's limit on one tensor's elements
        raise ValueError(f"block_t {block_t} x next_power_of_2(D) {block_d} exceeds Triton's "
                         f"{tl.TRITON_MAX_TENSOR_NUMEL} elements per tile")
    return block_t


class _ResidualNorm(torch.autograd.Function):
    """Modes: scaling + norm (outputs x, normed), scaling alone (x), norm alone (normed)."""

    @staticmethod
    def forward(ctx, branch, residual, hs, hb, rs, rb, weight, eps, block_t, num_partials, stages, out_dtype):
        scaling, norm = residual is not None, weight is not None
        dim = branch.shape[-1]
        b = branch.reshape(-1, dim).contiguous()  # [T, D]
        rows = b.shape[0]
        r = residual.reshape(-1, dim).contiguous() if scaling else None
        vectors = [v.contiguous() if v is not None else None for v in (hs, hb, rs, rb, weight)]
        x = torch.empty(rows, dim, device=b.device, dtype=torch.float32) if scaling else None
        y_bf16 = out_dtype == torch.bfloat16
        y = torch.empty(rows, dim, device=b.device, dtype=torch.bfloat16 if y_bf16 else torch.float32) if norm else None
        rstd = torch.empty(rows, device=b.device, dtype=torch.float32) if norm else None
        block_d = triton.next_power_of_2(dim)
        fwd_block_t = _block_t(block_t, _FORWARD_TILE, block_d, rows)
        if rows:
            _forward_kernel[(triton.cdiv(rows, fwd_block_t),)](
                b, r, *vectors, x, y.view(torch.int16) if y_bf16 else y, rstd, rows, dim, eps,
                HAS_SCALING=scaling, HAS_NORM=norm, Y_BF16=y_bf16,
                BLOCK_T=fwd_block_t, BLOCK_D=block_d, num_warps=_num_warps(fwd_block_t * block_d))
        ctx.save_for_backward(b, r, *vectors, rstd)
        ctx.shape, ctx.branch_dtype = branch.shape, branch.dtype
        ctx.residual_dtype = residual.dtype if scaling else None
        ctx.block_t, ctx.num_partials = block_t, num_partials
        ctx.stages = BACKWARD_STAGES if stages is None else stages
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: the kernel skips it
        outputs = ([x.view(branch.shape)] if scaling else []) + ([y.view(branch.shape)] if norm else [])
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        b, r, hs, hb, rs, rb, weight, rstd = ctx.saved_tensors
        scaling, norm = r is not None, weight is not None
        g_x = grads[0] if scaling else None
        g_y = grads[-1] if norm else None
        none = (None,) * 12
        if g_x is None and g_y is None:
            return none
        rows, dim = b.shape
        block_d = triton.next_power_of_2(dim)
        block_t = _block_t(ctx.block_t, _BACKWARD_TILE, block_d, rows)
        blocks = triton.cdiv(rows, block_t)
        programs = ctx.num_partials
        if programs is None:
            programs = _PROGRAMS_PER_SM * _sm_count(b.device.index) if b.is_cuda else 4
        programs = max(min(programs, blocks), 1)
        grad_b = torch.empty(rows, dim, device=b.device, dtype=ctx.branch_dtype)
        grad_r = torch.empty(rows, dim, device=b.device, dtype=ctx.residual_dtype) if scaling else None
        has_norm_grad = norm and g_y is not None
        # [5, P, D]; every program writes its row of each plane the mode uses (zeros when it had no
        # rows), so no zero-fill, and the planes the mode does not use are never read
        partial = torch.empty(_PARTIALS, programs, dim, device=b.device, dtype=torch.float32)
        if rows:
            _backward_kernel[(programs,)](
                b, r, hs, hb, rs, rb, weight, rstd,
                None if g_x is None else g_x.reshape(rows, dim).contiguous(),
                g_y.reshape(rows, dim).contiguous() if has_norm_grad else None,
                grad_b, grad_r, partial, rows, dim,
                HAS_SCALING=scaling, HAS_NORM=has_norm_grad, HAS_GX=g_x is not None,
                # Twice the forward's warps for a tile: each thread keeps ten [BLOCK_D] vectors (5 parameters,
                # 5 partial sums) besides the row tiles. At D = 2048 (block_t 1), 4 warps needed 255 registers
                # and spilled 52 B in the bf16 scaling + norm case (sm_90a compile, sm90_check.py).
                BLOCK_T=block_t, BLOCK_D=block_d, STAGES=ctx.stages, num_warps=_num_warps(2 * block_t * block_d))
        if not rows:
            partial.zero_()  # no program ran
        if not has_norm_grad:
            weight = None  # normed unused: no gradient for its weight (as autograd gives the reference)

        def param_grad(i: int, param: torch.Tensor | None) -> torch.Tensor | None:
            return None if param is None else partial[i].sum(0).to(param.dtype)  # [D]

        return (grad_b.view(ctx.shape), None if grad_r is None else grad_r.view(ctx.shape),
                param_grad(0, hs), param_grad(1, hb), param_grad(2, rs), param_grad(3, rb),
                param_grad(4, weight), None, None, None, None, None)


def scaled_residual_add_rmsnorm(
    branch: torch.Tensor, residual: torch.Tensor, hs_scale: torch.Tensor, hs_bias: torch.Tensor,
    res_scale: torch.Tensor, res_bias: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
    *, block_t: int | None = None, num_partials: int | None = None, stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused op (see the package's `scaled_residual_add_rmsnorm`). block_t: rows per program
    (power of two; default fills a tile of ~4096 elements forward, ~2048 backward); num_partials:
    backward programs, i.e. rows of the partial-sum buffer (default a few per SM); stages: row blocks
    the backward keeps in flight (default BACKWARD_STAGES)."""
    _check_tuning(num_partials, stages)
    out = _ResidualNorm.apply(branch, residual, hs_scale, hs_bias, res_scale, res_bias, norm_weight, eps,
                              block_t, num_partials, stages, None)
    return (out[0], out[1]) if norm_weight is not None else (out, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None, *,
             block_t: int | None = None, num_partials: int | None = None, stages: int | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight in fp32, [..., C] -> fp32, or bf16 where `out_dtype` says so (the
    package's `rms_norm`; another out_dtype is a cast of the fp32 result)."""
    _check_tuning(num_partials, stages)
    y = _ResidualNorm.apply(x, None, None, None, None, None, weight, eps, block_t, num_partials, stages, out_dtype)
    return y if out_dtype is None else y.to(out_dtype)


def _check_tuning(num_partials: int | None, stages: int | None) -> None:
    if num_partials is not None and num_partials < 1:
        raise ValueError(f"num_partials must be >= 1 (backward programs), got {num_partials}")
    if stages is not None and stages < 1:
        raise ValueError(f"stages must be >= 1 (row blocks in flight), got {stages}")
