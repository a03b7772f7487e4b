"""The MoE experts op with low-rank adapters on every expert: zrl.modeling.kernels.experts' contract plus
the adapters.

Expert e maps x [D] to down'_e(silu(g) * u) with
  [g; u] = W_gu[e] x + s B_gu[e] A_gu[a] dropout(x),      down'_e(h) = W_d[e] h + s B_d[e] A_d[a] dropout(h)
(a = e, or 0 when A is shared by all experts; s = alpha / r) and the op returns gate * that in fp32;
the skip class (id E) gives zero and costs nothing. The adapters enter between the two projections,
through the SwiGLU, so the base op cannot be called as a whole: each path below is the base op's own
path (reference.py's per-expert loop, grouped_mm.py's grouped GEMMs) with the adapter terms added to
its two projections, and with B = 0 gives bitwise the base op's result on the same inputs. Which path
runs follows `kernels.resolve("experts", x)` as the base op does, except that a forced "triton"
backend runs the reference loop here (no adapted Triton kernel exists), and so does the library choice
when the adapters' rows are not 16-byte multiples (r % 8 in bf16, r % 4 in fp32): there, with B = 0, the
result equals the base's to rounding, not bitwise. The grouped path has run on torch's CPU kernel only
(tests/unit/lora), not yet on a GPU.

Gradients reach x, gate and the adapters; the frozen expert tensors get none when they do not require
one (autograd skips their weight-gradient GEMMs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from zrl.modeling import kernels
from zrl.modeling.kernels.experts import grouped_mm
from zrl.modeling.kernels.experts.reference import check_inputs


class ExpertAdapters(NamedTuple):
    gate_up_A: torch.Tensor  # [Ea, r, D], Ea = E or 1 (shared)
    gate_up_B: torch.Tensor  # [E, 2F, r]
    down_A: torch.Tensor  # [Ea, r, F]
    down_B: torch.Tensor  # [E, D, r]
    scale: float
    dropout: float  # 0 outside training


def lora_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, adapters: ExpertAdapters) -> torch.Tensor:
    """x [T, D] compute dtype, expert_ids [T] in [0, E], gate [T] fp32, gate_up_proj [E, 2F, D],
    down_proj [E, D, F] -> y [T, D] fp32."""
    check_inputs(x, expert_ids, gate, gate_up_proj, down_proj)
    choice = kernels.resolve("experts", x)
    if (choice == "library" and grouped_mm.unsupported_reason(x, gate_up_proj, down_proj) is None
            and _grouped_adapters_fit(adapters)):
        return lora_experts_grouped_mm(x, expert_ids, gate, gate_up_proj, down_proj, adapters)
    return lora_experts_reference(x, expert_ids, gate, gate_up_proj, down_proj, adapters)


def _grouped_adapters_fit(a: ExpertAdapters) -> bool:
    """`_grouped_mm` needs 16-byte row strides: r * element size a multiple of 16 (r % 8 in bf16)."""
    rank = a.gate_up_A.shape[1]
    return (rank * a.gate_up_A.element_size()) % 16 == 0 and all(
        t.is_contiguous() for t in (a.gate_up_A, a.gate_up_B, a.down_A, a.down_B))


def _delta(x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, a: ExpertAdapters) -> torch.Tensor:
    """s B A dropout(x) of one expert: x [n, in], A [r, in], B [out, r] -> [n, out] in the adapters' dtype."""
    x = x.to(lora_A.dtype)
    if a.dropout:
        x = F.dropout(x, a.dropout, True)
    return F.linear(F.linear(x, lora_A), lora_B) * a.scale


def lora_experts_reference(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor, a: ExpertAdapters) -> torch.Tensor:
    """reference.moe_experts_reference's loop (one host sync) with the adapter terms added."""
    num_experts = gate_up_proj.shape[0]
    shared = a.gate_up_A.shape[0] == 1
    order = torch.argsort(expert_ids, stable=True)  # [T] tokens grouped by expert
    counts = torch.bincount(expert_ids, minlength=num_experts + 1).tolist()
    x_sorted = x.index_select(0, order).to(gate_up_proj.dtype)
    gate_sorted = gate.index_select(0, order)
    outs = []
    for expert, (xe, ge) in enumerate(zip(x_sorted.split(counts), gate_sorted.split(counts))):
        if expert == num_experts or xe.shape[0] == 0:
            outs.append(xe.new_zeros(xe.shape, dtype=torch.float32))  # skip class: zero output
            continue
        ai = 0 if shared else expert
        gu = F.linear(xe, gate_up_proj[expert])  # [n, 2F]
        gu = gu + _delta(xe, a.gate_up_A[ai], a.gate_up_B[expert], a).to(gu.dtype)
        g, u = gu.chunk(2, dim=-1)  # [n, F] each
        h = F.silu(g) * u
        y = F.linear(h, down_proj[expert])  # [n, D]
        y = y + _delta(h, a.down_A[ai], a.down_B[expert], a).to(y.dtype)
        outs.append(y.float() * ge[:, None])
    y_sorted = torch.cat(outs, dim=0)  # [T, D] fp32
    return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)


def lora_experts_grouped_mm(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                            gate_up_proj: torch.Tensor, down_proj: torch.Tensor, a: ExpertAdapters) -> torch.Tensor:
    """grouped_mm.moe_experts_grouped_mm (no host sync) with the adapter terms as grouped GEMMs too.

    Rows outside every group (the skip tail) are undefined in `_grouped_mm`'s output and in its first
    operand's gradient; as in the base path, `where` zeroes them in the input (so also in the input's
    gradient) and in the output. A shared A is one plain GEMM over all rows: its input is zeroed in
    the tail (the tail of h is undefined), so no undefined value reaches A's gradient.
    """
    order, offs = grouped_mm.sort_by_expert(expert_ids, gate_up_proj.shape[0])
    routed = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]  # [T, 1], sorted rows
    x_sorted = torch.where(routed, x.index_select(0, order).to(gate_up_proj.dtype), 0)  # [T, D]
    gu = torch._grouped_mm(x_sorted, gate_up_proj.transpose(1, 2), offs=offs)  # [T, 2F]
    gu = gu + _grouped_delta(x_sorted, a.gate_up_A, a.gate_up_B, offs, routed, a).to(gu.dtype)
    g, u = gu.chunk(2, dim=-1)  # [T, F]
    h = F.silu(g) * u
    y_sorted = torch._grouped_mm(h, down_proj.transpose(1, 2), offs=offs)  # [T, D]
    y_sorted = y_sorted + _grouped_delta(h, a.down_A, a.down_B, offs, routed, a).to(y_sorted.dtype)
    y_sorted = torch.where(routed, y_sorted, 0) * gate.index_select(0, order)[:, None]  # [T, D] fp32
    return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)


def _grouped_delta(x_sorted: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, offs: torch.Tensor,
                   routed: torch.Tensor, a: ExpertAdapters) -> torch.Tensor:
    """s B_e A_e dropout(x) of sorted rows [T, in] -> [T, out] in the adapters' dtype (tail undefined)."""
    xa = x_sorted.to(lora_A.dtype)
    if a.dropout:
        xa = F.dropout(xa, a.dropout, True)
    if lora_A.shape[0] == 1:  # shared A: one GEMM over every row
        low = torch.where(routed, xa, 0) @ lora_A[0].t()  # [T, r]
    else:
        low = torch._grouped_mm(xa, lora_A.transpose(1, 2), offs=offs)  # [T, r]
    return torch._grouped_mm(low, lora_B.transpose(1, 2), offs=offs) * a.scale
