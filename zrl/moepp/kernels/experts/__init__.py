"""The MoE experts op: top-1 SwiGLU experts with a skip class, dispatched to Triton or the reference.

`moe_experts(x, expert_ids, gate, gate_up_proj, down_proj) -> y`
  x [T, D] compute dtype, expert_ids [T] int64 in [0, E] (E = skip class: zero output, no compute),
  gate [T] fp32, gate_up_proj [E, 2F, D] (gate rows, then up rows), down_proj [E, D, F];
  y [T, D] fp32 = gate * down_e(silu(g) * u). Differentiable w.r.t. x, gate and both weights.
The reference (reference.py) defines the result and syncs with the host once per call; the Triton
path (triton_kernel.py) is grouped GEMMs without host synchronisation. Ids outside [0, E] are not
checked here (that would need a sync): the router validates them.
"""

from __future__ import annotations

import torch

from zrl.moepp.kernels import use_triton
from zrl.moepp.kernels.experts.reference import check_inputs, moe_experts_reference

__all__ = ["moe_experts", "moe_experts_reference"]


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    check_inputs(x, expert_ids, gate, gate_up_proj, down_proj)
    if use_triton(x):
        from zrl.moepp.kernels.experts.triton_kernel import moe_experts_triton
        return moe_experts_triton(x, expert_ids, gate, gate_up_proj, down_proj)
    return moe_experts_reference(x, expert_ids, gate, gate_up_proj, down_proj)
