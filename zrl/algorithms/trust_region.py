"""Token-level trust regions and the policy-gradient loss per token (DPPO Binary-TV / Binary-KL, PPO clip).

Responsibility: given per-token trainer logprobs log p (with grad), behaviour logprobs log q recorded by
the rollout engine, per-token advantages and a loss mask, return the per-token loss l_t (zero on
masked-out tokens) and trust-region statistics. Aggregation over tokens/sequences is aggregation.py's.

Formulas (ZAYA1-8B report §IV-B1, DPPO; docs/algorithms.md §3), p = pi(y_t|s_t), q = mu(y_t|s_t):
- DPPO:  l_t = -A_t · M_t · sg(min(p/q, C)) · log p, so ∇l_t = -A_t · M_t · ∇p / q when p/q < C.
  Binary-TV keeps a token (M_t = 1) unless (A_t > 0 and p - q > delta) or (A_t < 0 and p - q < -delta).
  Binary-KL: D = KL(Bern(q) || Bern(p)) = q log(q/p) + (1-q) log((1-q)/(1-p)); drop when D > delta and
  (A_t > 0 and p > q) or (A_t < 0 and p < q).
- PPO clip (comparison): l_t = -min(ρ A, clip(ρ, 1 - clip_low, 1 + clip_high) A), ρ = p/q.

Invariants:
- The anchor is the behaviour logprob, so tokens from older policy versions are handled per token.
- Tokens are only masked when the gradient step would push p further from q: a token that moved back
  towards q, or whose advantage is 0, is never masked. A_t == 0 keeps M_t = 1 (it has no gradient
  anyway; keeping it means the masked fraction counts only real trust-region hits).
- Tensors may have any shape (packed [T] or padded [B, S]); all inputs share it. Maths in float32
  (float64 stays float64); p/q is exp(log p - log q), accurate when both are tiny.
- Loss-mask-false positions give l_t = 0 with an exactly zero (never NaN) gradient, even when their
  logprobs are -inf padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from zrl.config.schema import DPPOBinaryKL, DPPOBinaryTV, PPOClip

TrustRegionName = Literal["dppo_binary_tv", "dppo_binary_kl", "ppo_clip"]

# Defaults are the recipe schema's (the one place defaults are written).
TV_DELTA = DPPOBinaryTV.model_fields["delta"].default  # ZAYA1 production value (report §IV-B1)
KL_DELTA = DPPOBinaryKL.model_fields["delta"].default  # the report gives no value
IS_CAP = DPPOBinaryTV.model_fields["is_cap"].default  # truncated-IS cap C: large, guards against q ~ 0
PPO_CLIP_LOW = PPOClip.model_fields["clip_low"].default
PPO_CLIP_HIGH = PPOClip.model_fields["clip_high"].default

# Positions of the summed statistics in TrustRegionStats.sums.
_N, _NPOS, _NNEG, _MPOS, _MNEG, _ABSDIFF, _ISW, _CAPPED = range(8)


@dataclass(frozen=True)
class TrustRegionStats:
    """Sufficient statistics of one or more microbatches; merge by summing `sums` and max/min.

    sums: float64 [8] = (tokens, tokens A>0, tokens A<0, masked A>0, masked A<0, Σ|p - q|,
    Σ IS weight, IS weights at the cap). For PPO clip, "masked" means clipped (zero gradient).
    max/min_is_weight are ±inf on no tokens (the identities of max/min), so all-reduce works as is.
    """

    sums: torch.Tensor
    max_is_weight: torch.Tensor
    min_is_weight: torch.Tensor

    @staticmethod
    def merge(stats: Sequence[TrustRegionStats]) -> TrustRegionStats:
        if not stats:
            raise ValueError("merge needs at least one TrustRegionStats")
        return TrustRegionStats(
            sums=torch.stack([s.sums for s in stats]).sum(0),
            max_is_weight=torch.stack([s.max_is_weight for s in stats]).max(),
            min_is_weight=torch.stack([s.min_is_weight for s in stats]).min())

    def as_metrics(self) -> dict[str, float]:
        """Metric values; fractions and means over no tokens are NaN (undefined, not 0)."""
        s = self.sums.tolist()
        n, npos, nneg = s[_N], s[_NPOS], s[_NNEG]

        def frac(a: float, b: float) -> float:
            return a / b if b > 0 else math.nan

        return {
            "num_tokens": n,
            "masked_frac": frac(s[_MPOS] + s[_MNEG], n),
            "masked_frac_pos_adv": frac(s[_MPOS], npos),
            "masked_frac_neg_adv": frac(s[_MNEG], nneg),
            "mean_abs_prob_diff": frac(s[_ABSDIFF], n),
            "is_weight_mean": frac(s[_ISW], n),
            "is_weight_max": float(self.max_is_weight) if n > 0 else math.nan,
            "is_weight_min": float(self.min_is_weight) if n > 0 else math.nan,
            "is_capped_frac": frac(s[_CAPPED], n),
        }


@dataclass(frozen=True)
class PolicyLoss:
    token_loss: torch.Tensor  # same shape as the inputs; 0 where loss_mask is False
    keep_mask: torch.Tensor  # bool, M_t (True = contributes a gradient); False where loss_mask is False
    stats: TrustRegionStats


def _prepare(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
             loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = logprobs.shape
    for name, t in (("behaviour_logprobs", behaviour_logprobs), ("advantages", advantages),
                    ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    valid = loss_mask.to(torch.bool)
    # Padding may hold -inf/garbage: replace by 0 before any arithmetic so no NaN appears anywhere.
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(valid, logprobs.to(dtype), zero)
    lq = torch.where(valid, behaviour_logprobs.to(dtype), zero)
    adv = torch.where(valid, advantages.to(dtype), zero)
    return lp, lq, adv, valid


def _stats(lp: torch.Tensor, lq: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
           keep: torch.Tensor, is_weight: torch.Tensor, capped: torch.Tensor) -> TrustRegionStats:
    with torch.no_grad():
        f = torch.float64
        p, q = lp.exp(), lq.exp()
        pos, neg = valid & (adv > 0), valid & (adv < 0)
        dropped = valid & ~keep
        sums = torch.stack([
            valid.sum().to(f), pos.sum().to(f), neg.sum().to(f),
            (dropped & pos).sum().to(f), (dropped & neg).sum().to(f),
            torch.where(valid, (p - q).abs(), 0).sum().to(f),
            torch.where(valid, is_weight, 0).sum().to(f),
            (valid & capped).sum().to(f),
        ])
        inf = torch.full((), math.inf, dtype=f, device=lp.device)  # filled on the device: no host copy
        w = is_weight.to(f)
        return TrustRegionStats(sums=sums,
                                max_is_weight=torch.where(valid, w, -inf).max() if w.numel() else -inf,
                                min_is_weight=torch.where(valid, w, inf).min() if w.numel() else inf)


def binary_tv_keep_mask(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        advantages: torch.Tensor, *, delta: float = TV_DELTA) -> torch.Tensor:
    """M_t of DPPO Binary-TV (bool, True = keep); one-sided by the sign of A_t, A_t == 0 kept."""
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    diff = logprobs.detach().exp() - behaviour_logprobs.exp()  # p - q
    drop = ((advantages > 0) & (diff > delta)) | ((advantages < 0) & (diff < -delta))
    return ~drop


def _log1m_exp(logp: torch.Tensor) -> torch.Tensor:
    # log(1 - exp(logp)) for logp <= 0, accurate at both ends (expm1 near 0, log1p far below).
    return torch.where(logp > -math.log(2.0), torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))


def binary_kl(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(p)) per token from log p and log q (>= 0, +inf when p hits 0 or 1 alone)."""
    lp, lq = logprobs.detach().clamp(max=0.0), behaviour_logprobs.clamp(max=0.0)
    q = lq.exp()
    l1mp, l1mq = _log1m_exp(lp), _log1m_exp(lq)
    head = q * (lq - lp)  # q > 0 always: lq is finite on valid tokens
    tail = torch.where(q < 1.0, (1.0 - q) * (l1mq - l1mp), torch.zeros_like(q))  # 0 · log 0 = 0
    return (head + tail).clamp(min=0.0)


def binary_kl_keep_mask(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        advantages: torch.Tensor, *, delta: float = KL_DELTA) -> torch.Tensor:
    """M_t of DPPO Binary-KL: drop when the binary KL exceeds delta and p moved in the harmful direction."""
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    lp = logprobs.detach()
    harmful = ((advantages > 0) & (lp > behaviour_logprobs)) | ((advantages < 0) & (lp < behaviour_logprobs))
    return ~(harmful & (binary_kl(lp, behaviour_logprobs) > delta))


def truncated_is_weight(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        is_cap: float = IS_CAP) -> torch.Tensor:
    """sg(min(p/q, C)), detached."""
    if not is_cap > 0:
        raise ValueError(f"is_cap must be > 0, got {is_cap}")
    return (logprobs.detach() - behaviour_logprobs).exp().clamp(max=is_cap)


def _dppo_loss(keep_fn: Callable[..., torch.Tensor], logprobs: torch.Tensor,
               behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
               delta: float, is_cap: float) -> PolicyLoss:
    lp, lq, adv, valid = _prepare(logprobs, behaviour_logprobs, advantages, loss_mask)
    keep = keep_fn(lp, lq, adv, delta=delta) & valid
    w = truncated_is_weight(lp, lq, is_cap)
    coef = torch.where(keep, adv * w, torch.zeros_like(w))  # detached: A_t · M_t · sg(min(p/q, C))
    token_loss = -coef * lp
    stats = _stats(lp, lq, adv, valid, keep, w, w >= is_cap)
    return PolicyLoss(token_loss=token_loss, keep_mask=keep, stats=stats)


def dppo_binary_tv_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                        delta: float = TV_DELTA, is_cap: float = IS_CAP) -> PolicyLoss:
    """Per-token DPPO Binary-TV loss; gradient -A·∇p/q on kept tokens (p/q < is_cap)."""
    return _dppo_loss(binary_tv_keep_mask, logprobs, behaviour_logprobs, advantages, loss_mask,
                      delta, is_cap)


def dppo_binary_kl_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                        advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                        delta: float = KL_DELTA, is_cap: float = IS_CAP) -> PolicyLoss:
    """Per-token DPPO Binary-KL loss (same surrogate as Binary-TV, KL-based mask)."""
    return _dppo_loss(binary_kl_keep_mask, logprobs, behaviour_logprobs, advantages, loss_mask,
                      delta, is_cap)


def ppo_clip_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, *, clip_low: float = PPO_CLIP_LOW,
                  clip_high: float = PPO_CLIP_HIGH) -> PolicyLoss:
    """PPO ratio clipping against the behaviour policy, for comparison: -min(ρA, clip(ρ)A)."""
    if not (0 < clip_low < 1 and clip_high > 0):
        raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}")
    lp, lq, adv, valid = _prepare(logprobs, behaviour_logprobs, advantages, loss_mask)
    ratio = (lp - lq).exp()  # ρ, with grad
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv)
    token_loss = torch.where(valid, -surrogate, torch.zeros_like(surrogate))
    r = ratio.detach()
    clipped = ((adv > 0) & (r > 1.0 + clip_high)) | ((adv < 0) & (r < 1.0 - clip_low))
    keep = valid & ~clipped
    stats = _stats(lp, lq, adv, valid, keep, r, torch.zeros_like(valid))
    return PolicyLoss(token_loss=token_loss, keep_mask=keep, stats=stats)


# ---------------------------------------------------------------- per-token loss and gradient
# What the fused LM head (zrl.modeling.kernels.lm_logprobs.fused) needs from a trust region: each token's
# loss and d loss / d log p as functions of its own log p and constants, with no autograd. Each must equal
# autograd through the loss above (tests/unit/trainer/test_fused_loss.py checks it in float64).


def _dppo_loss_grad(keep_fn: Callable[..., torch.Tensor], logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                    advantages: torch.Tensor, loss_mask: torch.Tensor, delta: float,
                    is_cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    lp, lq, adv, valid = _prepare(logprobs, behaviour_logprobs, advantages, loss_mask)
    keep = keep_fn(lp, lq, adv, delta=delta) & valid
    w = truncated_is_weight(lp, lq, is_cap)
    coef = torch.where(keep, adv * w, torch.zeros_like(w))
    return -coef * lp, -coef  # l_t = -coef sg(...) log p: d l_t / d log p = -coef


def dppo_binary_tv_loss_grad(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                             loss_mask: torch.Tensor, *, delta: float = TV_DELTA,
                             is_cap: float = IS_CAP) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_t, d l_t / d log p) of `dppo_binary_tv_loss`."""
    return _dppo_loss_grad(binary_tv_keep_mask, logprobs, behaviour_logprobs, advantages, loss_mask, delta, is_cap)


def dppo_binary_kl_loss_grad(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                             loss_mask: torch.Tensor, *, delta: float = KL_DELTA,
                             is_cap: float = IS_CAP) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_t, d l_t / d log p) of `dppo_binary_kl_loss`."""
    return _dppo_loss_grad(binary_kl_keep_mask, logprobs, behaviour_logprobs, advantages, loss_mask, delta, is_cap)


def ppo_clip_loss_grad(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                       loss_mask: torch.Tensor, *, clip_low: float = PPO_CLIP_LOW,
                       clip_high: float = PPO_CLIP_HIGH) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_t, d l_t / d log p) of `ppo_clip_loss`, autograd's conventions included: `minimum` splits the
    gradient equally between equal arguments, `clamp` passes it on its closed interval."""
    if not (0 < clip_low < 1 and clip_high > 0):
        raise ValueError(f"need 0 < clip_low < 1 and clip_high > 0, got {clip_low}, {clip_high}")
    lp, lq, adv, valid = _prepare(logprobs, behaviour_logprobs, advantages, loss_mask)
    ratio = (lp - lq).exp()
    plain, clipped = ratio * adv, ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = torch.minimum(plain, clipped)
    share = torch.where(plain < clipped, 1.0, torch.where(plain == clipped, 0.5, 0.0)).to(ratio.dtype)
    inside = ((ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)).to(ratio.dtype)
    d_surrogate = adv * (share + (1.0 - share) * inside) * ratio  # d surrogate / d log p
    zero = torch.zeros_like(surrogate)
    return torch.where(valid, -surrogate, zero), torch.where(valid, -d_surrogate, zero)


_LOSS_GRADS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "dppo_binary_tv": dppo_binary_tv_loss_grad,
    "dppo_binary_kl": dppo_binary_kl_loss_grad,
    "ppo_clip": ppo_clip_loss_grad,
}


def token_separable(name: str) -> bool:
    """Whether trust region `name` has a per-token (loss, gradient) function (`policy_loss_grad`)."""
    return name in _LOSS_GRADS


def policy_loss_grad(name: TrustRegionName | str, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                     advantages: torch.Tensor, loss_mask: torch.Tensor,
                     **params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_t, d l_t / d log p) [same shape] of `policy_loss(name, ...)`, no autograd (inputs detached):
    what a fused LM head applies to each chunk's log-probs."""
    try:
        fn = _LOSS_GRADS[name]
    except KeyError:
        raise ValueError(f"no per-token gradient for trust region {name!r}; valid: {list(_LOSS_GRADS)}") from None
    return fn(logprobs, behaviour_logprobs, advantages, loss_mask, **params)


_LOSSES: dict[str, Callable[..., PolicyLoss]] = {
    "dppo_binary_tv": dppo_binary_tv_loss,
    "dppo_binary_kl": dppo_binary_kl_loss,
    "ppo_clip": ppo_clip_loss,
}
TRUST_REGION_NAMES: tuple[str, ...] = tuple(_LOSSES)


def policy_loss(name: TrustRegionName | str, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, loss_mask: torch.Tensor, **params: Any) -> PolicyLoss:
    """Per-token policy loss by recipe name; `params` are that method's options (delta, is_cap, ...)."""
    try:
        fn = _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown trust region {name!r}; valid: {list(TRUST_REGION_NAMES)}") from None
    return fn(logprobs, behaviour_logprobs, advantages, loss_mask, **params)
