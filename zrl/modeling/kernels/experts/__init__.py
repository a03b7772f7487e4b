"""The MoE experts op: top-1 SwiGLU experts with a skip class, dispatched by `resolve("experts", x)`.

`moe_experts(x, expert_ids, gate, gate_up_proj, down_proj) -> y`
  x [T, D] compute dtype, expert_ids [T] int64 in [0, E] (E = skip class: zero output, no compute),
  gate [T] fp32, gate_up_proj [E, 2F, D] (gate rows, then up rows), down_proj [E, D, F];
  y [T, D] fp32 = gate * down_e(silu(g) * u). Differentiable w.r.t. x, gate and both weights.
Three implementations of the same result: the reference (reference.py, the definition; one host sync
per call), `torch._grouped_mm` (grouped_mm.py: what "auto" runs on CUDA where its sync-free fast path
applies, the reference elsewhere) and the Triton kernels (triton_kernel.py, backend "triton"); the
last two never synchronise with the host. Ids outside [0, E] are not checked here (that would need a
sync): the router validates them.
"""

from __future__ import annotations

import torch

from zrl.modeling import kernels
from zrl.modeling.kernels.experts import grouped_mm
from zrl.modeling.kernels.experts.reference import check_inputs, moe_experts_reference

__all__ = ["moe_experts", "moe_experts_reference"]


def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    check_inputs(x, expert_ids, gate, gate_up_proj, down_proj)
    choice = kernels.resolve("experts", x)
    if choice == "triton":
        from zrl.modeling.kernels.experts.triton_kernel import moe_experts_triton
        return moe_experts_triton(x, expert_ids, gate, gate_up_proj, down_proj)
    if choice == "library" and grouped_mm.unsupported_reason(x, gate_up_proj, down_proj) is None:
        return grouped_mm.moe_experts_grouped_mm(x, expert_ids, gate, gate_up_proj, down_proj)
    return moe_experts_reference(x, expert_ids, gate, gate_up_proj, down_proj)
