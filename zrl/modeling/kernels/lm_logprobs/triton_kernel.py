"""Fused Triton LM head + log-softmax gather, forward and backward, on the tensor cores, never holding
[T, V] logits.

K (a shape letter of this module only): vocabulary splits, contiguous ranges of vocabulary tiles.
P (likewise): the 16-bit parts an operand is given to the dots as, 1 or 3 (see "Precision").

Precision. Every dot takes 16-bit operands and accumulates in fp32 (tensor cores: wgmma on sm_90).
- hidden and weight of one 16-bit dtype: each is one part, used as it is; the backward rounds the
  logit gradient G to that dtype for its two dots (the inputs carry no more precision than that).
- otherwise (the model: fp32 final hidden states, bf16 tied embedding): an fp32 operand is split into
  three bf16 parts, x = hi + mid + lo exactly (fp32 has 24 significant bits, bf16 8; the exponent ranges
  are the same), and a bf16 operand is one part. A product of two parts is exact in fp32, so
  sum over parts (a_i b_j) with i + j <= 2 is the fp32 dot up to the summation order and the dropped
  terms of order 2^-24 (i + j >= 3: only when both operands are fp32): fp32-level accuracy, the FP32 op
  set's LM head, at 3 bf16 dots where one operand is bf16 (6 where both are fp32). The backward splits
  G the same way in registers. Splitting the operands once in PyTorch (`_parts`: [P, rows, D]) costs
  6 bytes per element instead of fp32's 4; no fp32 copy of the weight is ever made.

Forward (`_forward_kernel`, grid [T / BLOCK_T, K]): a program owns BLOCK_T tokens and one split. For
each [BLOCK_T, BLOCK_V] tile it computes the logits z = h @ W_tile^T and updates, per token, the running
maximum m, s = sum exp(z - m), u = sum exp(z - m) (z - m) (entropy only) and the target logit. `_merge`
combines the [K, T] partials in PyTorch: with M the maximum over splits and s_tot, u_tot the rescaled
sums, lse = M + log s_tot, E_p[z] = M + u_tot / s_tot and entropy = log s_tot - u_tot / s_tot, a sum of
two non-negative terms (u <= 0): no cancellation. K > 1 only when there are too few token blocks to
fill the GPU (short microbatches): the splits multiply the programs without atomics.

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

Token counts change every step: T (and the vocabulary tiles per split, which follow from it) are not
specialised on (`do_not_specialize`), and every buffer is its own allocation (16-byte aligned whatever
T is), so a new count never compiles a new variant. Under Triton's CPU interpreter (tests without a GPU), whose 16-bit dots are
wrong, `_mma` multiplies the same 16-bit parts as fp32 values: the same exact products and fp32 sums.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from zrl.modeling.kernels import interpreting
from zrl.modeling.kernels.bf16_split import split_parts

_FINITE_MIN = tl.constexpr(-3.0e38)  # running-max start: finite, so 0 * (m_old - m_new) stays 0 on the first tile


@triton.jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b: 16-bit operands, fp32 accumulation on the tensor cores."""
    if INTERPRET:
        # CPU interpreter only (a compile-time constant: a GPU compile never contains this branch).
        # Its 16-bit dot is wrong, and 16-bit values are exact in fp32, so an fp32 dot of the same parts
        # gives the products the tensor cores form.
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _split(x, PARTS: tl.constexpr, dtype: tl.constexpr):
    """x as PARTS 16-bit tensors (unused ones repeat hi): x in dtype for one part; else bf16 hi, mid and
    lo with x = hi + mid + lo exactly (three parts) or x = hi + mid up to 2^-16 |x| (two)."""
    if PARTS == 1:
        hi = x.to(dtype)
        mid = hi
        lo = hi
    else:
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = hi
        if PARTS == 3:
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _rows(ptr, offs_r, mask_r, offs_d, mask_d, stride):
    """x[offs_r, offs_d] of a row-major matrix: [rows, BLOCK_D], zeros outside."""
    return tl.load(ptr + offs_r[:, None] * stride + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :],
                   other=0.0)


@triton.jit
def _b_part(b_ptr, part, offs_r, mask_r, offs_d, mask_d, stride_b, TRANS_B: tl.constexpr):
    """Part `part` of B's rows offs_r, columns offs_d: [rows, BLOCK_D], or [BLOCK_D, rows] if TRANS_B."""
    b = _rows(b_ptr + part, offs_r, mask_r, offs_d, mask_d, stride_b)
    if TRANS_B:
        b = tl.trans(b)
    return b


@triton.jit
def _split_dot(acc, a0, a1, a2, b_ptr, part_b, offs_r, mask_r, offs_d, mask_d, stride_b,
               A_PARTS: tl.constexpr, B_PARTS: tl.constexpr, ORDER: tl.constexpr, TRANS_B: tl.constexpr,
               INTERPRET: tl.constexpr):
    """acc + sum of a_i @ b_j over i < A_PARTS, j < B_PARTS, i + j <= ORDER; a_0..a_2 are A's parts
    (registers), b_j = B[j][offs_r, offs_d] is read from the [B_PARTS, rows, D] stack at b_ptr (part
    stride part_b). The small terms go first."""
    b0 = _b_part(b_ptr, 0, offs_r, mask_r, offs_d, mask_d, stride_b, TRANS_B)
    if B_PARTS >= 2 and ORDER >= 1:
        b1 = _b_part(b_ptr, part_b, offs_r, mask_r, offs_d, mask_d, stride_b, TRANS_B)
        if B_PARTS == 3 and ORDER == 2:
            acc = _mma(a0, _b_part(b_ptr, 2 * part_b, offs_r, mask_r, offs_d, mask_d, stride_b, TRANS_B), acc,
                       INTERPRET)
        if A_PARTS >= 2 and ORDER == 2:
            acc = _mma(a1, b1, acc, INTERPRET)
        acc = _mma(a0, b1, acc, INTERPRET)
    if A_PARTS == 3 and ORDER == 2:
        acc = _mma(a2, b0, acc, INTERPRET)
    if A_PARTS >= 2 and ORDER >= 1:
        acc = _mma(a1, b0, acc, INTERPRET)
    return _mma(a0, b0, acc, INTERPRET)


@triton.jit
def _logits_tile(h_ptr, w_ptr, part_h, part_w, offs_t, offs_v, mask_t, mask_v, D, stride_h, stride_w,
                 H_PARTS: tl.constexpr, W_PARTS: tl.constexpr, ORDER: tl.constexpr, INTERPRET: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """z = h[offs_t] @ W[offs_v]^T in fp32 from the operands' parts (`_split_dot`): [BLOCK_T, BLOCK_V]."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        h0 = _rows(h_ptr, offs_t, mask_t, offs_d, mask_d, stride_h)  # [BLOCK_T, BLOCK_D]
        h1 = h0
        h2 = h0
        if H_PARTS >= 2 and ORDER >= 1:
            h1 = _rows(h_ptr + part_h, offs_t, mask_t, offs_d, mask_d, stride_h)
        if H_PARTS == 3 and ORDER == 2:
            h2 = _rows(h_ptr + 2 * part_h, offs_t, mask_t, offs_d, mask_d, stride_h)
        acc = _split_dot(acc, h0, h1, h2, w_ptr, part_w, offs_v, mask_v, offs_d, mask_d, stride_w,
                         H_PARTS, W_PARTS, ORDER, True, INTERPRET)
    return acc


@triton.jit
def _add_split_dot_rows(out_rows, mask_out, g, src_ptr, part_src, offs_src, mask_src, stride_src, D,
                        G_PARTS: tl.constexpr, SRC_PARTS: tl.constexpr, ORDER: tl.constexpr,
                        INTERPRET: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r, :] += g @ src[offs_src, :] for the fp32 rows `out_rows` ([R, 1] pointers), BLOCK_D
    columns at a time; g [R, S] fp32 is split into G_PARTS parts of src's dtype once, src rows [S, D]."""
    g0, g1, g2 = _split(g, G_PARTS, src_ptr.dtype.element_ty)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        ptrs = out_rows + offs_d[None, :]
        mask = mask_out[:, None] & mask_d[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0)
        acc = _split_dot(acc, g0, g1, g2, src_ptr, part_src, offs_src, mask_src, offs_d, mask_d, stride_src,
                         G_PARTS, SRC_PARTS, ORDER, False, INTERPRET)
        tl.store(ptrs, acc, mask=mask)


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


@triton.jit(do_not_specialize=["T", "tiles_per_split"])
def _forward_kernel(h_ptr, w_ptr, y_ptr, floor_ptr, m_ptr, s_ptr, u_ptr, zy_ptr,
                    T, V, D, stride_h, stride_w, part_h, part_w, tiles_per_split,
                    WITH_ENTROPY: tl.constexpr, H_PARTS: tl.constexpr, W_PARTS: tl.constexpr,
                    Z_ORDER: tl.constexpr, INTERPRET: tl.constexpr,
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
        z = _logits_tile(h_ptr, w_ptr, part_h, part_w, offs_t64, offs_v.to(tl.int64), mask_t, mask_v, D,
                         stride_h, stride_w, H_PARTS, W_PARTS, Z_ORDER, INTERPRET, BLOCK_T, BLOCK_V, BLOCK_D)
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


@triton.jit(do_not_specialize=["T", "tiles_per_split"])
def _grad_hidden_kernel(h_ptr, w_ptr, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, floor_ptr, dh_ptr,
                        T, V, D, stride_h, stride_w, part_h, part_w, tiles_per_split,
                        HAS_ENTROPY: tl.constexpr, H_PARTS: tl.constexpr, W_PARTS: tl.constexpr,
                        Z_ORDER: tl.constexpr, G_PARTS: tl.constexpr, G_ORDER: tl.constexpr,
                        INTERPRET: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    split, offs_t, offs_t64, mask_t, v_start, v_end = _split_program(T, V, tiles_per_split, BLOCK_T, BLOCK_V)
    y, lse, g_lp, mean, g_ent, floor = _token_grads_in(offs_t, mask_t, y_ptr, lse_ptr, mean_ptr, glp_ptr,
                                                       gent_ptr, floor_ptr, HAS_ENTROPY)
    dh_rows = dh_ptr + (split * T + offs_t64)[:, None] * D  # this program's rows of its split's buffer
    for v0 in range(v_start, v_end, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        offs_v64 = offs_v.to(tl.int64)
        z = _logits_tile(h_ptr, w_ptr, part_h, part_w, offs_t64, offs_v64, mask_t, mask_v, D, stride_h, stride_w,
                         H_PARTS, W_PARTS, Z_ORDER, INTERPRET, BLOCK_T, BLOCK_V, BLOCK_D)
        g = _grad_logits(z, offs_v, mask_v, y, lse, g_lp, mean, g_ent, floor, floor_ptr,
                         HAS_ENTROPY)  # [BLOCK_T, BLOCK_V]
        _add_split_dot_rows(dh_rows, mask_t, g, w_ptr, part_w, offs_v64, mask_v, stride_w, D,
                            G_PARTS, W_PARTS, G_ORDER, INTERPRET, BLOCK_D)


@triton.jit(do_not_specialize=["T"])
def _grad_weight_kernel(h_ptr, w_ptr, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, floor_ptr, dw_ptr,
                        T, V, D, stride_h, stride_w, part_h, part_w,
                        HAS_ENTROPY: tl.constexpr, H_PARTS: tl.constexpr, W_PARTS: tl.constexpr,
                        Z_ORDER: tl.constexpr, G_PARTS: tl.constexpr, G_ORDER: tl.constexpr,
                        INTERPRET: tl.constexpr,
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
        z = _logits_tile(h_ptr, w_ptr, part_h, part_w, offs_t64, offs_v64, mask_t, mask_v, D, stride_h, stride_w,
                         H_PARTS, W_PARTS, Z_ORDER, INTERPRET, BLOCK_T, BLOCK_V, BLOCK_D)
        g = _grad_logits(z, offs_v, mask_v, y, lse, g_lp, mean, g_ent, floor, floor_ptr,
                         HAS_ENTROPY)  # [BLOCK_T, BLOCK_V]
        _add_split_dot_rows(dw_rows, mask_v, tl.trans(g), h_ptr, part_h, offs_t64, mask_t, stride_h, D,
                            G_PARTS, H_PARTS, G_ORDER, INTERPRET, BLOCK_D)  # g^T: [BLOCK_V, BLOCK_T]


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Launch parameters. Block sizes are powers of two >= 16 (tl.dot's minimum on every GPU)."""

    block_t: int
    block_v: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2
    vocab_splits: int | None = None  # None: enough splits to give ~2 programs per SM

    def __post_init__(self):
        for name in ("block_t", "block_v", "block_d"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16 (a tl.dot dimension), got {size}")
        if self.vocab_splits is not None and self.vocab_splits < 1:
            raise ValueError(f"TileConfig.vocab_splits must be >= 1 or None, got {self.vocab_splits}")


def default_config(device: torch.device, parts: int) -> TileConfig:
    """Launch parameters for H100/H200 given the hidden states' part count (1 or 3), tiles of 16 for the
    CPU interpreter (one Python step per op).

    The GPU ones are the largest tiles without register spills or shared memory over the sm_90 limit in
    offline sm_90a compiles (sm90_check.py); not yet timed on a GPU (README.md).
    """
    if device.type != "cuda":
        return TileConfig(block_t=16, block_v=32, block_d=16)
    if parts == 3:  # three hidden tiles per step
        return TileConfig(block_t=64, block_v=128, block_d=32, num_warps=8, num_stages=3)
    return TileConfig(block_t=64, block_v=128, block_d=64, num_warps=8, num_stages=3)


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


def native_16bit(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the dots take the inputs as they are (one 16-bit dtype) rather than split into bf16 parts."""
    return hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16)


def _parts(x: torch.Tensor, native: bool) -> torch.Tensor:
    """The [P, rows, D] operand stack the kernels read: x itself as one part (no copy) when the dots take
    it as it is or it is bf16 already, else its three bf16 parts."""
    return x.unsqueeze(0) if native or x.dtype == torch.bfloat16 else split_parts(x)


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


def _launch_args(h_parts: torch.Tensor, w_parts: torch.Tensor) -> tuple[tuple, dict]:
    """The shape arguments (T, V, D, row strides, part strides) and part counts of every kernel."""
    (hp, t, d), (wp, v, _) = h_parts.shape, w_parts.shape
    shape = (t, v, d, h_parts.stride(1), w_parts.stride(1), h_parts.stride(0), w_parts.stride(0))
    return shape, dict(H_PARTS=hp, W_PARTS=wp, INTERPRET=interpreting())


def _orders(native: bool, out_dtype: torch.dtype) -> dict:
    """Part orders of a kernel whose result is returned in `out_dtype` (see "Precision"): the logits'
    (Z_ORDER) and the logit gradient's parts and order (G_PARTS, G_ORDER)."""
    if native:
        return dict(Z_ORDER=0, G_PARTS=1, G_ORDER=0)
    if out_dtype == torch.float32:
        return dict(Z_ORDER=2, G_PARTS=3, G_ORDER=2)
    return dict(Z_ORDER=1, G_PARTS=2, G_ORDER=1)  # ~2^-16 relative, under a 16-bit result's own rounding


def _meta(cfg: TileConfig) -> dict:
    return dict(BLOCK_T=cfg.block_t, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


class _TritonTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                floor: torch.Tensor | None, with_entropy: bool, cfg: TileConfig | None):
        ctx.set_materialize_grads(False)  # an unused entropy output costs nothing in the backward
        native = native_16bit(hidden, weight)
        h_parts, w_parts = _parts(hidden, native), _parts(weight, native)  # [P, T, D], [P, V, D]
        cfg = cfg or default_config(hidden.device, h_parts.shape[0])
        shape, parts = _launch_args(h_parts, w_parts)
        t, v = shape[:2]
        t_blocks, v_tiles = triton.cdiv(t, cfg.block_t), triton.cdiv(v, cfg.block_v)
        splits, per_split = _vocab_splits(cfg, hidden.device, t_blocks, v_tiles)
        # [K, T] each, allocated apart: slices of one buffer would change alignment with T, and so the
        # kernel's specialisation
        m, s, u, zy = (torch.empty(splits, t, device=hidden.device, dtype=torch.float32) for _ in range(4))
        if t > 0:
            _forward_kernel[(t_blocks, splits)](
                h_parts, w_parts, targets, floor, m, s, u, zy, *shape, per_split,
                WITH_ENTROPY=with_entropy, Z_ORDER=0 if native else 2, **parts, **_meta(cfg))
        logprob, entropy, lse, mean = _merge(m, s, u, zy, targets, with_entropy)
        ctx.save_for_backward(h_parts, w_parts, targets, lse, mean, floor)
        ctx.cfg, ctx.native, ctx.splits, ctx.per_split = cfg, native, splits, per_split
        ctx.dtypes = hidden.dtype, weight.dtype
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        h_parts, w_parts, targets, lse, mean, floor = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        has_entropy = grad_entropy is not None and grad_entropy.numel() > 0
        if grad_logprob is None and not has_entropy:
            return None, None, None, None, None, None
        shape, parts = _launch_args(h_parts, w_parts)
        t, v, d = shape[:3]
        g_lp = (lse.new_zeros(t) if grad_logprob is None
                else grad_logprob.float().masked_fill(targets < 0, 0.0).contiguous())  # [T]
        g_ent = grad_entropy.float().contiguous() if has_entropy else g_lp  # [T]; unread without entropy
        mean = mean if has_entropy else lse
        cfg, meta = ctx.cfg, dict(parts, HAS_ENTROPY=has_entropy, **_meta(ctx.cfg))
        dh_dtype, dw_dtype = ctx.dtypes
        args = (h_parts, w_parts, targets, lse, mean, g_lp, g_ent, floor)
        grad_h = grad_w = None
        if need_h:
            partial = torch.zeros(ctx.splits, t, d, device=lse.device, dtype=torch.float32)  # [K, T, D]
            if t > 0:
                _grad_hidden_kernel[(triton.cdiv(t, cfg.block_t), ctx.splits)](
                    *args, partial, *shape, ctx.per_split, **meta, **_orders(ctx.native, dh_dtype))
            grad_h = (partial[0] if ctx.splits == 1 else partial.sum(dim=0)).to(dh_dtype)
        if need_w:
            grad_w32 = torch.zeros(v, d, device=lse.device, dtype=torch.float32)  # [V, D]
            if t > 0:
                _grad_weight_kernel[(triton.cdiv(v, cfg.block_v),)](
                    *args, grad_w32, *shape, **meta, **_orders(ctx.native, dw_dtype))
            grad_w = grad_w32.to(dw_dtype)
        return grad_h, grad_w, None, None, None, None


def token_logprobs_triton(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          with_entropy: bool, floor: torch.Tensor | None = None, config: TileConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [T], entropy [T] or an empty tensor) in fp32; inputs validated, targets int64 [T],
    floor [T] fp32 or None."""
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"hidden, weight and targets must share a device, got {hidden.device}, "
                         f"{weight.device}, {targets.device}")
    return _TritonTokenLogprobs.apply(hidden.contiguous(), weight.contiguous(), targets.contiguous(),
                                      None if floor is None else floor.contiguous(), with_entropy, config)
