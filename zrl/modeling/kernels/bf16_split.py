"""fp32 values as bf16 parts, and bf16 GEMMs with fp32 results: fp32-level products on the tensor cores.

An fp32 number has 24 significant bits, a bf16 one 8 with the same exponent range, so x is exactly
hi + mid + lo with three bf16 parts (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid); round to
nearest even, exact remainders). A product of two bf16 numbers is exact in fp32, so sum_i a_i @ b with a
bf16 b and fp32 accumulation is a @ b up to summation order: one bf16 tensor-core GEMM over the parts
stacked along K gives an fp32-level product (the LM head's and the CCA's GEMMs use it).

`split_parts` makes the three parts of a tensor; `bf16_gemm` multiplies 16-bit matrices into an fp32
result: cuBLAS's bf16 GEMM with an fp32 output on CUDA (`out_dtype`); elsewhere the operands' values in
fp32 (exact products, fp32 sums: the same sums up to order, so CPU tests check what CUDA computes).
Inside Triton kernels the parts come from bf16_split_triton.py.
"""

from __future__ import annotations

import torch


def split_parts(x: torch.Tensor) -> torch.Tensor:
    """[3, *x.shape] bf16 parts summing exactly to x in fp32 (x fp32 or narrower; 3 x 8 significant bits)."""
    x = x.float()
    hi = x.to(torch.bfloat16)
    rest = x - hi.float()
    mid = rest.to(torch.bfloat16)
    return torch.stack([hi, mid, (rest - mid.float()).to(torch.bfloat16)])


def bf16_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of 16-bit matrices ([M, K] x [K, N], or batched [B, M, K] x [B, K, N]) as an fp32 result."""
    if a.is_cuda:
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()  # bf16 x bf16 products are exact in fp32
