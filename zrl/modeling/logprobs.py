"""The model's per-token log-probabilities (and entropy) through the LM head, under the distribution the
rollout engine samples from.

`chunked_token_logprobs` computes hidden [T, D] x weight [V, D] -> logprob [T] (and entropy [T]) in
fp32 (LM_HEAD, LOGPROB of the FP32 op set) without materialising [T, V] logits in fp32: it is the LM
head + log-softmax gather op of zrl.modeling.kernels.lm_logprobs (fused Triton kernels on CUDA, the chunked
PyTorch reference that defines the result elsewhere; switch: zrl.modeling.kernels, ZRL_KERNELS), applied
to the distribution named by a `SamplingDistribution`.

Why: the importance ratios, trust-region masks and mismatch metrics of RL compare the trainer's log p
of each sampled token with the behaviour log q the engine recorded, so both must refer to the same
distribution. The engine (serving/engine.py) records vLLM's "processed_logprobs": the log-probability
under the distribution the token was actually drawn from. vLLM 0.32 builds it from the fp32 logits z
in this order (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py, logits_processor/builtin.py):
  1. temperature   z <- z / T
  2. min-p         drop j where softmax(z)_j < min_p * max softmax(z)
  3. top-k         drop j where z_j < the k-th largest surviving z (ties with it survive)
  4. top-p         sort the survivors ascending, drop those whose cumulative renormalised mass is
                   <= 1 - p (fp32 arithmetic); the most probable token always survives
and returns log_softmax over the survivors. Penalties, logit bias and bad words (applied before the
temperature) are never set by zrl.

Design: the trainer reproduces that distribution; the engine is left as it is. The alternative, an
engine returning unfiltered temperature-only logprobs, does not exist in vLLM 0.32 ("raw_logprobs" is
before the temperature, "processed_logprobs" after all four steps) and would record a probability the
token was not sampled with. The reproduction is two small pieces:
- temperature: the hidden states are divided by T before the LM head ((h / T) W^T = z / T up to one
  fp32 rounding); autograd carries the 1/T into the gradients, so the kernels take no temperature.
- filters: every step keeps the tokens whose tempered logit is at least a per-token threshold (up to
  ties, below). `support_floor` replays vLLM's steps on chunks of fp32 logits (no gradient) and returns
  each token's floor half-way between its smallest kept and largest dropped logit; the logprob op then
  normalises over the logits not below the floor (zrl.modeling.kernels.lm_logprobs, `logit_floor`). The
  half-way point keeps the support stable under the ~1e-6 differences between two computations of the
  same logits (the Triton kernel sums in another order than the floor pass).
The support is a constant of the step (no gradient flows into the floor): d log p(y) / dz = onehot(y) - p
on the support, 0 off it.

Deviations, deliberate:
- The target token always belongs to its own support. On-policy this changes nothing (it was sampled
  from the support) except where the engine's logits (bf16, other kernels) put a sampled token just
  inside a boundary that the trainer's put it just outside; a stale token the current filters exclude
  gets exp(z_y) / (sum over the support and y) instead of probability 0. Both keep ratios, masks and
  metrics finite.
- Equal logits straddling a boundary are all kept here. vLLM's CPU sampler keeps them all at the
  top-k boundary but lets its sort order pick some at the top-p boundary; its CUDA sampler (a
  pivot-based Triton top-k/top-p kernel, not the sort above) picks some at both. Away from such ties
  the sets are the same; this module is verified against vLLM's CPU sampler only.
Cost: temperature alone costs one [T, D] division; filters add one no-gradient pass over [c, V] fp32 logit chunks (an
extra LM-head matmul, plus a sort of each row for top-p) and a few [c, V] temporaries per chunk.
"""

from __future__ import annotations

import dataclasses

import torch

from zrl.modeling import kernels
from zrl.modeling.kernels.lm_logprobs import TokenGrad, default_chunk_tokens, head_loss, token_logprobs
from zrl.modeling.kernels.lm_logprobs.library import SplitProducts
from zrl.modeling.kernels.lm_logprobs.reference import Fp32Products
from zrl.modeling.precision import Fp32Op, to_op_dtype

__all__ = ["SamplingDistribution", "chunked_token_logprobs", "chunked_head_loss", "default_chunk_tokens",
           "filtered_out", "support_floor"]


@dataclasses.dataclass(frozen=True)
class SamplingDistribution:
    """The engine's sampling distribution: temperature, then min-p, top-k, top-p (vLLM's order)."""

    temperature: float = 1.0
    top_k: int = 0  # <= 0: off (k >= V keeps every token too)
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def filtered(self) -> bool:
        """Whether any filter can drop a token (then the support needs `support_floor`)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    sampling: SamplingDistribution | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [T] fp32 under `sampling` (None: the plain softmax), and its entropy when asked.

    hidden [T, D], weight [V, D], targets [T] int (< 0 = ignored: logprob 0, no gradient through it).
    Both outputs are differentiable; `chunk_tokens` sizes the fp32 [c, V] blocks of the reference and
    of the floor pass.
    """
    if sampling is not None and sampling.temperature != 1.0:
        hidden = to_op_dtype(hidden, Fp32Op.LM_HEAD) / sampling.temperature
    floor = None
    if sampling is not None and sampling.filtered:
        floor = support_floor(hidden, weight, sampling, chunk_tokens=chunk_tokens)
    return token_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                          logit_floor=floor)


def chunked_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_grad: TokenGrad,
    *,
    chunk_tokens: int | None = None,
    with_entropy: bool = False,
    sampling: SamplingDistribution | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss [], logprob [T], entropy [T] or None) of a token-separable loss under `sampling`, the LM head
    fused with it (zrl.modeling.kernels.lm_logprobs.head_loss): the same distribution, temperature and
    support as `chunked_token_logprobs`; logprob and entropy detached."""
    if sampling is not None and sampling.temperature != 1.0:
        hidden = to_op_dtype(hidden, Fp32Op.LM_HEAD) / sampling.temperature
    floor = None
    if sampling is not None and sampling.filtered:
        floor = support_floor(hidden, weight, sampling, chunk_tokens=chunk_tokens)
    return head_loss(hidden, weight, targets, token_grad, chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                     logit_floor=floor)


@torch.no_grad()
def support_floor(hidden: torch.Tensor, weight: torch.Tensor, sampling: SamplingDistribution, *,
                  chunk_tokens: int | None = None) -> torch.Tensor:
    """[T] fp32: per token, the logit floor of `sampling`'s filters (-inf where nothing is dropped).

    hidden [T, D] must already be divided by the temperature (the filters act on tempered logits).
    """
    # fp32 logits as the LM head's own path forms them: bf16 cuBLAS GEMMs on exact parts where CUDA runs
    # its library formulation, fp32 matmuls elsewhere
    products = SplitProducts if kernels.resolve("lm_logprobs", hidden) == "library" else Fp32Products
    head = products(to_op_dtype(hidden, Fp32Op.LM_HEAD), weight)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    floors = [_floor(head.logits(slice(i, i + chunk)), sampling) for i in range(0, hidden.shape[0], chunk)]
    return torch.cat(floors) if floors else hidden.new_empty(0, dtype=torch.float32)


def filtered_out(z: torch.Tensor, sampling: SamplingDistribution) -> torch.Tensor:
    """[c, V] bool: the tokens vLLM's min-p, top-k and top-p steps drop from tempered logits z [c, V] fp32.

    The same tensor operations as vLLM's CPU sampler, so the same logits give the same set.
    """
    dropped = torch.zeros_like(z, dtype=torch.bool)
    if sampling.min_p > 0:
        probs = z.softmax(dim=-1)
        dropped |= probs < probs.amax(dim=-1, keepdim=True) * sampling.min_p
    if 0 < sampling.top_k < z.shape[-1]:
        survivors = z.masked_fill(dropped, float("-inf"))
        dropped |= survivors < survivors.topk(sampling.top_k, dim=-1).values[:, -1:]
    if sampling.top_p < 1:
        ascending, order = z.masked_fill(dropped, float("-inf")).sort(dim=-1)
        # vLLM computes 1 - p in fp32; `full` fills on the device (torch.tensor(p, device=...) would be a
        # blocking host-to-device copy)
        one_minus_p = 1 - torch.full((), sampling.top_p, dtype=torch.float32, device=z.device)
        tail = ascending.softmax(dim=-1).cumsum(dim=-1) <= one_minus_p
        tail[:, -1] = False  # the most probable token always survives
        dropped |= torch.zeros_like(tail).scatter_(-1, order, tail)
    return dropped


def _floor(z: torch.Tensor, sampling: SamplingDistribution) -> torch.Tensor:
    """[c]: half-way between the smallest kept and the largest dropped logit of each row of z [c, V]."""
    dropped = filtered_out(z, sampling)
    smallest_kept = z.masked_fill(dropped, float("inf")).amin(dim=-1)
    largest_dropped = z.masked_fill(~dropped, float("-inf")).amax(dim=-1)
    halfway = (smallest_kept + largest_dropped) / 2  # equal logits across a top-p cut: all kept
    return torch.where(dropped.any(dim=-1), halfway, float("-inf"))
