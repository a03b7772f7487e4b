"""Count the GEMM launches (and their FLOPs) a piece of PyTorch code dispatches, on any device.

A `TorchDispatchMode` sees every aten op, autograd's backward included, so `with GemmCounter() as c:`
around a forward and backward counts what the GPU would launch: the matrix products of zrl's kernels'
PyTorch formulations are aten calls whatever the device (CPU runs the same calls on fp32 values).
Used by the LM head's GEMM-count test and bench/lm_head_gemm_count.py.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# the GEMM ops: packet -> (index of A, index of B) in the call's arguments
GEMMS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2), aten._scaled_mm: (0, 1),
          aten._grouped_mm: (0, 1)}


class GemmCounter(TorchDispatchMode):
    """launches[name] and flops[name] of every GEMM run inside the `with` (all overloads, in-place ones
    included: `addmm_` is `aten.addmm_`, counted as addmm)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()
        self.flops: collections.Counter[str] = collections.Counter()

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    @property
    def total_flops(self) -> float:
        return float(sum(self.flops.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.addmm_:
            packet = aten.addmm
        if packet in GEMMS:
            ia, ib = GEMMS[packet]
            a, b = args[ia], args[ib]
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k = a.shape[-2], a.shape[-1]
            self.launches[packet.__name__] += 1
            self.flops[packet.__name__] += 2.0 * batch * m * k * b.shape[-1]
        return func(*args, **kwargs)
