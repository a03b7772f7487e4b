"""Engine/trainer mismatch statistics (ZAYA1-8B report §IV-D, §IV-F; docs/algorithms.md §8).

Responsibility: compare the behaviour logprobs log q recorded by the rollout engine with the trainer's
recomputed logprobs log p on the same tokens (and, for this metric, the same weights):
- k1 = mean(log q - log p) and k3 = mean(ρ - 1 - log ρ), ρ = p/q: estimators of KL(q || p) with
  samples from q (k1 unbiased but signed, k3 unbiased and >= 0 per token);
- Pearson r of per-token probabilities and of logprobs (the report measures, with the FP32 op set and
  router replay on its 8B model: KL ≈ 1.3e-4, r > 0.9996 in bf16);
- mean and max |p - q|.

Distribution: `mismatch_sums` returns float64 sufficient statistics of one microbatch that add up
across microbatches and ranks (all-reduce SUM, except the max entry: all-reduce MAX); `MismatchStats.
from_sums` finishes. Robustness: no tokens -> NaN statistics with num_tokens 0; a Pearson r is NaN
when either side has zero variance, except that identical inputs give r = 1 (perfect agreement).
Variances below 1e-12 of the mean square are treated as zero (float64 cancellation noise of the
raw-moment formula), and r is clipped to [-1, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Layout of the sums vector.
(_N, _K1, _K3, _ABS,
 _SP, _SQ, _SPP, _SQQ, _SPQ, _SDP,
 _SLP, _SLQ, _SLPP, _SLQQ, _SLPQ, _SDL, _MAXABS) = range(17)
NUM_SUMS = 17
_REL_VAR_FLOOR = 1e-12


def mismatch_sums(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                  loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[17] float64 sufficient statistics over the tokens where loss_mask is True (all if None).

    Entries 0-15 are sums (reduce with SUM); entry 16 is max |p - q| (reduce with MAX, 0 when empty).
    """
    if trainer_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"shapes differ: {tuple(trainer_logprobs.shape)} vs {tuple(behaviour_logprobs.shape)}")
    lp = trainer_logprobs.detach().to(torch.float64).reshape(-1)
    lq = behaviour_logprobs.detach().to(torch.float64).reshape(-1)
    if loss_mask is None:
        keep = torch.ones_like(lp, dtype=torch.bool)
    elif loss_mask.shape != trainer_logprobs.shape:
        raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != {tuple(trainer_logprobs.shape)}")
    else:
        keep = loss_mask.reshape(-1).to(torch.bool)
    # Masked by zeroing, not by boolean indexing (whose output size a GPU must read back to the host):
    # a dropped token has lp = lq = 0 and p = q = 0, so it adds 0 to every sum and to the max.
    lp, lq = torch.where(keep, lp, 0.0), torch.where(keep, lq, 0.0)
    p, q = torch.where(keep, lp.exp(), 0.0), torch.where(keep, lq.exp(), 0.0)
    log_ratio = lp - lq  # log ρ
    abs_diff = (p - q).abs()
    return torch.stack([
        keep.sum().to(torch.float64),
        (-log_ratio).sum(), (log_ratio.exp() - 1.0 - log_ratio).sum(), abs_diff.sum(),
        p.sum(), q.sum(), (p * p).sum(), (q * q).sum(), (p * q).sum(), ((p - q) ** 2).sum(),
        lp.sum(), lq.sum(), (lp * lp).sum(), (lq * lq).sum(), (lp * lq).sum(), ((lp - lq) ** 2).sum(),
        abs_diff.max() if abs_diff.numel() else torch.zeros((), dtype=torch.float64, device=lp.device),
    ])


def _pearson(n: float, sx: float, sy: float, sxx: float, syy: float, sxy: float, sdd: float) -> float:
    if n == 0:
        return math.nan
    if sdd == 0.0:  # identical inputs
        return 1.0
    mx, my = sx / n, sy / n
    vx, vy = sxx / n - mx * mx, syy / n - my * my
    if vx <= _REL_VAR_FLOOR * (sxx / n) or vy <= _REL_VAR_FLOOR * (syy / n):
        return math.nan
    r = (sxy / n - mx * my) / math.sqrt(vx * vy)
    return max(-1.0, min(1.0, r))


@dataclass(frozen=True)
class MismatchStats:
    num_tokens: int
    kl_k1: float
    kl_k3: float
    pearson_prob: float
    pearson_logprob: float
    mean_abs_prob_diff: float
    max_abs_prob_diff: float

    @staticmethod
    def from_sums(sums: torch.Tensor) -> MismatchStats:
        if sums.shape != (NUM_SUMS,):
            raise ValueError(f"sums must have shape ({NUM_SUMS},), got {tuple(sums.shape)}")
        s = sums.tolist()
        n = s[_N]
        if n == 0:
            return MismatchStats(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
        return MismatchStats(
            num_tokens=int(n), kl_k1=s[_K1] / n, kl_k3=s[_K3] / n,
            pearson_prob=_pearson(n, s[_SP], s[_SQ], s[_SPP], s[_SQQ], s[_SPQ], s[_SDP]),
            pearson_logprob=_pearson(n, s[_SLP], s[_SLQ], s[_SLPP], s[_SLQQ], s[_SLPQ], s[_SDL]),
            mean_abs_prob_diff=s[_ABS] / n, max_abs_prob_diff=s[_MAXABS])

    def as_metrics(self) -> dict[str, float]:
        return {"num_tokens": float(self.num_tokens), "kl_k1": self.kl_k1, "kl_k3": self.kl_k3,
                "pearson_prob": self.pearson_prob, "pearson_logprob": self.pearson_logprob,
                "mean_abs_prob_diff": self.mean_abs_prob_diff, "max_abs_prob_diff": self.max_abs_prob_diff}


def merge_mismatch_sums(sums: list[torch.Tensor]) -> torch.Tensor:
    """Combine microbatch sums locally (SUM for entries 0-15, MAX for entry 16)."""
    if not sums:
        raise ValueError("merge_mismatch_sums needs at least one sums vector")
    stacked = torch.stack(sums)  # [microbatches, NUM_SUMS]
    merged = stacked.sum(0)
    merged[_MAXABS] = stacked[:, _MAXABS].max()
    return merged


def mismatch_stats(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                   loss_mask: torch.Tensor | None = None) -> MismatchStats:
    """Mismatch statistics of one set of tokens."""
    return MismatchStats.from_sums(mismatch_sums(trainer_logprobs, behaviour_logprobs, loss_mask))
