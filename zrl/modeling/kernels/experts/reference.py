"""Pure-PyTorch reference of the MoE experts op: the definition of its result.

Expert e maps a token x [D] to down_e(silu(g) * u), with [g; u] = gate_up_e x (gate rows first, then
up rows, the HF `zaya` layout), and the op returns gate * that in fp32. A token routed to the skip
class (id E) gets a zero output, costs nothing and receives zero gradients.

Tokens are sorted by expert once and each expert runs on its contiguous slice; the gate is applied
after the down projection, in fp32 (the order the vLLM engine uses, so rollout and trainer agree).
The per-expert split reads the counts on the host: one synchronisation per call. This file holds
the math the model ran before the fused kernels existed; the Triton path is checked against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_inputs(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                 gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> None:
    """Shape checks shared by both backends (host-side metadata only: no synchronisation)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got shape {tuple(x.shape)}")
    t, d = x.shape
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != d or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj must be [E, 2F, D] with D={d}, got {tuple(gate_up_proj.shape)}")
    e, f = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if tuple(down_proj.shape) != (e, d, f):
        raise ValueError(f"down_proj must be [E, D, F] = {(e, d, f)}, got {tuple(down_proj.shape)}")
    if tuple(expert_ids.shape) != (t,) or expert_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expert_ids must be int64/int32 of shape [{t}], got {expert_ids.dtype} "
                         f"{tuple(expert_ids.shape)}")
    if tuple(gate.shape) != (t,) or gate.dtype != torch.float32:
        raise ValueError(f"gate must be fp32 of shape [{t}], got {gate.dtype} {tuple(gate.shape)}")


def moe_experts_reference(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """x [T, D], expert_ids [T] in [0, E], gate [T] fp32, gate_up_proj [E, 2F, D],
    down_proj [E, D, F] -> y [T, D] fp32."""
    num_experts = gate_up_proj.shape[0]
    order = torch.argsort(expert_ids, stable=True)  # [T] tokens grouped by expert
    counts = torch.bincount(expert_ids, minlength=num_experts + 1).tolist()
    x_sorted = x.index_select(0, order).to(gate_up_proj.dtype)
    gate_sorted = gate.index_select(0, order)
    outs = []
    for expert, (xe, ge) in enumerate(zip(x_sorted.split(counts), gate_sorted.split(counts))):
        if expert == num_experts or xe.shape[0] == 0:
            outs.append(xe.new_zeros(xe.shape, dtype=torch.float32))  # skip class: zero output
            continue
        g, u = F.linear(xe, gate_up_proj[expert]).chunk(2, dim=-1)  # [n, F] each
        y = F.linear(F.silu(g) * u, down_proj[expert])  # [n, D]
        outs.append(y.float() * ge[:, None])
    y_sorted = torch.cat(outs, dim=0)  # [T, D] fp32
    return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
