"""One group's scores in one call, as the buffer admits it: length bonus Δr, dynamic sampling, advantages.

`score_group` returns exactly what `length_rewards`, `filter_zero_variance_groups` and
`compute_advantages` return when called one after another on the group (the buffer order, README.md),
with the same errors, but checks the group's rewards and lengths once instead of in every call: at
G = 16 the repeated checks cost more than the arithmetic (zrl plan admits ~140K groups in a 1,000-step
ZAYA1 plan).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from zrl.algorithms.advantages import ADVANTAGE_CORES, _estimator, _group_rewards, zero_signal
from zrl.algorithms.length_reward import (
    ACCURACY_TOLERANCE,
    LENGTH_TOLERANCE_TOKENS,
    _binary_like_rewards,
    _length_rewards,
    _lengths,
)


class GroupScore(NamedTuple):
    length_bonus: np.ndarray                  # [G] float64 Δr (zeros without a length reward)
    signal: Literal["task", "length", "none"]  # `zero_signal`: "none" is dropped under dynamic sampling
    advantages: np.ndarray | None             # [G] float64; None when dynamic sampling drops the group


def score_group(rewards: ArrayLike, lengths: ArrayLike, *, advantage: str, dynamic_sampling: bool,
                c: float | None, l_max: float, p_star: float | None,
                accuracy_tolerance: float = ACCURACY_TOLERANCE,
                tolerance_tokens: int | None = LENGTH_TOLERANCE_TOKENS) -> GroupScore:
    """Δr (`length_rewards` with `c`, ...; `c=None`: no length reward), the zero-signal decision and,
    unless the group is dropped, the `advantage` estimator's advantages of one group.

    rewards: [G] task rewards after the repetition gate; lengths: [G] response tokens.
    """
    estimator = _estimator(advantage, ADVANTAGE_CORES)
    if c is None:
        r = _group_rewards(rewards)
        bonus = np.zeros_like(r)
    else:
        r = _binary_like_rewards(rewards)
        bonus = _length_rewards(r, _lengths(lengths, r.shape[0]), l_max=l_max, c=c, p_star=p_star,
                                accuracy_tolerance=accuracy_tolerance, tolerance_tokens=tolerance_tokens)
        if bonus.any():  # the gate opened: Δr is checked as the separate calls check it
            _group_rewards(bonus, "length_bonus")
    signal = zero_signal(r, bonus)
    if dynamic_sampling and signal == "none":
        return GroupScore(bonus, signal, None)
    return GroupScore(bonus, signal, estimator(r, bonus))
