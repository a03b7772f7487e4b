"""The glue around grouped_mm.py's two grouped GEMMs: the row moves and the SwiGLU, each one Triton pass
in each direction.

grouped_mm.py sorts the tokens by expert (`order`: sorted row -> token; rows past n = offs[E-1], the
skip class, are outside every group). In PyTorch ops its glue is a gather and a `where` before the
first GEMM, a `silu` and a product between the two, and after the down GEMM a `where`, an fp32 product
with the gate and an `index_copy` back to token order: seven passes forward and about a dozen backward,
several of them fp32. Here (i a sorted row, t = order[i]):
  permute           x_sorted[i] = x[t] cast to the weights' dtype for i < n, else 0
                    backward: g_x[t] = g_x_sorted[i] for i < n, else 0
  unpermute_scale   y[t] = y_sorted[i] * gate[t] (fp32) for i < n, else 0
                    backward: g_y_sorted[i] = g_y[t] * gate[t] (cast to y_sorted's dtype) and
                    g_gate[t] = sum_d g_y[t, d] y_sorted[i, d] for i < n; 0 for the skip class
  swiglu            act[i] = silu(g[i]) * u[i] for i < n, [g; u] = the gate_up GEMM's row, each product
                    rounded to the weights' dtype as the PyTorch ops round it (silu, then the product)
                    backward: du = g_act * silu(g), dg = (g_act * u) * sigmoid(g) (1 + g (1 - sigmoid(g)))
                    into one [g; u]-shaped gradient; rows past n are left unwritten, as the grouped
                    GEMMs leave them (neither GEMM reads them)
Every row of a moved destination is written exactly once (`order` is a permutation): no zero fill, no
atomics. n is read on the device (offs[E-1]): no host synchronisation. The values are the PyTorch
glue's: the same products and casts, bitwise for the row moves but for g_gate's sum order; the SwiGLU's
silu and sigmoid may differ from torch's vectorised ones by an ulp of fp32 before the rounding.

One program per sorted row and up to 1,024 columns; the token count is the grid, not an argument, so a
new count compiles no new variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_D = 1024  # columns per program: a bf16 row of D = F = 2048 in two programs


@triton.jit
def _silu(g):
    """silu of fp32 g, the formula of torch's CUDA kernel (x / (1 + exp(-x)))."""
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _move_rows_kernel(src_ptr, order_ptr, n_ptr, scale_ptr, dst_ptr, D: tl.constexpr, SCATTER: tl.constexpr,
                      HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sorted row i = program 0, token t = order[i]: dst[t] = src[i] (SCATTER) or dst[i] = src[t], times
    scale[t] (HAS_SCALE) in fp32, cast to dst's dtype; zero where i >= n."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    t = tl.load(order_ptr + i)
    routed = cmask & (i + 0 * cols < tl.load(n_ptr))  # [BLOCK_D]: the interpreter takes no scalar mask
    if SCATTER:
        src_row, dst_row = i, t
    else:
        src_row, dst_row = t, i
    value = tl.load(src_ptr + src_row * D + cols, mask=routed, other=0.0)
    if HAS_SCALE:
        value = value.to(tl.float32) * tl.load(scale_ptr + t)
    tl.store(dst_ptr + dst_row * D + cols, value.to(dst_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _unpermute_scale_bwd_kernel(g_y_ptr, y_sorted_ptr, order_ptr, n_ptr, gate_ptr, g_y_sorted_ptr, g_gate_ptr,
                                D: tl.constexpr, BLOCK_D: tl.constexpr):
    """g_y_sorted[i] = g_y[t] * gate[t] and g_gate[t] = g_y[t] . y_sorted[i] for sorted row i < n; zeros past n.
    One program per row: the dot runs over the whole row, BLOCK_D columns at a time."""
    i = tl.program_id(0).to(tl.int64)
    t = tl.load(order_ptr + i)
    n = tl.load(n_ptr)
    gate = tl.load(gate_ptr + t)
    dot = tl.zeros((BLOCK_D,), tl.float32)
    for start in tl.static_range(0, D, BLOCK_D):
        cols = start + tl.arange(0, BLOCK_D)
        m = (cols < D) & (i + 0 * cols < n)
        g = tl.load(g_y_ptr + t * D + cols, mask=m, other=0.0)
        y = tl.load(y_sorted_ptr + i * D + cols, mask=m, other=0.0).to(tl.float32)
        dot += g * y
        tl.store(g_y_sorted_ptr + i * D + cols, (g * gate).to(g_y_sorted_ptr.dtype.element_ty), mask=cols < D)
    tl.store(g_gate_ptr + t, tl.sum(dot, axis=0))


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, n_ptr, act_ptr, F: tl.constexpr, BLOCK_F: tl.constexpr):
    """act[i, cols] = silu(g) * u of row i < n, rounded as torch rounds F.silu(g) * u in the weights' dtype."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (cols < F) & (i + 0 * cols < tl.load(n_ptr))
    g = tl.load(gu_ptr + i * 2 * F + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + i * 2 * F + F + cols, mask=m, other=0.0)
    silu = _silu(g).to(u.dtype)
    tl.store(act_ptr + i * F + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(act_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd_kernel(g_act_ptr, gu_ptr, n_ptr, g_gu_ptr, F: tl.constexpr, BLOCK_F: tl.constexpr):
    """[dg; du] of row i < n from g_act and the saved [g; u], in autograd's order of roundings: du = g_act silu(g)
    (silu rounded first), d_silu = g_act u rounded, dg = d_silu sigmoid(g) (1 + g (1 - sigmoid(g)))."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (cols < F) & (i + 0 * cols < tl.load(n_ptr))
    g = tl.load(gu_ptr + i * 2 * F + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + i * 2 * F + F + cols, mask=m, other=0.0)
    g_act = tl.load(g_act_ptr + i * F + cols, mask=m, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = _silu(g).to(u.dtype).to(tl.float32)  # as the forward rounded it
    d_silu = (g_act * u.to(tl.float32)).to(u.dtype).to(tl.float32)
    dtype = g_gu_ptr.dtype.element_ty
    tl.store(g_gu_ptr + i * 2 * F + cols, (d_silu * sig * (1.0 + g * (1.0 - sig))).to(dtype), mask=m)
    tl.store(g_gu_ptr + i * 2 * F + F + cols, (g_act * silu).to(dtype), mask=m)


def _row_blocks(width: int) -> tuple[int, int]:
    """(columns per program, programs per row) for rows of `width` elements."""
    block = min(_BLOCK_D, triton.next_power_of_2(width))
    return block, triton.cdiv(width, block)


def _move_rows(src: torch.Tensor, order: torch.Tensor, n: torch.Tensor, dst: torch.Tensor, scatter: bool,
               scale: torch.Tensor | None = None) -> torch.Tensor:
    t, d = src.shape
    block, programs = _row_blocks(d)
    if t:
        _move_rows_kernel[(t, programs)](src, order, n, scale if scale is not None else src, dst, D=d,
                                         SCATTER=scatter, HAS_SCALE=scale is not None, BLOCK_D=block)
    return dst


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, order, n, dtype):
        ctx.save_for_backward(order, n)
        ctx.x_dtype = x.dtype
        return _move_rows(x, order, n, x.new_empty(x.shape, dtype=dtype), scatter=False)

    @staticmethod
    def backward(ctx, g_sorted):
        order, n = ctx.saved_tensors
        g_sorted = g_sorted.contiguous()
        g_x = g_sorted.new_empty(g_sorted.shape, dtype=ctx.x_dtype)  # the cast back of the PyTorch glue's `.to`
        return _move_rows(g_sorted, order, n, g_x, scatter=True), None, None, None


class _UnpermuteScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted, gate, order, n):
        ctx.save_for_backward(y_sorted, gate, order, n)
        return _move_rows(y_sorted, order, n, y_sorted.new_empty(y_sorted.shape, dtype=torch.float32),
                          scatter=True, scale=gate)

    @staticmethod
    def backward(ctx, g_y):
        y_sorted, gate, order, n = ctx.saved_tensors
        g_y = g_y.contiguous()
        t, d = y_sorted.shape
        g_y_sorted, g_gate = torch.empty_like(y_sorted), torch.empty_like(gate)
        if t:
            _unpermute_scale_bwd_kernel[(t,)](g_y, y_sorted, order, n, gate, g_y_sorted, g_gate, D=d,
                                              BLOCK_D=_row_blocks(d)[0])
        return g_y_sorted, g_gate, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu, n):
        t, f = gu.shape[0], gu.shape[1] // 2
        act = gu.new_empty((t, f))
        block, programs = _row_blocks(f)
        if t:
            _swiglu_fwd_kernel[(t, programs)](gu, n, act, F=f, BLOCK_F=block)
        ctx.save_for_backward(gu, n)
        return act

    @staticmethod
    def backward(ctx, g_act):
        gu, n = ctx.saved_tensors
        t, f = gu.shape[0], gu.shape[1] // 2
        g_gu = torch.empty_like(gu)
        block, programs = _row_blocks(f)
        if t:
            _swiglu_bwd_kernel[(t, programs)](g_act.contiguous(), gu, n, g_gu, F=f, BLOCK_F=block)
        return g_gu, None


def permute(x: torch.Tensor, order: torch.Tensor, n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [T, D] -> x_sorted [T, D] in `dtype`: row i holds x[order[i]] for i < n, zeros after (n: [1] int32)."""
    return _Permute.apply(x.contiguous(), order.contiguous(), n, dtype)


def unpermute_scale(y_sorted: torch.Tensor, gate: torch.Tensor, order: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """y_sorted [T, D], gate [T] fp32 -> y [T, D] fp32: y[order[i]] = y_sorted[i] * gate[order[i]] for i < n, zero
    rows for the skip class (whatever y_sorted holds past n)."""
    return _UnpermuteScale.apply(y_sorted.contiguous(), gate.contiguous(), order.contiguous(), n)


def swiglu(gu: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] (the gate_up GEMM's [g; u] rows) -> act [T, F] = silu(g) * u for rows < n; rows past n
    unwritten (undefined), as those of gu are."""
    return _SwiGLU.apply(gu.contiguous(), n)
