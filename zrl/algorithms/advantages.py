"""Group advantages (MaxRL, GRPO, Dr-GRPO) and the dynamic-sampling filter.

Responsibility: turn the task rewards of one prompt's group of G rollouts (plus an optional additive
length bonus) into one advantage per rollout, which the caller broadcasts to every response token.
Formulas: ZAYA1-8B report eq. 7 and §IV-B1 (MaxRL), §IV-B7 (GRPO); docs/algorithms.md §1; decisions in
zrl/algorithms/README.md.

Conventions and invariants:
- Per-group values are 1-D float64 numpy arrays `[G]`; inputs may be any 1-D array-like.
- Non-finite rewards are rejected. MaxRL rejects rewards outside [0, 1] (it divides by the group mean,
  which is only meaningful for non-negative rewards; environments map rewards into [0, 1]).
- A group whose task rewards are all equal gets exactly zero (task) advantage, never rounding noise.
- MaxRL: with rewards in [0, 1] and mean rbar > 0, r_i <= G·rbar, so |A_i| <= G - 1: no blow-up is
  possible once the rbar == 0 case is handled. A group of size 1 has r_1 == rbar, so A == 0 (the
  public `(r - rbar) / (rbar + 1e-6)` hack is not used). `min_mean_reward` only treats a mean that is
  zero up to float noise as zero.
- The length bonus enters the numerator only; the denominator uses the task rewards (report §IV-B1).
  It is supported by "maxrl" and "drgrpo"; "grpo" (behavioural stage, no length reward, report §IV-B7)
  rejects a non-zero bonus instead of dividing a pure length signal by a zero std.
- Order in the buffer: canary gate (zero flagged rewards) -> length bonus -> dynamic sampling -> advantages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

AdvantageName = Literal["maxrl", "grpo", "drgrpo"]

# Means below this are float noise around 0 for rewards in [0, 1]; binary groups have rbar >= 1/G.
MAXRL_MIN_MEAN_REWARD = 1e-6
# GRPO's std guard; only reached when the rewards are not all equal, so it never divides by ~0.
GRPO_STD_EPS = 1e-6


def _group_rewards(rewards: ArrayLike, what: str = "rewards") -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"{what} must be 1-D [G], got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError(f"{what} must be finite, got {r.tolist()}")
    return r


def _bonus(length_bonus: ArrayLike | None, group_size: int) -> np.ndarray:
    if length_bonus is None:
        return np.zeros(group_size, dtype=np.float64)
    b = _group_rewards(length_bonus, "length_bonus")
    if b.shape[0] != group_size:
        raise ValueError(f"length_bonus has {b.shape[0]} entries for a group of {group_size} rewards")
    return b


# The estimators on validated input: `r` finite [G] float64, `b` finite [G] float64 (zeros: no bonus).
# The public functions validate and call them; `zrl.algorithms.scoring` validates once per group.

def _centred(r: np.ndarray) -> np.ndarray:
    # [G]; exact zeros for all-equal groups (r - mean(r) can be ~1e-17 otherwise, e.g. [0.1, 0.1, 0.1]).
    if r.size == 0 or r.max() == r.min():
        return np.zeros_like(r)
    return r - r.mean()


def _maxrl(r: np.ndarray, b: np.ndarray, min_mean_reward: float = MAXRL_MIN_MEAN_REWARD) -> np.ndarray:
    if r.size == 0:
        return r.copy()
    lo, hi = r.min(), r.max()
    if lo < 0.0 or hi > 1.0:
        raise ValueError(
            f"MaxRL divides by the group mean reward and needs rewards in [0, 1]; got {r.tolist()}. "
            "Map the environment's reward into [0, 1] or use 'grpo'/'drgrpo'.")
    rbar = float(r.mean())
    if rbar < min_mean_reward:
        if b.any():
            # The length bonus needs >= 2 correct rollouts (eq. 9), so it cannot exist here.
            raise ValueError(
                f"non-zero length bonus {b.tolist()} in a group whose mean task reward is {rbar:g}; "
                "the length gate (k >= 2 correct) should have closed")
        return np.zeros_like(r)
    centred = np.zeros_like(r) if lo == hi else r - rbar  # `_centred` with the bounds and mean at hand
    return (centred + b) / rbar


def _grpo(r: np.ndarray, eps: float = GRPO_STD_EPS) -> np.ndarray:
    c = _centred(r)
    if not c.any():
        return c
    return c / (float(r.std()) + eps)


def _no_bonus(b: np.ndarray) -> None:
    if b.any():
        raise ValueError(
            "advantage 'grpo' does not take a length bonus: the behavioural stage that uses GRPO has no "
            "length reward (ZAYA1-8B report §IV-B7), and an all-correct group would divide it by std = 0")


def _drgrpo(r: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _centred(r) + b


def maxrl_advantages(rewards: ArrayLike, length_bonus: ArrayLike | None = None, *,
                     min_mean_reward: float = MAXRL_MIN_MEAN_REWARD) -> np.ndarray:
    """MaxRL: A_i = (r_i + Δr_i - rbar) / rbar; A = 0 when rbar < min_mean_reward (all failed).

    rewards: [G] task rewards in [0, 1] (binary in the ZAYA1 recipe; continuous ones are accepted as is).
    length_bonus: [G] additive Δr_i (numerator only) or None.
    """
    r = _group_rewards(rewards)
    return _maxrl(r, _bonus(length_bonus, r.shape[0]), min_mean_reward)


def grpo_advantages(rewards: ArrayLike, *, eps: float = GRPO_STD_EPS) -> np.ndarray:
    """GRPO: A_i = (r_i - rbar) / (std(r) + eps) with the population std (ddof = 0); std == 0 -> A = 0.

    The population std is used so that G = 1 is defined (A = 0); the sample std would differ by the
    constant sqrt(G / (G - 1)).
    """
    return _grpo(_group_rewards(rewards), eps)


def drgrpo_advantages(rewards: ArrayLike, length_bonus: ArrayLike | None = None) -> np.ndarray:
    """Dr-GRPO: A_i = r_i + Δr_i - rbar (mean-centred, no std division)."""
    r = _group_rewards(rewards)
    return _drgrpo(r, _bonus(length_bonus, r.shape[0]))


def _grpo_dispatch(rewards: ArrayLike, length_bonus: ArrayLike | None) -> np.ndarray:
    if length_bonus is not None:
        _no_bonus(np.asarray(length_bonus, dtype=np.float64))
    return grpo_advantages(rewards)


def _grpo_core(r: np.ndarray, b: np.ndarray) -> np.ndarray:
    _no_bonus(b)
    return _grpo(r)


_ADVANTAGES: dict[str, Callable[[ArrayLike, ArrayLike | None], np.ndarray]] = {
    "maxrl": lambda r, b: maxrl_advantages(r, b),
    "grpo": _grpo_dispatch,
    "drgrpo": lambda r, b: drgrpo_advantages(r, b),
}
ADVANTAGE_NAMES: tuple[str, ...] = tuple(_ADVANTAGES)
# The same estimators on validated rewards and bonus (zeros: none).
ADVANTAGE_CORES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "maxrl": _maxrl, "grpo": _grpo_core, "drgrpo": _drgrpo}


def _estimator(name: str, table: dict):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {list(ADVANTAGE_NAMES)}") from None


def compute_advantages(name: AdvantageName | str, rewards: ArrayLike,
                       length_bonus: ArrayLike | None = None) -> np.ndarray:
    """Advantages [G] of one group by estimator name ("maxrl" | "grpo" | "drgrpo", the recipe names)."""
    return _estimator(name, _ADVANTAGES)(rewards, length_bonus)


def zero_signal(r: np.ndarray, b: np.ndarray) -> Literal["task", "length", "none"]:
    """The dynamic-sampling rule on validated rewards `r` and bonus `b` (zeros: none), [G] float64: "task"
    (task rewards differ), "length" (all equal, kept for a non-zero bonus) or "none" (dropped)."""
    if r.size == 0:
        return "none"
    if r.max() > r.min():
        return "task"
    return "length" if b.any() else "none"


@dataclass(frozen=True)
class DynamicSamplingResult:
    """Outcome of the zero-variance filter over a batch of groups."""

    kept: tuple[int, ...]  # indices of kept groups, in input order
    num_dropped: int  # groups dropped (all task rewards equal and no length signal, or empty)
    num_kept_for_length: int  # groups with all-equal task rewards kept only for their length bonus


def filter_zero_variance_groups(task_rewards: Sequence[ArrayLike],
                                length_bonuses: Sequence[ArrayLike | None] | None = None,
                                ) -> DynamicSamplingResult:
    """DAPO dynamic sampling, run AFTER the length bonus is computed.

    A group is dropped when its task rewards are all equal (all-wrong, all-correct, G = 1) and its
    length bonus is absent or all zero, and when it is empty (G = 0). An all-correct group whose
    length bonus is non-zero is kept: under MaxRL its advantage is then A_i = Δr_i (rbar = 1), the
    pure length signal of the numerator-only length reward (docs/algorithms.md §1). With this rule a
    group is dropped exactly when every advantage it would get is zero.
    """
    if length_bonuses is not None and len(length_bonuses) != len(task_rewards):
        raise ValueError(f"{len(length_bonuses)} length bonuses for {len(task_rewards)} groups")
    kept: list[int] = []
    for_length = 0
    for g, rewards in enumerate(task_rewards):
        r = _group_rewards(rewards)
        bonus = None if length_bonuses is None else length_bonuses[g]
        signal = zero_signal(r, _bonus(bonus, r.shape[0]))
        if signal != "none":
            kept.append(g)
            for_length += signal == "length"
    return DynamicSamplingResult(kept=tuple(kept), num_dropped=len(task_rewards) - len(kept),
                                 num_kept_for_length=for_length)
