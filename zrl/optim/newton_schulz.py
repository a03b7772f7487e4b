"""Newton–Schulz orthogonalisation, Muon's update scale and its FLOP count (docs/algorithms.md §5).

Responsibility: the pure maths of one Muon update direction, for one matrix or a batch of them.

Invariants:
- `newton_schulz(G)` approximates U·Vᵀ of G = U·S·Vᵀ with singular values mapped into roughly
  [0.7, 1.2] (the quintic with coefficients (3.4445, -4.7750, 2.0315) trades exact convergence for
  a steep slope at zero). It is invariant to positive scaling of G up to the 1e-7 in the norm.
- The iteration runs in bf16 (matmuls accumulate in fp32 on CPU and GPU); the Frobenius norm is
  taken in fp32 of the bf16-cast input, so casting to bf16 before communication changes nothing.
- A zero matrix maps to a zero matrix (0 / (0 + eps) = 0 and the polynomial has no constant term).
- Leading dimensions are batch dimensions: `[E, m, n]` is E independent matrices.
- Tall matrices (m > n) are transposed so every matmul has the small side p = min(m, n) as its
  outer dimension; the cost is `ns_flops` = steps · (4·p²·q + 2·p³) with q = max(m, n).
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
# Liu et al. 2025 ("Muon is scalable"): 0.2·sqrt(max(m, n)) makes the Muon update RMS match
# AdamW's typical update RMS (~0.2), so one learning rate serves both optimizers.
MATCH_RMS_ADAMW = 0.2


def muon_update_scale(m: int, n: int) -> float:
    """Factor applied to NS(G) of an m×n matrix: 0.2·sqrt(max(m, n))."""
    if m <= 0 or n <= 0:
        raise ValueError(f"matrix dims must be positive, got {m}x{n}")
    return MATCH_RMS_ADAMW * math.sqrt(max(m, n))


def ns_flops(shape: torch.Size | tuple[int, ...], steps: int = NS_STEPS) -> int:
    """FLOPs of `steps` Newton–Schulz iterations on a `[..., m, n]` batch of matrices.

    Per iteration on X [p, q] (p ≤ q): X·Xᵀ costs 2p²q, A·A 2p³, B·X 2p²q. The layer-sharded Muon
    post (docs/algorithms.md, sources) rounds the 5-step total 10·p²·(2q + p) up to 30·p²·q.
    """
    if len(shape) < 2:
        raise ValueError(f"need a matrix or a batch of matrices, got shape {tuple(shape)}")
    m, n = shape[-2], shape[-1]
    p, q = min(m, n), max(m, n)
    batch = math.prod(shape[:-2])
    return batch * steps * (4 * p * p * q + 2 * p * p * p)


def newton_schulz(
    grad: torch.Tensor,
    steps: int = NS_STEPS,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Orthogonalise `grad` [..., m, n]; returns a bf16 tensor of the same shape.

    X = G / (‖G‖_F + eps) per matrix; then `steps` times: A = X·Xᵀ, B = b·A + c·A·A, X = a·X + B·X.
    """
    if grad.ndim < 2:
        raise ValueError(f"Newton–Schulz needs a matrix or a batch of matrices, got shape {tuple(grad.shape)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    a, b, c = coefficients
    batch_shape = grad.shape[:-2]
    x = grad.to(torch.bfloat16).reshape(-1, grad.shape[-2], grad.shape[-1])  # [B, m, n]
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT  # [B, p, q] with p <= q
    # The norm in fp32 of the bf16 values: the division is exact up to one bf16 rounding.
    norm = torch.linalg.matrix_norm(x.float(), keepdim=True)  # [B, 1, 1]
    x = (x.float() / (norm + eps)).to(torch.bfloat16)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)  # [B, p, p]
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A·A
        x = torch.baddbmm(x, poly, x, beta=a)  # a·X + B·X
    if tall:
        x = x.mT
    return x.reshape(*batch_shape, grad.shape[-2], grad.shape[-1])
