"""Fused Triton LM head + log-softmax gather, forward and backward, never holding [T, V] logits.

K (a shape letter of this module only): vocabulary splits, contiguous ranges of vocabulary tiles.

Forward (`_forward_kernel`, grid [T / BLOCK_T, K]): a program owns BLOCK_T tokens and one split. For
each [BLOCK_T, BLOCK_V] tile it computes the logits z = h @ W_tile^T (fp32 accumulation over D tiles)
and updates, per token, the running maximum m, s = sum exp(z - m), u = sum exp(z - m) (z - m)
(entropy only) and the target logit. `_merge` combines the [K, T] partials in PyTorch: with M the
maximum over splits and s_tot, u_tot the rescaled sums, lse = M + log s_tot, E_p[z] = M + u_tot / s_tot
and entropy = log s_tot - u_tot / s_tot, a sum of two non-negative terms (u <= 0): no cancellation.
K > 1 only when there are too few token blocks to fill the GPU (short microbatches): the splits
multiply the programs without atomics.

Backward: the logit tiles are recomputed from the saved lse (and E_p[z]) and turned into
G = dL/dz = g_lp (onehot - p) - g_ent p (z - E_p[z]) tile by tile; neither z nor G is ever stored.
  `_grad_hidden_kernel` (grid [T / BLOCK_T, K]): dh = G @ W, each program accumulating into its own
      rows of an fp32 [K, T, D] buffer (summed over K afterwards);
  `_grad_weight_kernel` (grid [V / BLOCK_V]): dW = G^T @ h, each program owning BLOCK_V rows of an
      fp32 [V, D] buffer and looping over all token blocks.
Every output element has a single writer, so there are no atomics and the result is deterministic,
at the price of computing the logits twice in the backward (see README.md for the cost).

Logit floor (optional, [T] fp32): every kernel restricts a token's softmax to its support, the logits
not below its floor plus its target (`_kept`), exactly as the reference does; without one the floor
pointer is None, a compile-time constant, and the kernels are the unrestricted ones.

Dtypes: when hidden and weight share a 16-bit dtype the dots take them as they are (tensor cores,
exact products, fp32 accumulation; G is rounded to that dtype for the two backward dots); otherwise
both are cast to fp32 inside the kernel (the bf16 weight is never copied to fp32 in memory) and the
dots use `input_precision` ("ieee" by default: the FP32 op set's fp32 LM head, same numbers as the
reference up to summation order). Outputs are fp32; gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

_FINITE_MIN = tl.constexpr(-3.0e38)  # running-max start: finite, so 0 * (m_old - m_new) stays 0 on the first tile


@triton.jit
def _row_slice(ptr, offs_r, mask_r, offs_d, mask_d, stride, FP32: tl.constexpr):
    """x[offs_r, offs_d] of a row-major matrix (fp32 if FP32): [rows, BLOCK_D], zeros outside."""
    x = tl.load(ptr + offs_r[:, None] * stride + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :],
                other=0.0)
    if FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _logits_tile(h_ptr, w_ptr, offs_t, offs_v, mask_t, mask_v, D, stride_h, stride_w,
                 FP32: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """z = h[offs_t] @ W[offs_v]^T in fp32: [BLOCK_T, BLOCK_V]."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h = _row_slice(h_ptr, offs_t, mask_t, offs_d, mask_d, stride_h, FP32)  # [BLOCK_T, BLOCK_D]
        w = _row_slice(w_ptr, offs_v, mask_v, offs_d, mask_d, stride_w, FP32)  # [BLOCK_V, BLOCK_D]
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _add_dot_rows(out_rows, mask_out, g, src_ptr, offs_src, mask_src, stride_src, D,
                  FP32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r, :] += g @ src[offs_src, :] for the fp32 rows `out_rows` ([R, 1] pointers), BLOCK_D
    columns at a time; g is [R, S], src rows [S, D]."""
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        src = _row_slice(src_ptr, offs_src, mask_src, offs_d, mask_d, stride_src, FP32)  # [S, BLOCK_D]
        ptrs = out_rows + offs_d[None, :]
        mask = mask_out[:, None] & mask_d[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, tl.dot(g, src, acc, input_precision=PRECISION), mask=mask)


@triton.jit
def _load_floor(floor_ptr, offs_t, mask_t, placeholder):
    """The tokens' logit floors [BLOCK_T]; `placeholder` (never read) when floor_ptr is None."""
    floor = placeholder
    if floor_ptr is not None:
        floor = tl.load(floor_ptr + offs_t, mask=mask_t, other=float("-inf"))
    return floor


@triton.jit
def _kept(z, offs_v, mask_v, y, floor, floor_ptr):
    """[BLOCK_T, BLOCK_V] (or [1, BLOCK_V] without a floor): inside the vocabulary and in the token's
    support (not below its floor, or its target; a NaN logit stays in and shows in the result)."""
    keep = mask_v[None, :]
    if floor_ptr is not None:
        keep = keep & (((z < floor[:, None]) == 0) | (offs_v[None, :] == y[:, None]))
    return keep


@triton.jit
def _token_grads_in(offs_t, mask_t, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, floor_ptr,
                    HAS_ENTROPY: tl.constexpr):
    """Per-token inputs of `_grad_logits` at offs_t: y, lse, g_lp, E_p[z], g_ent, floor (each
    [BLOCK_T]); without entropy, mean and g_ent are placeholders that `_grad_logits` never reads."""
    y = tl.load(y_ptr + offs_t, mask=mask_t, other=-1)
    lse = tl.load(lse_ptr + offs_t, mask=mask_t, other=0.0)
    g_lp = tl.load(glp_ptr + offs_t, mask=mask_t, other=0.0)
    mean = lse
    g_ent = g_lp
    if HAS_ENTROPY:
        mean = tl.load(mean_ptr + offs_t, mask=mask_t, other=0.0)
        g_ent = tl.load(gent_ptr + offs_t, mask=mask_t, other=0.0)
    return y, lse, g_lp, mean, g_ent, _load_floor(floor_ptr, offs_t, mask_t, lse)


@triton.jit
def _grad_logits(z, offs_v, mask_v, y, lse, g_lp, mean, g_ent, floor, floor_ptr, HAS_ENTROPY: tl.constexpr):
    """G = g_lp (onehot(y) - p) - g_ent p (z - E_p[z]) on one tile, 0 outside the vocabulary and the
    support."""
    keep = _kept(z, offs_v, mask_v, y, floor, floor_ptr)
    p = tl.where(keep, tl.exp(z - lse[:, None]), 0.0)  # [BLOCK_T, BLOCK_V]
    if HAS_ENTROPY:
        g = p * (-g_ent[:, None] * (z - mean[:, None]) - g_lp[:, None])
    else:
        g = -g_lp[:, None] * p
    g += tl.where(offs_v[None, :] == y[:, None], g_lp[:, None], 0.0)
    return tl.where(keep, g, 0.0)


@triton.jit
def _split_program(T, V, tiles_per_split, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """A [T / BLOCK_T, K] program's split, tokens offs_t [BLOCK_T] (int32 and int64), their mask
    and its vocabulary range [v_start, v_end)."""
    split = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    v_start = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_start + tiles_per_split * BLOCK_V, V)
    return split, offs_t, offs_t.to(tl.int64), offs_t < T, v_start, v_end


@triton.jit
def _forward_kernel(h_ptr, w_ptr, y_ptr, floor_ptr, m_ptr, s_ptr, u_ptr, zy_ptr,
                    T, V, D, stride_h, stride_w, tiles_per_split,
                    WITH_ENTROPY: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    split, offs_t, offs_t64, mask_t, v_start, v_end = _split_program(T, V, tiles_per_split, BLOCK_T, BLOCK_V)
    y = tl.load(y_ptr + offs_t, mask=mask_t, other=-1)
    m = tl.full((BLOCK_T,), _FINITE_MIN, tl.float32)
    s = tl.zeros((BLOCK_T,), tl.float32)
    u = tl.zeros((BLOCK_T,), tl.float32)
    zy = tl.zeros((BLOCK_T,), tl.float32)
    floor = _load_floor(floor_ptr, offs_t, mask_t, zy)
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = _logits_tile(h_ptr, w_ptr, offs_t64, offs_v.to(tl.int64), mask_t, mask_v, D, stride_h, stride_w,
                         FP32, PRECISION, BLOCK_T, BLOCK_V, BLOCK_D)
        keep = _kept(z, offs_v, mask_v, y, floor, floor_ptr)
        z = tl.where(keep, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shifted = z - m_new[:, None]  # [BLOCK_T, BLOCK_V], -inf outside the vocabulary and support
        e = tl.exp(shifted)
        alpha = tl.exp(m - m_new)
        if WITH_ENTROPY:
            # the old terms' sum e (z - m_new) is alpha (u + (m - m_new) s); 0 (not 0 * -inf) outside
            u = alpha * (u + (m - m_new) * s) + tl.sum(e * tl.where(keep, shifted, 0.0), axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), axis=1)
        m = m_new
    out = split * T + offs_t
    tl.store(m_ptr + out, m, mask=mask_t)
    tl.store(s_ptr + out, s, mask=mask_t)
    tl.store(zy_ptr + out, zy, mask=mask_t)
    if WITH_ENTROPY:
        tl.store(u_ptr + out, u, mask=mask_t)


@triton.jit
def _grad_hidden_kernel(h_ptr, w_ptr, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, floor_ptr, dh_ptr,
                        T, V, D, stride_h, stride_w, tiles_per_split,
                        HAS_ENTROPY: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    split, offs_t, offs_t64, mask_t, v_start, v_end = _split_program(T, V, tiles_per_split, BLOCK_T, BLOCK_V)
    y, lse, g_lp, mean, g_ent, floor = _token_grads_in(offs_t, mask_t, y_ptr, lse_ptr, mean_ptr, glp_ptr,
                                                       gent_ptr, floor_ptr, HAS_ENTROPY)
    dh_rows = dh_ptr + (split * T + offs_t64)[:, None] * D  # this program's rows of its split's buffer
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        offs_v64 = offs_v.to(tl.int64)
        z = _logits_tile(h_ptr, w_ptr, offs_t64, offs_v64, mask_t, mask_v, D, stride_h, stride_w,
                         FP32, PRECISION, BLOCK_T, BLOCK_V, BLOCK_D)
        g = _grad_logits(z, offs_v, mask_v, y, lse, g_lp, mean, g_ent, floor, floor_ptr,
                         HAS_ENTROPY)  # [BLOCK_T, BLOCK_V]
        if not FP32:
            g = g.to(w_ptr.dtype.element_ty)
        _add_dot_rows(dh_rows, mask_t, g, w_ptr, offs_v64, mask_v, stride_w, D, FP32, PRECISION, BLOCK_D)


@triton.jit
def _grad_weight_kernel(h_ptr, w_ptr, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, floor_ptr, dw_ptr,
                        T, V, D, stride_h, stride_w,
                        HAS_ENTROPY: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    offs_v64 = offs_v.to(tl.int64)
    dw_rows = dw_ptr + offs_v64[:, None] * D  # this program's rows of dW
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        offs_t64 = offs_t.to(tl.int64)
        y, lse, g_lp, mean, g_ent, floor = _token_grads_in(offs_t, mask_t, y_ptr, lse_ptr, mean_ptr, glp_ptr,
                                                           gent_ptr, floor_ptr, HAS_ENTROPY)
        z = _logits_tile(h_ptr, w_ptr, offs_t64, offs_v64, mask_t, mask_v, D, stride_h, stride_w,
                         FP32, PRECISION, BLOCK_T, BLOCK_V, BLOCK_D)
        g = _grad_logits(z, offs_v, mask_v, y, lse, g_lp, mean, g_ent, floor, floor_ptr,
                         HAS_ENTROPY)  # [BLOCK_T, BLOCK_V]
        if not FP32:
            g = g.to(h_ptr.dtype.element_ty)
        _add_dot_rows(dw_rows, mask_v, tl.trans(g), h_ptr, offs_t64, mask_t, stride_h, D, FP32, PRECISION,
                      BLOCK_D)  # g^T: [BLOCK_V, BLOCK_T]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Launch parameters. Block sizes are powers of two >= 16 (tl.dot's minimum)."""

    block_t: int
    block_v: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2
    vocab_splits: int | None = None  # None: enough splits to give ~2 programs per SM
    input_precision: str = "ieee"  # fp32 dots only; "tf32x3" is near-fp32 on tensor cores


def default_config(device: torch.device, fp32: bool) -> TileConfig:
    """Launch parameters for H100/H200, tiny tiles for the CPU interpreter (one Python step per op).

    The GPU ones were chosen from offline sm_90a compiles (Triton 3.9's ptxas) as the largest tiles
    without large spills; sm90_check.py measures what remains at T = 4096: none on the bf16 path,
    148-176 B in the fp32-hidden `_grad_hidden_kernel`. Not timed (see README.md).
    """
    if device.type != "cuda":
        return TileConfig(block_t=16, block_v=32, block_d=16)
    if fp32:  # FMA dots unroll over BLOCK_D: 32 already spills
        return TileConfig(block_t=64, block_v=128, block_d=16, num_warps=8, num_stages=2)
    return TileConfig(block_t=64, block_v=128, block_d=32, num_warps=8, num_stages=3)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _vocab_splits(cfg: TileConfig, device: torch.device, t_blocks: int, v_tiles: int) -> tuple[int, int]:
    """(splits, vocabulary tiles per split), every split non-empty."""
    if cfg.vocab_splits is not None:
        wanted = cfg.vocab_splits
    else:
        target = 2 * _sm_count(device.index or 0) if device.type == "cuda" else 4
        wanted = triton.cdiv(target, max(t_blocks, 1))
    per_split = triton.cdiv(v_tiles, max(1, min(wanted, v_tiles)))
    return triton.cdiv(v_tiles, per_split), per_split


def _uses_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    return not (hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16))


def _merge(m, s, u, zy, targets, with_entropy):
    """Per-split partials [K, T] -> logprob, entropy (or empty), lse, E_p[z] (or empty), all [T]."""
    big_m = m.amax(dim=0)  # [T]
    scale = torch.exp(m - big_m)  # [K, T]
    total = (s * scale).sum(dim=0)  # sum_j exp(z_j - M)
    lse = big_m + torch.log(total)
    logprob = (zy.sum(dim=0) - lse).masked_fill(targets < 0, 0.0)
    if not with_entropy:
        return logprob, lse.new_zeros(0), lse, lse.new_empty(0)
    shifted_mean = (scale * (u + (m - big_m) * s)).sum(dim=0) / total  # E_p[z] - M <= 0
    return logprob, torch.log(total) - shifted_mean, lse, big_m + shifted_mean


def _meta(cfg: TileConfig, fp32: bool) -> dict:
    return dict(FP32=fp32, PRECISION=cfg.input_precision, BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v,
                BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


class _TritonTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                floor: torch.Tensor | None, with_entropy: bool, cfg: TileConfig):
        ctx.set_materialize_grads(False)  # an unused entropy output costs nothing in the backward
        (t, d), v = hidden.shape, weight.shape[0]
        fp32 = _uses_fp32(hidden, weight)
        t_blocks, v_tiles = triton.cdiv(t, cfg.block_t), triton.cdiv(v, cfg.block_v)
        splits, per_split = _vocab_splits(cfg, hidden.device, t_blocks, v_tiles)
        m, s, u, zy = torch.empty(4, splits, t, device=hidden.device, dtype=torch.float32)  # [K, T] each
        if t > 0:
            _forward_kernel[(t_blocks, splits)](
                hidden, weight, targets, floor, m, s, u, zy, t, v, d, hidden.stride(0), weight.stride(0), per_split,
                WITH_ENTROPY=with_entropy, **_meta(cfg, fp32))
        logprob, entropy, lse, mean = _merge(m, s, u, zy, targets, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, mean, floor)
        ctx.cfg, ctx.fp32, ctx.splits, ctx.per_split = cfg, fp32, splits, per_split
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse, mean, floor = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        has_entropy = grad_entropy is not None and grad_entropy.numel() > 0
        if grad_logprob is None and not has_entropy:
            return None, None, None, None, None, None
        (t, d), v = hidden.shape, weight.shape[0]
        g_lp = (lse.new_zeros(t) if grad_logprob is None
                else grad_logprob.float().masked_fill(targets < 0, 0.0).contiguous())  # [T]
        g_ent = grad_entropy.float().contiguous() if has_entropy else g_lp  # [T]; unread without entropy
        mean = mean if has_entropy else lse
        cfg, meta = ctx.cfg, _meta(ctx.cfg, ctx.fp32)
        args = (hidden, weight, targets, lse, mean, g_lp, g_ent, floor)
        grad_h = grad_w = None
        if need_h:
            partial = torch.zeros(ctx.splits, t, d, device=hidden.device, dtype=torch.float32)  # [K, T, D]
            if t > 0:
                _grad_hidden_kernel[(triton.cdiv(t, cfg.block_t), ctx.splits)](
                    *args, partial, t, v, d, hidden.stride(0), weight.stride(0), ctx.per_split,
                    HAS_ENTROPY=has_entropy, **meta)
            grad_h = (partial[0] if ctx.splits == 1 else partial.sum(dim=0)).to(hidden.dtype)
        if need_w:
            grad_w32 = torch.zeros(v, d, device=weight.device, dtype=torch.float32)  # [V, D]
            if t > 0:
                _grad_weight_kernel[(triton.cdiv(v, cfg.block_v),)](
                    *args, grad_w32, t, v, d, hidden.stride(0), weight.stride(0),
                    HAS_ENTROPY=has_entropy, **meta)
            grad_w = grad_w32.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def token_logprobs_triton(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          with_entropy: bool, floor: torch.Tensor | None = None, config: TileConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [T], entropy [T] or an empty tensor) in fp32; inputs validated, targets int64 [T],
    floor [T] fp32 or None."""
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"hidden, weight and targets must share a device, got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    cfg = config or default_config(hidden.device, _uses_fp32(hidden, weight))
    return _TritonTokenLogprobs.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                                      None if floor is None else floor.contiguous(), with_entropy, cfg)
