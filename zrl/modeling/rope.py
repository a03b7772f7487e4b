"""Rotary position embeddings (rotate-half, optionally on the first channels of each head only).

`rope_cos_sin` gives the angles of the positions of a packed stream (restarting in each document, see
packing.PackedLayout); `apply_partial_rope` rotates q or k with them. Both run in fp32 (QK_NORM of the
FP32 op set, precision.py), computed as transformers and vLLM compute them so that angles at large
positions round identically.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim / 2] (fp32) for rotate-half RoPE at integer `positions` [T].

    Frequencies theta^(-2i / rotary_dim), computed in fp32 like the reference (and vLLM) so that
    angles at large positions round identically.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim
    inv_freq = 1.0 / (theta ** exponents)  # [rotary_dim / 2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
    return angles.cos(), angles.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2 * cos.shape[-1] channels of x [T, H, d]; the rest pass through."""
    half = cos.shape[-1]
    if half == 0:
        return x
    x1, x2, rest = x[..., :half], x[..., half: 2 * half], x[..., 2 * half:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
