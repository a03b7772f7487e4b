"""Grouped-GEMM Triton kernels of the MoE experts op, forward and backward, without host syncs.

Layout: tokens are sorted by expert once per call (`plan_rows`, device-side argsort / counts /
cumsum); "rows" below are positions in that order, so expert e owns rows
[row_start[e], row_start[e+1]) and the skip class the tail [row_start[E], T). The row map (`order`:
row -> token) is reused by every kernel of the forward and of the backward: x, dy, gate and the
outputs are gathered / scattered through it inside the kernels, nothing is permuted in memory.

No host synchronisation: the row-tile grids launch an upper bound of cdiv(T, BLOCK_M) + E tiles;
each program finds its (expert, tile) from the device-side prefix sums of per-expert tile counts
and exits when it is past the last real tile. Skip-class rows are never visited: their outputs and
gradients are the zeros the buffers start with.

Numerics: fp32 accumulators everywhere; fp32 operands use `input_precision="ieee"` (no TF32), other
dtypes (bf16) use the tensor cores. The gate scales the SwiGLU activation in fp32 before the down
GEMM (the reference applies it after, in fp32: equal up to rounding). g and u are rounded to the
weights' dtype before SwiGLU so that the backward, which reads the saved rounded [g; u], differentiates
exactly what the forward computed.

Forward (2 kernels): gate_up grouped GEMM + SwiGLU + gate in the epilogue -> act [rows, F];
down grouped GEMM -> y [T, D] fp32 stored straight at each row's token (top-1: no sum to do).
Backward (5 kernels): dA = dy @ down_e with the SwiGLU backward and the gate gradient in the
epilogue (-> dgu [rows, 2F], act recomputed, dgate partials); dx = dgu @ gate_up_e; dW_gu and
dW_down as grouped GEMMs whose reduction runs over each expert's rows.
Saved for the backward: x, gate, the weights, the row map and gu = [g; u] [T, 2F] (weights' dtype);
act is recomputed from gu and the gate in the dA kernel's epilogue.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes. BLOCK_M tiles expert rows (row-GEMMs), BLOCK_R the rows reduced per step of the
    weight-gradient GEMMs; BLOCK_N / BLOCK_K the output and reduction feature dims."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    block_r: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        # Every block is a tl.dot dimension (M, N, K; BLOCK_R the K of the weight gradients): Triton
        # compiles powers of two >= 16 (16-bit operands need K >= 16, Triton 3.6 also for fp32).
        for name in ("block_m", "block_n", "block_k", "block_r"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16 (tl.dot tiles), got {size}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"KernelConfig.num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be >= 1, got {self.num_stages}")

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> KernelConfig:
        # The CPU interpreter runs every program in Python: small tiles keep the tests quick and
        # still exercise several tiles per expert and several reduction steps.
        if device.type == "cpu":
            return cls(block_m=16, block_n=16, block_k=16, block_r=16, num_warps=1, num_stages=1)
        # gate_up stages x + two weight tiles: (64*64 + 2*64*128) elements = 40 KiB in bf16 per
        # stage (3 fit in Hopper's 227 KiB of shared memory), 80 KiB in fp32 (only 2 fit).
        return cls(num_stages=3 if dtype.itemsize <= 2 else 2)


class RowPlan(NamedTuple):
    order: torch.Tensor  # [T] int64, row -> token (tokens grouped by expert, skip class last)
    row_start: torch.Tensor  # [E + 1] int32, first row of each expert; row_start[E] = skip rows
    tile_start: torch.Tensor  # [E + 1] int32, first BLOCK_M row tile of each expert; [E] = total


def plan_rows(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> RowPlan:
    """Device-side sort of tokens by expert; no value is read on the host."""
    order = torch.argsort(expert_ids, stable=True)
    # scatter_add instead of bincount: CUDA bincount reads max() on the host to size its output.
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int32))
    counts = counts[:num_experts]  # [E]
    zero = counts.new_zeros(1)
    row_start = torch.cat([zero, counts.cumsum(0, dtype=torch.int32)])
    tiles = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor")
    tile_start = torch.cat([zero, tiles.cumsum(0, dtype=torch.int32)])
    return RowPlan(order, row_start, tile_start)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _row_col_tile(tile_start_ptr, row_start_ptr, pid_m, N, E: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(expert, rows [BM], row_ok, cols [BN], col_ok) of this program: row tile `pid_m` (the caller has
    checked pid_m < total tiles), column tile program_id(1) of N columns."""
    idx = tl.arange(0, E_PAD)
    starts = tl.load(tile_start_ptr + idx, mask=idx < E, other=2147483647)
    # The owner is the last expert whose first tile is <= pid_m (empty experts share a start).
    expert = tl.sum((starts <= pid_m).to(tl.int32), axis=0) - 1
    row0 = tl.load(row_start_ptr + expert) + (pid_m - tl.load(tile_start_ptr + expert)) * BLOCK_M
    row_end = tl.load(row_start_ptr + expert + 1)
    # int64 row offsets: rows * 2F overflows int32 beyond ~2^31 / 2F rows.
    rows = row0.to(tl.int64) + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert.to(tl.int64), rows, rows < row_end, cols, cols < N


@triton.jit
def _w_tile(w_base, cols, col_ok, ks, k_ok, stride_wn, stride_wk):
    """w_e[cols, ks]^T: [BK, BN], zeros outside (cols, ks)."""
    return tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                   mask=k_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _a_tile(a_ptr, a_rows, row_ok, ks, k_ok, stride_a, dtype: tl.constexpr):
    """a[a_rows, ks] (unit column stride) cast to the dot's operand dtype: [rows, ks], zeros outside."""
    return tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                   mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(dtype)


@triton.jit
def _rows_times_w(a_ptr, a_rows, row_ok, stride_a, w_base, cols, col_ok, stride_wn, stride_wk, K,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The row-GEMM main loop: acc[m, n] = sum_k a[a_rows[m], k] w_e[cols[n], k], fp32 [BM, BN]."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = _w_tile(w_base, cols, col_ok, ks, k_ok, stride_wn, stride_wk)  # [BK, BN]
        acc = _mma(_a_tile(a_ptr, a_rows, row_ok, ks, k_ok, stride_a, w.dtype), w, acc, IEEE)
    return acc


@triton.jit
def _gate_up_fwd_kernel(
        x_ptr, w_ptr, gate_ptr, order_ptr, row_start_ptr, tile_start_ptr, act_ptr, gu_ptr,
        D, F, stride_x, stride_we, stride_wn, stride_wk,
        E: tl.constexpr, E_PAD: tl.constexpr, SAVE_GU: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[r, f] = gate[t] * silu(g) * u, [g; u] = gate_up_e x[t], for rows r of expert e, t = order[r]."""
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(tile_start_ptr + E):
        return
    expert, rows, row_ok, cols, col_ok = _row_col_tile(  # [BM], [BN] in F
        tile_start_ptr, row_start_ptr, pid_m, F, E, E_PAD, BLOCK_M, BLOCK_N)
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0)
    w_base = w_ptr + expert * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Not _rows_times_w twice: both weight tiles share one x tile per step.
    for k0 in range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < D
        w_g = _w_tile(w_base, cols, col_ok, ks, k_ok, stride_wn, stride_wk)  # [BK, BN]
        w_u = _w_tile(w_base, cols + F, col_ok, ks, k_ok, stride_wn, stride_wk)
        xt = _a_tile(x_ptr, tokens, row_ok, ks, k_ok, stride_x, w_g.dtype)  # [BM, BK]
        acc_g = _mma(xt, w_g, acc_g, IEEE)
        acc_u = _mma(xt, w_u, acc_u, IEEE)
    g = acc_g.to(act_ptr.dtype.element_ty)
    u = acc_u.to(act_ptr.dtype.element_ty)
    out = rows[:, None] * F + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SAVE_GU:
        gu_out = rows[:, None] * (2 * F) + cols[None, :]
        tl.store(gu_ptr + gu_out, g, mask=mask)
        tl.store(gu_ptr + gu_out + F, u, mask=mask)
    g = g.to(tl.float32)
    h = g * tl.sigmoid(g) * u.to(tl.float32)
    gate = tl.load(gate_ptr + tokens, mask=row_ok, other=0.0)
    tl.store(act_ptr + out, (h * gate[:, None]).to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_gemm_kernel(
        a_ptr, w_ptr, out_ptr, order_ptr, row_start_ptr, tile_start_ptr,
        N, K, stride_a, stride_we, stride_wn, stride_wk, stride_out,
        E: tl.constexpr, E_PAD: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[order[r], n] = sum_k a[r, k] w[e, n, k] for rows r of expert e (fp32 accumulation)."""
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(tile_start_ptr + E):
        return
    expert, rows, row_ok, cols, col_ok = _row_col_tile(  # [BM], [BN]
        tile_start_ptr, row_start_ptr, pid_m, N, E, E_PAD, BLOCK_M, BLOCK_N)
    acc = _rows_times_w(a_ptr, rows, row_ok, stride_a, w_ptr + expert * stride_we, cols, col_ok,
                        stride_wn, stride_wk, K, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)  # [BM, BN]
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0)
    tl.store(out_ptr + tokens[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


# T changes every step and is only the row stride of the [F tiles, T] gate partials, written at gathered
# token positions (no vectorised access): not specialised on, so a new token count compiles nothing.
@triton.jit(do_not_specialize=["T"])
def _down_bwd_kernel(
        dy_ptr, w_ptr, gu_ptr, gate_ptr, order_ptr, row_start_ptr, tile_start_ptr,
        dgu_ptr, act_ptr, dgate_part_ptr,
        T, D, F, stride_dy, stride_we, stride_wn, stride_wk,
        E: tl.constexpr, E_PAD: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dA = dy[t] @ down_e (the gradient of the down GEMM's input), then in the epilogue:
    dgate partial = sum_f dA h, dh = gate dA, SwiGLU backward -> dgu, and act = gate h recomputed."""
    pid_m = tl.program_id(0)
    if pid_m >= tl.load(tile_start_ptr + E):
        return
    expert, rows, row_ok, cols, col_ok = _row_col_tile(  # [BM], [BN] in F
        tile_start_ptr, row_start_ptr, pid_m, F, E, E_PAD, BLOCK_M, BLOCK_N)
    tokens = tl.load(order_ptr + rows, mask=row_ok, other=0)
    acc = _rows_times_w(dy_ptr, tokens, row_ok, stride_dy, w_ptr + expert * stride_we, cols, col_ok,
                        stride_wn, stride_wk, D, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)  # [BM, BN] = dA
    mask = row_ok[:, None] & col_ok[None, :]
    gu = rows[:, None] * (2 * F) + cols[None, :]
    g = tl.load(gu_ptr + gu, mask=mask, other=0.0).to(tl.float32)  # masked -> h = 0
    u = tl.load(gu_ptr + gu + F, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + tokens, mask=row_ok, other=0.0)
    sig = tl.sigmoid(g)
    h = g * sig * u
    # One partial per F tile, summed on the device afterwards: deterministic, no atomics.
    tl.store(dgate_part_ptr + tl.program_id(1) * T + tokens, tl.sum(acc * h, axis=1), mask=row_ok)
    dh = acc * gate[:, None]
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))  # silu'(g) = sig (1 + g (1 - sig))
    du = dh * g * sig
    tl.store(dgu_ptr + gu, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(dgu_ptr + gu + F, du.to(dgu_ptr.dtype.element_ty), mask=mask)
    tl.store(act_ptr + rows[:, None] * F + cols[None, :], (h * gate[:, None]).to(act_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _wgrad_kernel(
        a_ptr, b_ptr, out_ptr, order_ptr, row_start_ptr,
        N, K, stride_a, stride_b, stride_oe, stride_on, stride_ok,
        GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[e, n, k] = sum over rows r of expert e of A[r, n] B[r, k]; a GATHER_ operand is indexed
    by token (row r reads order[r]), the other by row. An expert without rows gets zeros."""
    expert = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(row_start_ptr + expert)
    end = tl.load(row_start_ptr + expert + 1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        row_ok = rows < end
        tokens = tl.load(order_ptr + rows, mask=row_ok, other=0)
        ia = rows
        ib = rows
        if GATHER_A:
            ia = tokens
        if GATHER_B:
            ib = tokens
        b = _a_tile(b_ptr, ib, row_ok, ks, k_ok, stride_b, out_ptr.dtype.element_ty)  # [BR, BK]
        a = _a_tile(a_ptr, ia, row_ok, ns, n_ok, stride_a, out_ptr.dtype.element_ty)  # [BR, BN]
        acc = _mma(tl.trans(a), b, acc, IEEE)
    tl.store(out_ptr + expert.to(tl.int64) * stride_oe + ns[:, None] * stride_on + ks[None, :] * stride_ok,
             acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


def _row_grid(t: int, n: int, num_experts: int, cfg: KernelConfig) -> tuple[int, int]:
    # Upper bound of sum_e cdiv(n_e, BLOCK_M) over experts, known without reading the counts.
    return triton.cdiv(t, cfg.block_m) + num_experts, triton.cdiv(n, cfg.block_n)


def _launch_opts(cfg: KernelConfig, num_experts: int, weight: torch.Tensor) -> dict:
    return dict(E=num_experts, E_PAD=triton.next_power_of_2(num_experts + 1),
                IEEE=weight.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _forward(x, gate, gate_up_proj, down_proj, plan: RowPlan, cfg: KernelConfig, save_gu: bool):
    t, d = x.shape
    e, f = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    act = torch.empty(t, f, dtype=gate_up_proj.dtype, device=x.device)  # [T, F], rows order
    gu = torch.empty(t if save_gu else 0, 2 * f, dtype=gate_up_proj.dtype, device=x.device)  # [T, 2F]
    opts = _launch_opts(cfg, e, gate_up_proj)
    _gate_up_fwd_kernel[_row_grid(t, f, e, cfg)](
        x, gate_up_proj, gate, plan.order, plan.row_start, plan.tile_start, act, gu if save_gu else act,
        d, f, x.stride(0), *gate_up_proj.stride(), SAVE_GU=save_gu, **opts)
    y = torch.zeros(t, d, dtype=torch.float32, device=x.device)  # [T, D]; skip tokens stay 0
    _row_gemm_kernel[_row_grid(t, d, e, cfg)](
        act, down_proj, y, plan.order, plan.row_start, plan.tile_start,
        d, f, act.stride(0), down_proj.stride(0), down_proj.stride(1), down_proj.stride(2), y.stride(0),
        **opts)
    return y, gu


def _wgrad(a, b, out, plan: RowPlan, cfg: KernelConfig, gather_a: bool, gather_b: bool) -> torch.Tensor:
    e, n, k = out.shape
    _wgrad_kernel[(e, triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k))](
        a, b, out, plan.order, plan.row_start, n, k, a.stride(0), b.stride(0), *out.stride(),
        GATHER_A=gather_a, GATHER_B=gather_b, IEEE=out.dtype == torch.float32,
        BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, expert_ids, gate, gate_up_proj, down_proj, cfg: KernelConfig):
        x, gate, gate_up_proj, down_proj = (t.contiguous() for t in (x, gate, gate_up_proj, down_proj))
        plan = plan_rows(expert_ids, gate_up_proj.shape[0], cfg.block_m)
        y, gu = _forward(x, gate, gate_up_proj, down_proj, plan, cfg, save_gu=True)
        ctx.save_for_backward(x, gate, gate_up_proj, down_proj, gu, *plan)
        ctx.cfg = cfg
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, gate, gate_up_proj, down_proj, gu, *plan_tensors = ctx.saved_tensors
        plan, cfg = RowPlan(*plan_tensors), ctx.cfg
        dy = dy.contiguous()  # [T, D] fp32
        t, d = x.shape
        e, f = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
        opts = _launch_opts(cfg, e, gate_up_proj)
        grid_f = _row_grid(t, f, e, cfg)
        # [T, 2F] and [T, F] in rows order; skip-class rows stay unwritten and are never read.
        dgu = torch.empty(t, 2 * f, dtype=gate_up_proj.dtype, device=x.device)
        act = torch.empty(t, f, dtype=gate_up_proj.dtype, device=x.device)
        dgate_part = torch.zeros(grid_f[1], t, dtype=torch.float32, device=x.device)  # [F tiles, T]
        _down_bwd_kernel[grid_f](
            dy, down_proj, gu, gate, plan.order, plan.row_start, plan.tile_start, dgu, act, dgate_part,
            t, d, f, dy.stride(0), down_proj.stride(0), down_proj.stride(2), down_proj.stride(1), **opts)
        need_x, _, need_gate, need_wgu, need_wdown, _ = ctx.needs_input_grad
        dx = dgate = dwgu = dwdown = None
        if need_x:
            dx = torch.zeros(t, d, dtype=x.dtype, device=x.device)  # skip tokens stay 0
            _row_gemm_kernel[_row_grid(t, d, e, cfg)](
                dgu, gate_up_proj, dx, plan.order, plan.row_start, plan.tile_start,
                d, 2 * f, dgu.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(2),
                gate_up_proj.stride(1), dx.stride(0), **opts)
        if need_gate:
            dgate = dgate_part.sum(0)  # [T]
        if need_wgu:
            dwgu = _wgrad(dgu, x, torch.empty_like(gate_up_proj), plan, cfg, gather_a=False, gather_b=True)
        if need_wdown:
            dwdown = _wgrad(dy, act, torch.empty_like(down_proj), plan, cfg, gather_a=True, gather_b=False)
        return dx, None, dgate, dwgu, dwdown, None


def moe_experts_triton(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                       gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                       config: KernelConfig | None = None) -> torch.Tensor:
    """The Triton path of `moe_experts` (same contract); `config` overrides the tile sizes."""
    cfg = config or KernelConfig.for_device(x.device, gate_up_proj.dtype)
    inputs = (x, gate, gate_up_proj, down_proj)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _MoEExperts.apply(x, expert_ids, gate, gate_up_proj, down_proj, cfg)
    # Inference (rollout scoring, no_grad): nothing to save, so gu is never written.
    x, gate, gate_up_proj, down_proj = (t.contiguous() for t in inputs)
    plan = plan_rows(expert_ids, gate_up_proj.shape[0], cfg.block_m)
    return _forward(x, gate, gate_up_proj, down_proj, plan, cfg, save_gu=False)[0]
