"""bf16 parts of fp32 values inside Triton kernels (bf16_split.py says what the parts are for).

`bf16_bits` rounds on the fp32 bits and returns the bf16 bit pattern, which a kernel stores (`as_int16`)
into a bf16 buffer viewed as int16: the same rounding as `Tensor.to(torch.bfloat16)`, and exact under
Triton's CPU interpreter, which gets bf16 arithmetic wrong. Imported only by kernel modules, which are
imported lazily (Triton fixes interpreted or compiled when a function is decorated).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_bits(x):
    """Round fp32 x to bf16 (nearest even): (its 16 bits in the low half of a uint32, the value as fp32)."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # NaN stays a (quiet) NaN
    return rounded, (rounded << 16).to(tl.float32, bitcast=True)


@triton.jit
def as_int16(bits):
    """A `bf16_bits` pattern as the int16 that a bf16 buffer viewed as int16 stores."""
    return bits.to(tl.uint16).to(tl.int16, bitcast=True)
