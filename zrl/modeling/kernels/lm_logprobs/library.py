"""The LM head on cuBLAS at fp32-level accuracy: the reference's chunks, its products as bf16 GEMMs.

Same chunks, log-sum-exp, entropy and backward as reference.py (`_ChunkedTokenLogprobs`); only the
three products differ. Each fp32 operand is split exactly into bf16 parts (`bf16_split.split_parts`), and a product
is the sum over part pairs (i, j) with i + j <= order of a_i @ b_j, every GEMM a bf16 tensor-core
GEMM with fp32 accumulation and an fp32 result (`torch.mm` / `torch.addmm` with out_dtype, CUDA only;
elsewhere the parts are multiplied in fp32, which is exact for bf16 products, so CPU tests check the
same sums). A bf16 weight is one part. The orders follow the precision each result is returned in:

| product | result | parts x parts (bf16 weight) | GEMM-equivalents (2 T V D) |
|---|---|---|---|
| logits, forward and again in the backward | fp32 | 3 hidden x W, order 2 | 3 + 3 |
| dh = G @ W | fp32 | 3 of G x W, order 2 | 3 |
| dW = G^T @ h | the weight's dtype: bf16 | order 1 (2^-16 relative) as one GEMM of K = 3c; order 2 for fp32 | 3 |

12 GEMM-equivalents forward + backward (a bf16 head: 3). Hidden and weight both bf16 (or both fp16) are
used as they are, one GEMM per product. A chunk is ~1 GiB of fp32 logits (c = 1024 at V = 262,144):
the dW GEMM's K = 3c keeps the [V, D] fp32 accumulator's read and write small next to its FLOPs.
"""

from __future__ import annotations

import torch

from zrl.modeling.kernels.bf16_split import bf16_gemm, split_parts
from zrl.modeling.kernels.lm_logprobs.reference import _ChunkedTokenLogprobs

_CHUNK_BYTES = 1 << 30


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * vocab_size))


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b (16-bit) as an fp32 result on the tensor cores; added into `out` [fp32] when given."""
    if out is None:
        return bf16_gemm(a, b)
    if a.is_cuda:
        return torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    return out.addmm_(a.float(), b.float())  # bf16 x bf16 products are exact in fp32: the same sums as on CUDA


def _pairs(a_parts: int, b_parts: int, order: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(a_parts) for j in range(b_parts) if i + j <= order]


class SplitProducts:
    """The products of `_ChunkedTokenLogprobs` as sums of bf16 part GEMMs (see the module docstring)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        self.native = hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16)
        self.hidden, self.dtype = hidden, hidden.dtype
        self.w_parts = self._parts(weight)  # [P, V, D]
        self.weight_shape, self.device = weight.shape, weight.device
        self.order_w = 2 if weight.dtype == torch.float32 else 1  # dW is returned in the weight's dtype
        self._grad, self._grad_parts = None, None  # the last logit gradient and its parts (both products use them)

    def _parts(self, x: torch.Tensor) -> torch.Tensor:
        """[P, *x.shape] 16-bit: x in the inputs' dtype when both share one (the logit gradient rounded to
        it), x itself when bf16, else its three bf16 parts."""
        if self.native:
            return x.to(self.dtype).unsqueeze(0)
        return x.unsqueeze(0) if x.dtype == torch.bfloat16 else split_parts(x)

    def _sum(self, a_parts: torch.Tensor, b_parts: torch.Tensor, order: int) -> torch.Tensor:
        out = None
        for i, j in _pairs(len(a_parts), len(b_parts), order):
            out = _gemm(a_parts[i], b_parts[j], out)
        return out

    def logits(self, sl: slice) -> torch.Tensor:
        return self._sum(self._parts(self.hidden[sl]), self.w_parts.transpose(1, 2), order=2)

    def _parts_of_grad(self, grad_logits: torch.Tensor) -> torch.Tensor:
        if self._grad is not grad_logits:
            self._grad, self._grad_parts = grad_logits, self._parts(grad_logits)
        return self._grad_parts

    def grad_hidden(self, grad_logits: torch.Tensor) -> torch.Tensor:
        return self._sum(self._parts_of_grad(grad_logits), self.w_parts, order=2)

    def new_grad_weight(self) -> torch.Tensor:
        return torch.zeros(self.weight_shape, dtype=torch.float32, device=self.device)

    def add_grad_weight(self, grad_weight: torch.Tensor, grad_logits: torch.Tensor, sl: slice) -> None:
        g, h = self._parts_of_grad(grad_logits), self._parts(self.hidden[sl])  # [P, c, V], [P, c, D]
        pairs = _pairs(len(g), len(h), self.order_w)
        # One GEMM over the pairs stacked along the token dimension (K = pairs x c).
        stacked_g = g[[i for i, _ in pairs]].flatten(0, 1)  # [pairs * c, V]
        stacked_h = h[[j for _, j in pairs]].flatten(0, 1)  # [pairs * c, D]
        _gemm(stacked_g.t(), stacked_h, grad_weight)


def token_logprobs_library(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                           chunk_tokens: int | None, with_entropy: bool, floor: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `token_logprobs_reference`, with the products of `SplitProducts`."""
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets, floor, chunk, with_entropy, SplitProducts)
