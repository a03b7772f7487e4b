"""LM head + log-softmax gather: per-token log-probabilities (and entropy) without [T, V] logits.

`token_logprobs` is the public op; it validates its inputs and dispatches (zrl.modeling.kernels) to
the chunked PyTorch reference (reference.py, the definition: [c, V] fp32 blocks), its library
formulation (library.py: the same chunks with every product a sum of bf16 cuBLAS GEMMs on exact bf16
parts of the fp32 operands; what "auto" runs on CUDA) or the fused Triton kernels (triton_kernel.py:
the same parts in tensor-core dots, the vocabulary streamed in tiles with an online log-sum-exp, so no
[T, V] block exists in any dtype). All compute the LM head and the log-softmax at fp32 accuracy
(LM_HEAD, LOGPROB of the FP32 op set) and take the same arguments; `chunk_tokens` only sizes the
chunked paths' blocks (the Triton path never holds more than one [BLOCK_T, BLOCK_V] tile per program).

`head_loss` is the same head fused with a token-separable loss (fused.py): the loss's per-token gradient
is applied as each chunk's log-probs are formed, so the forward computes dh and dW and the backward only
scales them; it runs the library formulation's products on CUDA ("auto") and the reference's elsewhere, and
has no Triton backend (`head_loss_available`).

An optional per-token logit floor restricts each token's softmax to the logits not below it (and its
target): the primitive under which zrl.modeling.logprobs reproduces a sampler's top-k / top-p / min-p
distribution. Where the floor comes from is not this op's business.
"""

from __future__ import annotations

import torch

from zrl.modeling import kernels
from zrl.modeling.kernels.lm_logprobs.fused import FusedFp32Products, FusedSplitProducts, TokenGrad, fused_head_loss
from zrl.modeling.kernels.lm_logprobs.library import token_logprobs_library
from zrl.modeling.kernels.lm_logprobs.reference import default_chunk_tokens, token_logprobs_reference

__all__ = ["TokenGrad", "default_chunk_tokens", "head_loss", "head_loss_available", "token_logprobs"]


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    logit_floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight^T)[targets] and optionally the entropy, both [T] fp32.

    hidden [T, D], weight [V, D] (the tied embedding), targets [T] int (< 0 = ignored: logprob 0, no
    gradient through it; targets >= V are not checked, which would need a host sync). The entropy is
    returned for monitoring and is also differentiable.
    logit_floor [T] (float, no gradient): token t's softmax, logprob and entropy are over the logits
    z_j with not z_j < logit_floor[t], plus its target, which is always kept; None = the whole vocabulary.
    """
    logit_floor, targets = _validated(hidden, weight, targets, logit_floor)
    choice = kernels.resolve("lm_logprobs", hidden)
    if choice == "triton":
        from zrl.modeling.kernels.lm_logprobs.triton_kernel import token_logprobs_triton

        logprob, entropy = token_logprobs_triton(hidden, weight, targets, with_entropy=with_entropy,
                                                 floor=logit_floor)
    else:
        chunked = token_logprobs_library if choice == "library" else token_logprobs_reference
        logprob, entropy = chunked(hidden, weight, targets, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                   floor=logit_floor)
    return logprob, (entropy if with_entropy else None)


def head_loss_available(hidden: torch.Tensor) -> bool:
    """Whether `head_loss` runs on `hidden` under the current kernel backend (not on "triton")."""
    return kernels.resolve("lm_logprobs", hidden) != "triton"


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_grad: TokenGrad,
    *,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    logit_floor: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss [], logprob [T], entropy [T] or None): the loss sum_t of `token_grad`'s terms, differentiable in
    hidden and weight; logprob and entropy (as `token_logprobs` returns them) detached, for metrics.

    `token_grad(rows, logprob, entropy)` gives, for the tokens `rows` (a slice of [T]), their loss terms
    and the loss's gradients with respect to their logprob and entropy (or None: no entropy term); see
    fused.py. Arguments otherwise as `token_logprobs`."""
    logit_floor, targets = _validated(hidden, weight, targets, logit_floor)
    choice = kernels.resolve("lm_logprobs", hidden)
    if choice == "triton":
        raise RuntimeError("head_loss has no Triton backend (head_loss_available); use token_logprobs")
    products = FusedSplitProducts if choice == "library" else FusedFp32Products
    loss, logprob, entropy = fused_head_loss(hidden, weight, targets, token_grad, products=products,
                                             chunk_tokens=chunk_tokens, with_entropy=with_entropy, floor=logit_floor)
    return loss, logprob, (entropy if with_entropy else None)


def _validated(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
               logit_floor: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [T, D] and targets [T], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, D] with D = {hidden.shape[1]}, got {tuple(weight.shape)}")
    if logit_floor is not None:
        if logit_floor.shape != targets.shape:
            raise ValueError(f"logit_floor must be [T] = {tuple(targets.shape)}, got {tuple(logit_floor.shape)}")
        logit_floor = logit_floor.detach().to(torch.float32)
    return logit_floor, targets.to(torch.int64)
