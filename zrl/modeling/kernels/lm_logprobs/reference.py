"""Reference LM head + log-softmax gather: the definition of `token_logprobs`, pure PyTorch, any device.

The LM head matmul and the log-softmax run in fp32 (LM_HEAD, LOGPROB of the FP32 op set) over chunks
of c tokens: only a [c, V] block of fp32 logits exists at a time, in the forward and again in the
backward, which recomputes it instead of saving it. Saved for backward: the inputs and the per-token
log-sum-exp (and the expected logit when entropy is asked for), O(T).

For a token with logits z (softmax p, lse = logsumexp z):
  logprob = z[y] - lse                    d/dz = onehot(y) - p
  entropy = lse - sum_j p_j z_j           d/dz_j = -p_j (z_j - sum_i p_i z_i)
Targets < 0 are ignored: their logprob is 0 and they send no gradient through it (their entropy,
when asked for, is still defined and differentiable).

With a logit floor f [T] the softmax runs over the token's support S = {j : not z_j < f} plus its
target: p_j = exp(z_j - lse_S) on S and 0 elsewhere, lse_S = logsumexp over S. The formulas above hold
with every sum over S; the floor is a constant (no gradient flows into it). `not z < f` rather than
`z >= f`, so a NaN logit stays in the support and shows in the result.
"""

from __future__ import annotations

import torch

from zrl.modeling.precision import Fp32Op, to_op_dtype

# Target chunk: c x V fp32 logits of about 256 MiB (c = 256 for the 262k Gemma3 vocabulary).
_CHUNK_BYTES = 1 << 28


def default_chunk_tokens(vocab_size: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * vocab_size))


def supported(logits: torch.Tensor, floor: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[c, V] bool: the support of each row of `logits` [c, V] under `floor` [c], its target (int64 [c],
    < 0 = none) always included."""
    keep = ~(logits < floor[:, None])
    safe = targets.clamp_min(0)[:, None]
    return keep.scatter_(1, safe, keep.gather(1, safe) | (targets >= 0)[:, None])


class Fp32Products:
    """The LM head's three products, each an fp32 matmul (LM_HEAD of the FP32 op set): the definition.
    Another formulation of the same products (library.py) plugs into `_ChunkedTokenLogprobs` here."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        self.hidden, self.weight = hidden, to_op_dtype(weight, Fp32Op.LM_HEAD)  # [T, D], [V, D]

    def logits(self, sl: slice) -> torch.Tensor:
        """[c, V] fp32 logits of the tokens in `sl`."""
        return to_op_dtype(self.hidden[sl], Fp32Op.LM_HEAD) @ self.weight.t()

    def grad_hidden(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """[c, D] fp32: grad_logits [c, V] @ W."""
        return grad_logits @ self.weight

    def new_grad_weight(self) -> torch.Tensor:
        return torch.zeros(self.weight.shape, dtype=torch.float32, device=self.weight.device)

    def add_grad_weight(self, grad_weight: torch.Tensor, grad_logits: torch.Tensor, sl: slice) -> None:
        """grad_weight [V, D] fp32 += grad_logits^T @ hidden[sl]."""
        grad_weight.addmm_(grad_logits.t(), to_op_dtype(self.hidden[sl], Fp32Op.LM_HEAD))


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                floor: torch.Tensor | None, chunk_tokens: int, with_entropy: bool, products: type = Fp32Products):
        head = products(hidden, weight)
        logprobs, lses, means, entropies = [], [], [], []
        for start in range(0, hidden.shape[0], chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            y = targets[sl]
            logits = head.logits(sl)  # [c, V]
            keep = None if floor is None else supported(logits, floor[sl], y)
            if keep is not None:
                logits.masked_fill_(~keep, float("-inf"))
            lse = torch.logsumexp(logits, dim=-1)  # [c]
            logprobs.append(logits.gather(1, y.clamp_min(0)[:, None])[:, 0] - lse)
            lses.append(lse)
            if with_entropy:
                # sum_j p_j (lse - z_j): non-negative terms, no cancellation between lse and E_p[z]
                gap = lse[:, None] - logits  # [c, V] = -log p (+inf outside the support)
                terms = torch.exp(-gap) * gap
                if keep is not None:
                    terms.masked_fill_(~keep, 0.0)  # 0 * inf there
                entropy_c = terms.sum(dim=-1)
                entropies.append(entropy_c)
                means.append(lse - entropy_c)  # E_p[z], for the backward
        logprob = torch.cat(logprobs).masked_fill(targets < 0, 0.0)  # [T]
        lse = torch.cat(lses)
        entropy = torch.cat(entropies) if with_entropy else None
        saved_mean = torch.cat(means) if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, lse, saved_mean, floor)
        ctx.chunk_tokens, ctx.with_entropy, ctx.products = chunk_tokens, with_entropy, products
        return logprob, (entropy if with_entropy else lse.new_zeros(0))

    @staticmethod
    def backward(ctx, grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse, mean_logit, floor = ctx.saved_tensors
        c = ctx.chunk_tokens
        head = ctx.products(hidden, weight)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_w = head.new_grad_weight() if need_w else None
        grad_h = []
        if grad_logprob is None:
            grad_logprob = lse.new_zeros(lse.shape)
        grad_logprob = grad_logprob.to(lse.dtype).masked_fill(targets < 0, 0.0)  # fp32 (float64 products: float64)
        use_entropy = ctx.with_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        for start in range(0, hidden.shape[0], c):
            sl = slice(start, start + c)
            logits = head.logits(sl)  # [c, V]
            dropped = None if floor is None else ~supported(logits, floor[sl], targets[sl])
            g_lp = grad_logprob[sl, None]  # [c, 1]
            # In place on the [c, V] block to keep one allocation per chunk (the logits stay finite
            # outside the support: p = 0 there zeroes their terms).
            if use_entropy:
                p = torch.exp(logits - lse[sl, None])  # softmax from the saved lse
                if dropped is not None:
                    p.masked_fill_(dropped, 0.0)
                g_ent = grad_entropy[sl, None].to(lse.dtype)
                grad_logits = logits.sub_(mean_logit[sl, None]).mul_(-g_ent).sub_(g_lp).mul_(p)
            else:
                grad_logits = logits.sub_(lse[sl, None]).exp_()
                if dropped is not None:
                    grad_logits.masked_fill_(dropped, 0.0)
                grad_logits.mul_(-g_lp)
            grad_logits.scatter_add_(1, targets[sl].clamp_min(0)[:, None], g_lp)
            if need_h:
                grad_h.append(head.grad_hidden(grad_logits))
            if need_w:
                head.add_grad_weight(grad_w, grad_logits, sl)
        out_h = torch.cat(grad_h).to(hidden.dtype) if need_h else None
        out_w = grad_w.to(weight.dtype) if need_w else None
        return out_h, out_w, None, None, None, None, None


def token_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             chunk_tokens: int | None, with_entropy: bool, floor: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [T], entropy [T] or an empty tensor) in fp32; inputs already validated, targets int64,
    floor [T] fp32 or None (every token in the support)."""
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets, floor, chunk, with_entropy)
