"""Difficulty-scaled length reward (ZAYA1-8B report eqs. 8-10): hand-computed values and gate edge cases."""

import json

import numpy as np
import pytest

from zrl.algorithms.advantages import maxrl_advantages
from zrl.algorithms.length_reward import (
    SolveRateFrontier,
    length_coef,
    length_gate,
    length_lambdas,
    length_rewards,
    tolerant_lambdas,
)

# One group used throughout: 3 of 4 correct, p = 0.75, l_min = 100 (the 50-token rollout is wrong),
# l_max = 1100 so l_max - l_min = 1000.
REWARDS = [1, 1, 1, 0]
LENGTHS = [100, 300, 1000, 50]


def test_lambda_eq8_hand_values():
    # (l - 100)/1000 clamped: 0, 0.2, 0.9, 0 -> 0.5, 0.3, -0.4, 0.5
    np.testing.assert_allclose(length_lambdas(LENGTHS, 100, 1100), [0.5, 0.3, -0.4, 0.5])


def test_lambda_clamps_beyond_l_max():
    np.testing.assert_allclose(length_lambdas([100, 1100, 5000], 100, 1100), [0.5, -0.5, -0.5])


def test_lambda_guard_l_max_equals_l_min():
    # span 0: at or below l_min -> 1/2, above -> -1/2; never 0/0
    np.testing.assert_allclose(length_lambdas([500, 500, 400, 600], 500, 500), [0.5, 0.5, 0.5, -0.5])


def test_lambda_rejects_l_min_above_l_max():
    with pytest.raises(ValueError, match="exceeds l_max"):
        length_lambdas([700], 700, 600)


def test_tolerant_lambda_shortrl_reading():
    # within l_min + 200 = 300 -> 1/2; 1000 keeps λ = -0.4
    np.testing.assert_allclose(tolerant_lambdas(LENGTHS, 100, 1100, 200), [0.5, 0.5, -0.4, 0.5])
    # just past the tolerance: λ(301) = 0.5 - 0.201
    np.testing.assert_allclose(tolerant_lambdas([301], 100, 1100, 200), [0.299])
    # disabled
    np.testing.assert_allclose(tolerant_lambdas(LENGTHS, 100, 1100, None), [0.5, 0.3, -0.4, 0.5])
    with pytest.raises(ValueError, match="tolerance_tokens"):
        tolerant_lambdas(LENGTHS, 100, 1100, -1)


def test_length_rewards_eq10_hand_values():
    # Δr = c · p · m · λ̃ = 1 · 0.75 · [1,1,1,0] · [0.5, 0.5, -0.4, 0.5]
    dr = length_rewards(REWARDS, LENGTHS, l_max=1100, c=1.0, p_star=0.5, accuracy_tolerance=0.1)
    np.testing.assert_allclose(dr, [0.375, 0.375, -0.3, 0.0])
    dr_plain = length_rewards(REWARDS, LENGTHS, l_max=1100, c=0.5, p_star=0.5, tolerance_tokens=None)
    np.testing.assert_allclose(dr_plain, [0.1875, 0.1125, -0.15, 0.0])


def test_length_bonus_in_maxrl_advantage():
    dr = length_rewards(REWARDS, LENGTHS, l_max=1100, c=1.0, p_star=0.5)
    # (1 + Δr - 0.75)/0.75: 0.625/0.75, 0.625/0.75, -0.05/0.75; wrong: -1
    np.testing.assert_allclose(maxrl_advantages(REWARDS, dr), [0.8333333, 0.8333333, -0.0666667, -1.0],
                               rtol=1e-6)
    # Under MaxRL the bonus part is c · m · λ̃ (the p of eq. 10 cancels 1/rbar)
    np.testing.assert_allclose(maxrl_advantages(REWARDS, dr) - maxrl_advantages(REWARDS), [0.5, 0.5, -0.4, 0])


def test_gate_closed_until_source_observed():
    assert np.all(length_gate(REWARDS, None) == 0)
    assert np.all(length_rewards(REWARDS, LENGTHS, l_max=1100, c=1.0, p_star=None) == 0)


def test_gate_needs_two_correct():
    # k = 1: p = 0.25 > 1/G fails (eq. 9's p > 1/G <=> k >= 2)
    assert np.all(length_gate([1, 0, 0, 0], p_star=0.0) == 0)
    np.testing.assert_array_equal(length_gate([1, 1, 0, 0], p_star=0.0), [1, 1, 0, 0])


def test_gate_accuracy_tolerance_is_strict():
    # p = 0.5, p* = 0.75, T_acc = 0.25: 0.5 > 0.5 is false -> closed (values exact in binary)
    assert np.all(length_gate([1, 1, 0, 0], p_star=0.75, accuracy_tolerance=0.25) == 0)
    np.testing.assert_array_equal(length_gate([1, 1, 0, 0], p_star=0.75, accuracy_tolerance=0.375), [1, 1, 0, 0])
    # at the frontier with no tolerance the strict inequality also closes it
    assert np.all(length_gate([1, 1, 1, 0], p_star=0.75, accuracy_tolerance=0.0) == 0)


def test_gate_all_correct_group():
    np.testing.assert_array_equal(length_gate([1, 1, 1], p_star=1.0, accuracy_tolerance=0.1), [1, 1, 1])
    dr = length_rewards([1, 1, 1], [10, 10, 10], l_max=100, c=1.0, p_star=1.0)
    np.testing.assert_allclose(dr, [0.5, 0.5, 0.5])


def test_gate_continuous_rewards_only_exact_ones_are_correct():
    # k = 2 (only r == 1 counts), p = 0.625
    np.testing.assert_array_equal(length_gate([1, 1, 0.5, 0], p_star=0.5), [1, 1, 0, 0])
    assert np.all(length_gate([1, 0.9, 0.9, 0.9], p_star=0.0) == 0)


def test_zero_length_and_empty_groups():
    dr = length_rewards([1, 1, 1], [0, 0, 10], l_max=100, c=1.0, p_star=0.0, tolerance_tokens=None)
    np.testing.assert_allclose(dr, [0.5, 0.5, 0.4])
    assert length_rewards([], [], l_max=100, c=1.0, p_star=0.5).shape == (0,)


def test_length_rewards_input_errors():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        length_rewards([1, 2], [1, 1], l_max=10, c=1.0, p_star=0.0)
    with pytest.raises(ValueError, match="lengths"):
        length_rewards([1, 1], [1, -1], l_max=10, c=1.0, p_star=0.0)
    with pytest.raises(ValueError, match="lengths"):
        length_rewards([1, 1], [1], l_max=10, c=1.0, p_star=0.0)
    with pytest.raises(ValueError, match="c must"):
        length_rewards([1, 1], [1, 1], l_max=10, c=-1.0, p_star=0.0)
    with pytest.raises(ValueError, match="exceeds l_max"):
        length_rewards([1, 1], [20, 30], l_max=10, c=1.0, p_star=0.0)


def test_length_coef_linear_ramp():
    kw = dict(num_steps=5, c_start=0.1, c_end=1.0)
    assert length_coef(0, **kw) == pytest.approx(0.1)
    assert length_coef(2, **kw) == pytest.approx(0.55)
    assert length_coef(4, **kw) == pytest.approx(1.0)
    assert length_coef(40, **kw) == pytest.approx(1.0)
    assert length_coef(0, num_steps=1, c_start=0.2, c_end=1.0) == pytest.approx(0.2)
    assert length_coef(3, num_steps=10, c_start=1.0, c_end=1.0) == 1.0
    with pytest.raises(ValueError):
        length_coef(-1, **kw)
    with pytest.raises(ValueError):
        length_coef(0, num_steps=0, c_start=0.1, c_end=1.0)


def test_frontier_running_max_per_source_and_state_roundtrip():
    f = SolveRateFrontier()
    assert f.p_star("math") is None
    assert f.update("math", 0.4) == 0.4
    assert f.update("math", 0.3) == 0.4
    assert f.update("math", 0.6) == 0.6
    assert f.update("code", 0.1) == 0.1
    assert f.p_star("math") == 0.6
    state = json.loads(json.dumps(f.state_dict()))
    g = SolveRateFrontier()
    g.load_state_dict(state)
    assert g.p_star("math") == 0.6 and g.p_star("code") == 0.1 and g.p_star("rlve") is None
    with pytest.raises(ValueError, match="solve rate"):
        f.update("math", 1.5)
    with pytest.raises(ValueError, match=r"p\*"):
        g.load_state_dict({"math": -0.1})


def test_frontier_gate_uses_previous_observations_only():
    f = SolveRateFrontier()
    batch = [[1, 1, 0, 0], [1, 1, 1, 1]]
    lengths = [[10, 20, 5, 5], [10, 10, 10, 90]]
    # first batch: source unseen, gate closed for every group
    first = [length_rewards(r, l, l_max=100, c=1.0, p_star=f.p_star("math"), tolerance_tokens=None)
             for r, l in zip(batch, lengths)]
    assert all(np.all(d == 0) for d in first)
    f.update("math", float(np.mean([np.mean(r) for r in batch])))  # batch mean solve rate 0.75
    second = [length_rewards(r, l, l_max=100, c=1.0, p_star=f.p_star("math"), tolerance_tokens=None)
              for r, l in zip(batch, lengths)]
    # group 0: p = 0.5 > 0.75 - 0.1 fails -> closed; group 1: p = 1, λ = 0.5, 0.5, 0.5, 0.5 - 80/90
    assert np.all(second[0] == 0)
    np.testing.assert_allclose(second[1], [0.5, 0.5, 0.5, 0.5 - 80 / 90])
