"""Difficulty-scaled length reward Δr (ZAYA1-8B report §IV-B2, eqs. 8-10) and its running solve-rate frontier.

Responsibility: for one group of G rollouts, compute the additive bonus Δr_i = c · p · m_i · λ̃_i that
MaxRL / Dr-GRPO add to the advantage numerator (see advantages.py), plus the per-data-source running
maximum solve rate p* that the gate m_i compares against, and the per-stage ramp of c.

Definitions (docs/algorithms.md §2):
- p = mean task reward of the group; k = number of rollouts with r_i == 1 ("correct");
  l_min = shortest correct length; l_max = a constant (the generation cap, `max_response_tokens`).
- λ_i = 1/2 - clamp((l_i - l_min) / (l_max - l_min), 0, 1)                          (eq. 8)
- λ̃_i = 1/2 if l_i <= l_min + L_tol else λ_i (ShortRL's reading of the report's missing line;
  L_tol = 200 tokens by default, `tolerance_tokens=None` gives λ̃ = λ).
- m_i = 1[p > p* - T_acc] · 1[k >= 2] · 1[r_i == 1]                                  (eq. 9)
  For binary rewards k >= 2 is the report's p > 1/G; for continuous rewards it keeps the text's intent
  ("at least two responses are correct"), where p > 1/G alone would open the gate with one correct.
- Δr_i = c · p · m_i · λ̃_i                                                          (eq. 10)

Decisions where the report is silent:
- l_max == l_min: every correct length equals the cap, so the normalised excess is defined as 0 for
  l_i <= l_min and 1 above it (λ = 1/2 or -1/2), never 0/0. l_min > l_max is a configuration error.
- p* is unknown until a source has been observed, and the gate is closed while it is unknown. The
  gate uses p* from earlier observations only: compute Δr for a batch, then `update` the frontier.
  The granularity of an observation is the caller's: the buffer records each source's mean solve rate
  over a trainer batch (a per-group maximum would reach 1.0 almost at once with G = 16, leaving the
  gate as p > 1 - T_acc).
- Under MaxRL the bonus's advantage contribution is Δr_i / p = c · m_i · λ̃_i: the p factor of eq. 10
  cancels the 1/rbar normalisation (rbar = p), so |Δ A_i| <= c / 2.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from numpy.typing import ArrayLike

from zrl.config.schema import LengthReward

# Defaults are the recipe schema's (the one place defaults are written).
LENGTH_TOLERANCE_TOKENS = LengthReward.model_fields["tolerance_tokens"].default  # L_tol, ShortRL's 200
ACCURACY_TOLERANCE = LengthReward.model_fields["accuracy_tolerance"].default  # T_acc (no value in the report)


def _lengths(lengths: ArrayLike, group_size: int) -> np.ndarray:
    lens = np.asarray(lengths)
    if lens.ndim != 1 or lens.shape[0] != group_size:
        raise ValueError(f"lengths must be 1-D with {group_size} entries, got shape {lens.shape}")
    out = lens.astype(np.float64)
    # One comparison per bound rejects NaN too (the min or max of an array holding NaN is NaN).
    if out.size and not (out.min() >= 0.0 and out.max() < math.inf):
        raise ValueError(f"lengths must be finite and >= 0, got {lens.tolist()}")
    return out


def _binary_like_rewards(rewards: ArrayLike) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [G], got shape {r.shape}")
    if r.size and not (r.min() >= 0.0 and r.max() <= 1.0):  # NaN fails both
        raise ValueError(f"the length reward needs task rewards in [0, 1], got {r.tolist()}")
    return r


def length_lambdas(lengths: ArrayLike, l_min: float, l_max: float) -> np.ndarray:
    """λ_i of eq. 8 for every rollout, [G] float64 in [-1/2, 1/2]."""
    if l_min > l_max:
        raise ValueError(f"shortest correct length {l_min} exceeds l_max={l_max} (the generation cap)")
    lens = np.asarray(lengths, dtype=np.float64)
    span = float(l_max) - float(l_min)
    if span == 0.0:
        excess = (lens > l_min).astype(np.float64)
    else:
        excess = np.clip((lens - l_min) / span, 0.0, 1.0)
    return 0.5 - excess


def tolerant_lambdas(lengths: ArrayLike, l_min: float, l_max: float,
                     tolerance_tokens: int | None = LENGTH_TOLERANCE_TOKENS) -> np.ndarray:
    """λ̃_i: 1/2 within `tolerance_tokens` of l_min, else λ_i; `None` disables the tolerance (λ̃ = λ)."""
    lam = length_lambdas(lengths, l_min, l_max)
    if tolerance_tokens is None:
        return lam
    if tolerance_tokens < 0:
        raise ValueError(f"tolerance_tokens must be >= 0 or None, got {tolerance_tokens}")
    lens = np.asarray(lengths, dtype=np.float64)
    return np.where(lens <= l_min + tolerance_tokens, 0.5, lam)


def length_gate(rewards: ArrayLike, p_star: float | None,
                accuracy_tolerance: float = ACCURACY_TOLERANCE) -> np.ndarray:
    """m_i of eq. 9, [G] float64 of 0/1. `p_star=None` (source not yet observed) closes the gate."""
    r = _binary_like_rewards(rewards)
    correct = _open_gate(r, p_star, accuracy_tolerance)
    return np.zeros_like(r) if correct is None else correct.astype(np.float64)


def _open_gate(r: np.ndarray, p_star: float | None, accuracy_tolerance: float) -> np.ndarray | None:
    # The gate's [G] bool mask 1[r_i == 1] when the group passes it (k >= 2, p > p* - T_acc), else None.
    correct = r == 1.0
    if r.size == 0 or p_star is None or np.count_nonzero(correct) < 2:
        return None
    p = float(r.mean())
    if not p > p_star - accuracy_tolerance:
        return None
    return correct


def length_rewards(rewards: ArrayLike, lengths: ArrayLike, *, l_max: float, c: float,
                   p_star: float | None, accuracy_tolerance: float = ACCURACY_TOLERANCE,
                   tolerance_tokens: int | None = LENGTH_TOLERANCE_TOKENS) -> np.ndarray:
    """Δr_i = c · p · m_i · λ̃_i for one group, [G] float64 (zeros when the gate is closed).

    rewards: [G] task rewards in [0, 1] after canary gating; lengths: [G] response tokens.
    """
    r = _binary_like_rewards(rewards)
    lens = _lengths(lengths, r.shape[0])
    return _length_rewards(r, lens, l_max=l_max, c=c, p_star=p_star, accuracy_tolerance=accuracy_tolerance,
                           tolerance_tokens=tolerance_tokens)


def _length_rewards(r: np.ndarray, lens: np.ndarray, *, l_max: float, c: float, p_star: float | None,
                    accuracy_tolerance: float, tolerance_tokens: int | None) -> np.ndarray:
    # `length_rewards` on the arrays `_binary_like_rewards` and `_lengths` return (validated once per group).
    if c < 0:
        raise ValueError(f"length-reward coefficient c must be >= 0, got {c}")
    correct = _open_gate(r, p_star, accuracy_tolerance)
    if correct is None:
        return np.zeros_like(r)
    l_min = float(lens[correct].min())
    lam = tolerant_lambdas(lens, l_min, l_max, tolerance_tokens)
    return c * float(r.mean()) * correct.astype(np.float64) * lam


def length_coef(step: int, *, num_steps: int, c_start: float, c_end: float) -> float:
    """c at stage-local trainer step `step`: linear from c_start (step 0) to c_end (step num_steps - 1).

    Steps past the end hold c_end; a one-step stage uses c_start. The cascade ramps c from a small
    value in reasoning warm-up to 1.0 in math+code (003 §IV-B1): c_start < c_end in one stage, or
    c_start == c_end per stage.
    """
    if num_steps < 1 or step < 0:
        raise ValueError(f"need num_steps >= 1 and step >= 0, got num_steps={num_steps}, step={step}")
    frac = min(step / max(num_steps - 1, 1), 1.0)
    return c_start + (c_end - c_start) * frac


class SolveRateFrontier:
    """Running maximum solve rate p* per data source (environment), the frontier of the gate m_i.

    Starts empty: `p_star(source)` is None until `update(source, ...)` has been called, which keeps
    the gate closed. State is a plain `{source: p*}` dict for checkpoints.
    """

    def __init__(self) -> None:
        self._p_star: dict[str, float] = {}

    def p_star(self, source: str) -> float | None:
        return self._p_star.get(source)

    def update(self, source: str, solve_rate: float) -> float:
        """Record an observed solve rate in [0, 1] for `source`; returns the new p*."""
        if not 0.0 <= solve_rate <= 1.0:
            raise ValueError(f"solve rate must lie in [0, 1], got {solve_rate} for source {source!r}")
        best = max(self._p_star.get(source, solve_rate), float(solve_rate))
        self._p_star[source] = best
        return best

    def state_dict(self) -> dict[str, float]:
        return dict(self._p_star)

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        for source, value in state.items():
            if not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"p* for {source!r} must lie in [0, 1], got {value}")
        self._p_star = {str(k): float(v) for k, v in state.items()}
