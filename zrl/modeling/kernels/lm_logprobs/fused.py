"""The LM head fused with a token-separable loss: logits, log-probs, the loss's gradient and dh, dW in one
forward pass, chunk by chunk; the backward only scales them.

A loss L = sum_t f_t(logprob_t, entropy_t) is token-separable when a token's upstream gradients
dL/dlogprob_t and dL/dentropy_t depend only on its own logprob, entropy and per-token constants
(advantage, behaviour logprob, aggregation weight, a trust-region mask computed from the logprob). Every
policy loss and aggregation of zrl.algorithms is. Then the logit gradient of a chunk is known as soon as
its logits are, and per chunk of c tokens ([c, V] letters of README.md):

  z = h W^T                      [c, V] fp32 (the logits, once)
  lse, logprob, entropy          [c]
  (loss_t, g_lp, g_ent) = token_grad(rows, logprob, entropy)     the loss's small per-token function
  G = dL/dz = g_lp (onehot(y) - p) - g_ent p (z - E_p[z])          [c, V], written once, as bf16 parts
  dh[rows] = G W,  dW += G^T h[rows]

`FusedHeadLoss.forward` returns the loss (a scalar), with logprob and entropy as non-differentiable
outputs (for metrics); it saves dh [T, D] and dW [V, D] in the inputs' dtypes, and its backward returns
them times the upstream scalar gradient. No logit is recomputed in the backward.

The products (`FusedSplitProducts`, CUDA's library formulation; `FusedFp32Products`, the reference)
use the fewest bf16 parts each result needs, as library.py does; their orders and the float64 bounds
that justify them are in README.md ("Fused head loss") and test_fused.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zrl.modeling import kernels
from zrl.modeling.kernels.bf16_split import split_parts
from zrl.modeling.kernels.lm_logprobs import library, reference
from zrl.modeling.kernels.lm_logprobs.library import _gemm, _pairs
from zrl.modeling.kernels.lm_logprobs.reference import Fp32Products, supported

# (rows, logprob [c], entropy [c] or None) -> (loss terms [c], dL/dlogprob [c], dL/dentropy [c] or None).
# `rows` is the chunk's slice of the [T] token axis (to slice the per-token constants); the terms sum to
# the loss. Called under no_grad with detached inputs; it must not synchronise with the host.
TokenGrad = Callable[[slice, torch.Tensor, "torch.Tensor | None"],
                     "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]"]

# Orders of the part sums (i + j <= order over parts i of one operand and j of the other; a part is 8
# significant bits, so order k drops terms of relative size ~2^-(8(k+1))).
LOGIT_ORDER = 2  # fp32-level logits: log-probs as accurate as the unfused op's (the FP32 op set's purpose)
# dh and a 16-bit dW at order 0 (G's hi part against hidden's hi part and the bf16 weight): the formulation of
# every bf16 layer's backward GEMMs in the same step, which take the gradient rounded to bf16. Measured against
# float64 (README.md "Fused head loss"): dh within 1.4e-3 of its largest entry, under rounding the exact dh once
# to bf16 (2.5e-3); dW 2.3x its own final bf16 rounding. Order 1 would cost 3 more GEMM-equivalents per chunk.
GRAD_HIDDEN_ORDER = 0
GRAD_WEIGHT_ORDER_16BIT = 0
GRAD_WEIGHT_ORDER_FP32 = 2  # dW returned in fp32
_MAX_KERNEL_BLOCKS = 4  # grad_parts_kernel.MAX_BLOCKS (not imported: that module imports Triton)


class FusedFp32Products(Fp32Products):
    """The reference's fp32 matmuls; the logit gradient is its own (only) part."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, *, need_h: bool = True,
                 need_w: bool = True) -> None:
        super().__init__(hidden, weight)

    def grad_operand(self, grad_logits: torch.Tensor) -> torch.Tensor:
        return grad_logits

    def add_grad_weight(self, grad_weight: torch.Tensor | None, grad_logits: torch.Tensor,
                        sl: slice) -> torch.Tensor:
        if grad_weight is None:
            grad_weight = self.new_grad_weight()
        super().add_grad_weight(grad_weight, grad_logits, sl)
        return grad_weight


class FusedSplitProducts:
    """The three products as bf16 GEMMs on exact parts (bf16_split.py's `split_parts`, library.py's `_gemm`),
    stacked so that each is one GEMM launch per chunk with an fp32 result written once:

    - logits: K-stacked along D. hidden parts [T, nD] (made once) x the weight parts repeated to [V, nD]
      (made once per call: 3 copies of a bf16 weight, 3 x V x D x 2 bytes, freed when the op returns).
    - dh: M-stacked. The logit gradient's parts [n c, V] x W [V, D] -> [n c, D], its n blocks summed.
    - dW: K-stacked along the tokens. Gradient parts [n c, V]^T x hidden parts [n c, D], added into the
      [V, D] fp32 accumulator (the first chunk writes it).
    The gradient parts are written in the order (`grad_sequence`) the dW GEMM reads them, dh's parts a
    run of it, so both GEMMs read one buffer without a copy: at the default orders with a bf16 weight,
    G's hi part alone, against the hidden hi part for dW and the weight for dh.
    Hidden and weight of one 16-bit dtype are used as they are (one part each, G rounded to that dtype):
    3 GEMMs, a plain head's.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, *, need_h: bool = True,
                 need_w: bool = True, grad_hidden_order: int = GRAD_HIDDEN_ORDER,
                 grad_weight_order: int | None = None, parts_kernel: bool | None = None) -> None:
        self.native = hidden.dtype == weight.dtype and hidden.dtype in (torch.float16, torch.bfloat16)
        self.dtype, self.weight_shape, self.device = hidden.dtype, weight.shape, weight.device
        h_parts, w_parts = self._parts(hidden), self._parts(weight)  # [P_h, T, D], [P_w, V, D]
        n_h = len(h_parts)
        if grad_weight_order is None:
            grad_weight_order = GRAD_WEIGHT_ORDER_FP32 if weight.dtype == torch.float32 else GRAD_WEIGHT_ORDER_16BIT
        logit_pairs = _pairs(n_h, len(w_parts), LOGIT_ORDER)
        self.h_stacked = torch.cat([h_parts[i] for i, _ in logit_pairs], dim=1)  # [T, nD]
        self.w_stacked = torch.cat([w_parts[j] for _, j in logit_pairs], dim=1)  # [V, nD]
        # hidden part i as a [T, D] view of the stacked copy (the split parts themselves are dropped)
        d, first = hidden.shape[1], [[i for i, _ in logit_pairs].index(i) for i in range(n_h)]
        self.h_parts = [self.h_stacked[:, k * d:(k + 1) * d] for k in first]
        self.w_parts = w_parts
        n_g = 1 if self.native else 3
        # dW pairs (gradient part i, hidden part j), ordered by j then i so that the gradient parts dh
        # needs for the weight's first part come first
        w_pairs = sorted(_pairs(n_g, n_h, grad_weight_order), key=lambda p: (p[1], p[0])) if need_w else []
        self.h_pairs = _pairs(n_g, len(w_parts), grad_hidden_order) if need_h else []  # (gradient part, weight part)
        sequence = [i for i, _ in w_pairs]
        self.dh_blocks: list[tuple[int, int, int]] = []  # (weight part j, first block, blocks) read by dh
        for j in range(len(w_parts)):
            needed = sorted({i for i, jj in self.h_pairs if jj == j})
            if not needed:
                continue
            at = next((s for s in range(len(sequence) - len(needed) + 1)
                       if sequence[s:s + len(needed)] == needed), None)
            if at is None:  # not a run of the dW sequence (orders other than the defaults): extra blocks
                at, sequence = len(sequence), sequence + needed
            self.dh_blocks.append((j, at, len(needed)))
        self.grad_sequence = sequence  # gradient part of each [c, V] block of the buffer
        self.dw_hidden = [j for _, j in w_pairs]  # hidden part against each block, for dW
        # G's parts from the logits in one Triton pass (grad_parts_kernel.py) on CUDA; None = where it can
        # run (CUDA, Triton installed, split parts in at most its MAX_BLOCKS blocks); True forces it (tests,
        # through the interpreter)
        if parts_kernel is None:
            parts_kernel = (weight.is_cuda and kernels.triton_available() and not self.native
                            and 0 < len(sequence) <= _MAX_KERNEL_BLOCKS)
        self.parts_kernel = parts_kernel

    def _parts(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return x.to(self.dtype).unsqueeze(0)
        return x.unsqueeze(0) if x.dtype == torch.bfloat16 else split_parts(x)

    def logits(self, sl: slice) -> torch.Tensor:
        """[c, V] fp32: one GEMM of K = n D (order LOGIT_ORDER)."""
        return _gemm(self.h_stacked[sl], self.w_stacked.t())

    def grad_operand(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """[n, c, V] 16-bit: the parts of G in `grad_sequence` order (G [c, V] fp32 is clobbered).

        The elementwise work in PyTorch (a few passes over [c, V]); on CUDA `grad_parts` does it in one."""
        seq = self.grad_sequence
        out = torch.empty((len(seq), *grad_logits.shape), dtype=torch.bfloat16 if not self.native else self.dtype,
                          device=grad_logits.device)
        if self.native:
            out[0].copy_(grad_logits)
            return out
        written: dict[int, int] = {}
        for part in range(max(seq) + 1):
            block = seq.index(part)
            out[block].copy_(grad_logits)  # round to bf16
            if part < max(seq):
                grad_logits.sub_(out[block])  # exact: the remainder, for the next part
            written[part] = block
        for block, part in enumerate(seq):
            if written[part] != block:
                out[block].copy_(out[written[part]])
        return out

    def grad_parts(self, z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor,
                   g_ent: torch.Tensor | None, mean: torch.Tensor | None) -> torch.Tensor:
        """`grad_operand` of the logit gradient, formed from the logits z [c, V] in one kernel pass."""
        from zrl.modeling.kernels.lm_logprobs.grad_parts_kernel import grad_parts

        return grad_parts(z, lse, targets, g_lp, g_ent, mean, self.grad_sequence)

    def row_stats(self, z: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_row_stats` in one kernel pass over z (grad_parts_kernel.py)."""
        from zrl.modeling.kernels.lm_logprobs.grad_parts_kernel import row_stats

        return row_stats(z, with_entropy)

    def grad_hidden(self, parts: torch.Tensor) -> torch.Tensor:
        """[c, D] fp32: sum of G_i W_j over `h_pairs`, one M-stacked GEMM per weight part."""
        c, out = parts.shape[1], None
        for j, first, k in self.dh_blocks:
            blocks = _gemm(parts[first:first + k].flatten(0, 1), self.w_parts[j])  # [k c, D]
            term = blocks.view(k, c, -1).sum(0)
            out = term if out is None else out.add_(term)
        return out

    def add_grad_weight(self, grad_weight: torch.Tensor | None, parts: torch.Tensor, sl: slice) -> torch.Tensor:
        """grad_weight [V, D] fp32 (None: made by this chunk's GEMM) + one GEMM of K = n c."""
        k = len(self.dw_hidden)
        hidden = torch.cat([self.h_parts[j][sl] for j in self.dw_hidden])  # [k c, D], a small copy
        return _gemm(parts[:k].flatten(0, 1).t(), hidden, grad_weight)


def _row_stats(z: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(lse [c], entropy [c] or None) of the logits z [c, V] (-inf outside the support, where p = 0), in a
    few PyTorch passes; on CUDA `FusedSplitProducts.row_stats` makes one."""
    lse = torch.logsumexp(z, dim=-1)
    if not with_entropy:
        return lse, None
    gap = lse[:, None] - z  # -log p, +inf outside the support
    terms = torch.exp(-gap).mul_(gap)
    return lse, terms.masked_fill_(gap == float("inf"), 0.0).sum(dim=-1)


def _grad_logits_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g_lp: torch.Tensor,
                  g_ent: torch.Tensor | None, mean: torch.Tensor | None, dropped: torch.Tensor | None) -> torch.Tensor:
    """G = g_lp (onehot(y) - p) - g_ent p (z - E_p[z]) [c, V], in place on `logits` (z; -inf outside the
    support, where p = 0). g_lp is already 0 for ignored targets."""
    g_lp = g_lp[:, None]
    p_z = logits.sub(lse[:, None]).exp_() if g_ent is not None else None
    if g_ent is None:
        grad = logits.sub_(lse[:, None]).exp_().mul_(-g_lp)
    else:
        centred = logits.sub_(mean[:, None])
        if dropped is not None:
            centred.masked_fill_(dropped, 0.0)  # p = 0 there; avoid 0 * inf
        grad = centred.mul_(-g_ent[:, None]).sub_(g_lp).mul_(p_z)
    return grad.scatter_add_(1, targets.clamp_min(0)[:, None], g_lp)


class FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, floor: torch.Tensor | None,
                token_grad: TokenGrad, chunk_tokens: int, with_entropy: bool, products: type):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        head = products(hidden, weight, need_h=need_h, need_w=need_w)
        losses, logprobs, entropies, grad_h = [], [], [], []
        grad_w = None
        for start in range(0, hidden.shape[0], chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            y = targets[sl]
            z = head.logits(sl)  # [c, V]
            dropped = None if floor is None else ~supported(z, floor[sl], y)
            if dropped is not None:
                z.masked_fill_(dropped, float("-inf"))
            stats = head.row_stats if getattr(head, "parts_kernel", False) else _row_stats
            lse, entropy = stats(z, with_entropy)  # [c], [c] or None
            logprob = (z.gather(1, y.clamp_min(0)[:, None])[:, 0] - lse).masked_fill(y < 0, 0.0)
            mean = None if entropy is None else lse - entropy  # E_p[z]
            loss_t, g_lp, g_ent = token_grad(sl, logprob, entropy)
            if g_ent is not None and entropy is None:
                raise ValueError("token_grad returned an entropy gradient but with_entropy is False")
            losses.append(loss_t.sum())
            logprobs.append(logprob)
            if with_entropy:
                entropies.append(entropy)
            if not (need_h or need_w):
                continue
            g_lp = g_lp.to(z.dtype).masked_fill(y < 0, 0.0)
            g_ent = None if g_ent is None else g_ent.to(z.dtype)
            if getattr(head, "parts_kernel", False):
                operand = head.grad_parts(z, lse, y, g_lp, g_ent, mean)
            else:
                operand = head.grad_operand(_grad_logits_(z, lse, y, g_lp, g_ent, mean, dropped))
            if need_h:
                grad_h.append(head.grad_hidden(operand))
            if need_w:
                grad_w = head.add_grad_weight(grad_w, operand, sl)
        logprob = torch.cat(logprobs) if logprobs else hidden.new_zeros(0, dtype=torch.float32)
        entropy = torch.cat(entropies) if with_entropy and entropies else logprob.new_zeros(0)
        loss = torch.stack(losses).sum() if losses else logprob.new_zeros(())
        if need_w and grad_w is None:  # no token
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        saved_h = torch.cat(grad_h).to(hidden.dtype) if need_h and grad_h else (
            torch.zeros_like(hidden) if need_h else None)
        saved_w = grad_w.to(weight.dtype) if need_w else None
        ctx.save_for_backward(saved_h, saved_w)
        ctx.mark_non_differentiable(logprob, entropy)
        return loss, logprob, entropy

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_logprob, _grad_entropy):
        saved_h, saved_w = ctx.saved_tensors
        grad_h = None if saved_h is None else saved_h * grad_loss
        grad_w = None if saved_w is None else saved_w * grad_loss
        return grad_h, grad_w, None, None, None, None, None, None


def fused_head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_grad: TokenGrad, *,
                    products: type, chunk_tokens: int | None = None, with_entropy: bool = False,
                    floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [], logprob [T] fp32, entropy [T] or an empty tensor), the last two detached; inputs already
    validated, targets int64, floor [T] fp32 or None."""
    # the chunks of the unfused op these products come from (~1 GiB of fp32 logits on the library's path)
    default = library.default_chunk_tokens if products is FusedSplitProducts else reference.default_chunk_tokens
    chunk = chunk_tokens or default(weight.shape[0])
    return FusedHeadLoss.apply(hidden, weight, targets, floor, token_grad, chunk, with_entropy, products)
