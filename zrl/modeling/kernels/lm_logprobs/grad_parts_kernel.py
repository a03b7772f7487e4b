"""The fused head loss's two elementwise passes per chunk, one Triton kernel each: the rows' log-sum-exp and
entropy (`row_stats`), then the logit gradient's bf16 parts written straight from the logits (`grad_parts`,
fused.py's `_grad_logits_` + `FusedSplitProducts.grad_operand`).

`row_stats`: one read of a row of z [c, V] fp32 (-inf outside a token's support), online over the
vocabulary with a running maximum m per lane, as in flash attention:
  s = sum exp(z - m),  u = sum exp(z - m) (m - z)     (u >= 0: no cancellation)
  lse = m + log s,     entropy = sum p (lse - z) = log s + u / s
One exponential per logit: when z > m the new maximum is z and the old sums are scaled instead. The
PyTorch formulation (logsumexp, then -gap, exp, multiply, sum) makes ~10 passes over [c, V].

`grad_parts`, per logit z[r, v] of a chunk:
  p = exp(z - lse[r]);  G = g_lp[r] (1[v = y_r] - p) - g_ent[r] p (z - mean[r])   (entropy term optional)
  hi = bf16(G), mid = bf16(G - hi), lo = bf16(G - hi - mid)   (round to nearest even, exact remainders)
and each part goes to the [c, V] blocks of the output that `sequence` names (e.g. [hi, mid, hi]): one read
of z (4 B per logit), one write per block (2 B), where the PyTorch formulation makes ~6 passes.

The parts are rounded with integer arithmetic on the fp32 bits and stored as int16 bit patterns into a
bf16 buffer viewed as int16 (`bf16_split_triton.bf16_bits`): the same rounding as `Tensor.to(torch.bfloat16)`,
and exact under Triton's CPU interpreter, which gets bf16 arithmetic wrong. Neither kernel specialises on the chunk size c or V, so a
microbatch's last (shorter) chunk compiles nothing new.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zrl.modeling.kernels.bf16_split_triton import as_int16, bf16_bits

BLOCK_V = 1024
STATS_BLOCK, STATS_WARPS = 2048, 8  # row_stats: lanes of one row's program (8 logits per thread a step)
MAX_BLOCKS = 4  # output blocks a launch writes (the fused head's sequences: [hi, mid, hi], [hi, mid], [hi], ...)


@triton.jit
def _store_part(out_ptr, block: tl.constexpr, part: tl.constexpr, offs, mask, bits0, bits1, bits2, block_stride):
    """Block `block` of the output gets part `part` (0 hi, 1 mid, 2 lo); nothing when block's part is -1."""
    if part >= 0:
        if part == 0:
            bits = bits0
        elif part == 1:
            bits = bits1
        else:
            bits = bits2
        tl.store(out_ptr + block * block_stride + offs, as_int16(bits), mask=mask)


@triton.jit(do_not_specialize=["rows", "vocab"])
def _grad_parts_kernel(z_ptr, lse_ptr, g_lp_ptr, g_ent_ptr, mean_ptr, y_ptr, out_ptr, rows, vocab,
                       HAS_ENTROPY: tl.constexpr, PARTS: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr,
                       S2: tl.constexpr, S3: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    offs = r.to(tl.int64) * vocab + cols
    z = tl.load(z_ptr + offs, mask=mask, other=float("-inf"))
    lse = tl.load(lse_ptr + r)
    g_lp = tl.load(g_lp_ptr + r)
    y = tl.load(y_ptr + r)
    p = tl.exp(z - lse)
    if HAS_ENTROPY:
        centred = tl.where(z == float("-inf"), 0.0, z - tl.load(mean_ptr + r))
        grad = (centred * -tl.load(g_ent_ptr + r) - g_lp) * p
    else:
        grad = p * -g_lp
    grad = tl.where(cols == y, grad + g_lp, grad)
    bits0, hi = bf16_bits(grad)
    bits1 = bits0
    bits2 = bits0
    if PARTS > 1:
        rest = grad - hi
        bits1, mid = bf16_bits(rest)
        if PARTS > 2:
            bits2, _ = bf16_bits(rest - mid)
    block_stride = rows.to(tl.int64) * vocab
    _store_part(out_ptr, 0, S0, offs, mask, bits0, bits1, bits2, block_stride)
    _store_part(out_ptr, 1, S1, offs, mask, bits0, bits1, bits2, block_stride)
    _store_part(out_ptr, 2, S2, offs, mask, bits0, bits1, bits2, block_stride)
    _store_part(out_ptr, 3, S3, offs, mask, bits0, bits1, bits2, block_stride)


def grad_parts(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor,
               g_ent: torch.Tensor | None, mean: torch.Tensor | None, sequence: list[int]) -> torch.Tensor:
    """[len(sequence), c, V] bf16: block k holds part sequence[k] of G (see the module docstring).

    z [c, V] fp32, lse / g_lp / g_ent / mean [c] fp32, targets [c] int64 (< 0: none; g_lp is 0 there)."""
    if not 0 < len(sequence) <= MAX_BLOCKS or not set(sequence) <= {0, 1, 2}:
        raise ValueError(f"1 to {MAX_BLOCKS} output blocks of parts 0-2, got {sequence}")
    rows, vocab = z.shape
    out = torch.empty((len(sequence), rows, vocab), dtype=torch.bfloat16, device=z.device)
    if rows == 0:
        return out
    ent = g_ent is not None
    lse = lse.float().contiguous()
    _grad_parts_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
        z.contiguous(), lse, g_lp.float().contiguous(), g_ent.float().contiguous() if ent else lse,
        mean.float().contiguous() if ent else lse, targets.contiguous(), out.view(torch.int16), rows, vocab,
        HAS_ENTROPY=ent, PARTS=max(sequence) + 1, S0=_at(sequence, 0), S1=_at(sequence, 1), S2=_at(sequence, 2),
        S3=_at(sequence, 3), BLOCK=BLOCK_V)
    return out


def _at(sequence: list[int], k: int) -> int:
    return sequence[k] if k < len(sequence) else -1


@triton.jit(do_not_specialize=["vocab"])
def _row_stats_kernel(z_ptr, lse_ptr, ent_ptr, vocab, HAS_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = z_ptr + r.to(tl.int64) * vocab
    cols = tl.arange(0, BLOCK)
    # a finite start, so that (z - m) and (m - z) stay finite for the first real logit of a lane
    m = tl.full([BLOCK], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        z = tl.load(row + start + cols, mask=start + cols < vocab, other=float("-inf"))
        dead = z == float("-inf")  # outside the support (or past V): no term
        z = tl.where(dead, m, z)
        up = z > m
        e = tl.where(dead, 0.0, tl.exp(-tl.abs(z - m)))  # exp(z - m) or, for a new maximum, exp(m - z)
        if HAS_ENTROPY:
            u = tl.where(up, e * (u + (z - m) * s), u + e * (m - z))
        s = tl.where(up, s * e + 1.0, s + e)
        m = tl.where(up, z, m)
    top = tl.max(m, 0)
    scale = tl.exp(m - top)
    total = tl.sum(s * scale, 0)
    tl.store(lse_ptr + r, top + tl.log(total))
    if HAS_ENTROPY:
        tl.store(ent_ptr + r, tl.log(total) + tl.sum(scale * (u + (top - m) * s), 0) / total)


def row_stats(z: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lse [c], entropy [c] or None), fp32, of the logits z [c, V] fp32 (see the module docstring)."""
    rows, vocab = z.shape
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    entropy = torch.empty_like(lse) if with_entropy else None
    if rows:
        _row_stats_kernel[(rows,)](z.contiguous(), lse, lse if entropy is None else entropy, vocab,
                                   HAS_ENTROPY=with_entropy, BLOCK=STATS_BLOCK, num_warps=STATS_WARPS)
    return lse, entropy
