"""The MoE experts op on `torch._grouped_mm`: PyTorch's grouped GEMM (CUTLASS on Hopper), no host sync.

The reference's math (reference.py) with its per-expert loop replaced by two grouped GEMMs: tokens
are sorted by expert once, expert e owns sorted rows [offs[e-1], offs[e]) and the skip class the
tail [offs[E-1], T). `offs` is a device-side cumulative sum of the per-expert counts, so nothing is
read on the host. The gate is applied after the down projection in fp32, as in the reference; the
backward is autograd's (torch has a derivative for `_grouped_mm`).

Rows outside every group (the skip tail) are undefined in `_grouped_mm`'s output and in the gradient
of its first operand (they hold whatever memory they were given, NaN included). `torch.where` zeroes
them in the GEMM output before the gate multiplies it, and, placed on the sorted input, zeroes them in
the input's gradient (the backward of `where` selects, it never multiplies a NaN by 0). The
intermediate [g; u] and act tails stay undefined: the down GEMM and both weight gradients read only
the rows inside the groups.

With `fused_glue` the glue between and around the GEMMs is glue.py's: one Triton pass each for the
gather (skip tail written as zeros), the SwiGLU (skip tail not touched) and the gated scatter back to
token order (skip tokens' rows zero), and one each for their backward; the same values as the PyTorch
ops (glue.py says to what precision), about half their memory traffic. Off by default: not yet timed.

Where the library op runs without a host sync (`unsupported_reason`): CUDA capability 9.x (Hopper;
10.x has a fast path too, but gave non-zero weight gradients for experts without tokens, pytorch
issue 172439), bf16 weights (any other dtype takes a fallback that reads `offs` on the host), D and F
multiples of 8 (16-byte row strides) and 16-byte aligned weights. torch >= 2.9 also has a CPU kernel
(fp32, bf16, fp16; 16-byte strides), used by the parity tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# Whether the op runs glue.py's Triton passes by default: off until a GPU has timed them (the probe's kernel
# rows "grouped_mm fused glue" beside "grouped_mm", and its trainer run "+fused_glue").
FUSED_GLUE = False


def available() -> bool:
    """torch >= 2.9: `_grouped_mm` with autograd, a CPU kernel and the sync-free sm90 fast path."""
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return hasattr(torch, "_grouped_mm") and (major, minor) >= (2, 9)


def unsupported_reason(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """Why the auto backend cannot run this path on these inputs without a host sync, or None."""
    if not available():
        return f"torch {torch.__version__} has no usable torch._grouped_mm (needs >= 2.9)"
    if not x.is_cuda:
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(x.device)[0] != 9:
        return "torch._grouped_mm's fast path is only trusted on capability 9.x (Hopper)"
    if gate_up_proj.dtype != torch.bfloat16 or down_proj.dtype != torch.bfloat16:
        return f"weights are {gate_up_proj.dtype}: the sync-free grouped GEMM needs bf16"
    d, f = gate_up_proj.shape[2], down_proj.shape[2]
    if d % 8 or f % 8:
        return f"D = {d} and F = {f} must be multiples of 8 (16-byte rows in bf16)"
    for w in (gate_up_proj, down_proj):
        if not w.is_contiguous() or w.data_ptr() % 16:
            return "the expert weights must be contiguous and 16-byte aligned"
    return None


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """order [T] int64 (sorted row -> token; skip class last), offs [E] int32 (end row of each expert).
    Device-side only: CUDA `bincount` would read the ids' max on the host, `scatter_add_` does not."""
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int32))
    return order, counts[:num_experts].cumsum(0, dtype=torch.int32)


def moe_experts_grouped_mm(x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                           fused_glue: bool | None = None) -> torch.Tensor:
    """Same contract as `moe_experts`: x [T, D], expert_ids [T] in [0, E], gate [T] fp32,
    gate_up_proj [E, 2F, D], down_proj [E, D, F] -> y [T, D] fp32.

    fused_glue: the glue around the GEMMs as glue.py's Triton passes (on CPU in Triton's interpreter) instead
    of PyTorch ops; the same values. None: FUSED_GLUE.
    """
    order, offs = sort_by_expert(expert_ids, gate_up_proj.shape[0])
    fused_glue = FUSED_GLUE if fused_glue is None else fused_glue
    if fused_glue:
        from zrl.modeling.kernels.experts import glue  # lazy: Triton picks interpreter/compiler at import

        n = offs[-1:]  # [1]: rows past it are the skip class
        x_sorted = glue.permute(x, order, n, gate_up_proj.dtype)  # [T, D], zero rows past n
    else:
        routed = (torch.arange(x.shape[0], device=x.device) < offs[-1])[:, None]  # [T, 1], sorted rows
        x_sorted = torch.where(routed, x.index_select(0, order).to(gate_up_proj.dtype), 0)  # [T, D]
    gu = torch._grouped_mm(x_sorted, gate_up_proj.transpose(1, 2), offs=offs)  # [T, 2F]: [g; u]
    if fused_glue:
        y_sorted = torch._grouped_mm(glue.swiglu(gu, n), down_proj.transpose(1, 2), offs=offs)  # [T, D]
        return glue.unpermute_scale(y_sorted, gate, order, n)
    g, u = gu.chunk(2, dim=-1)  # [T, F] each
    y_sorted = torch._grouped_mm(F.silu(g) * u, down_proj.transpose(1, 2), offs=offs)  # [T, D]
    # bf16 * fp32 promotes to fp32 (the reference's y.float() * gate, bitwise) but leaves autograd
    # the bf16 y_sorted to save for dgate, not an fp32 copy.
    y_sorted = torch.where(routed, y_sorted, 0) * gate.index_select(0, order)[:, None]  # [T, D] fp32
    return torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
