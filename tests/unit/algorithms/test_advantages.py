"""Group advantages: hand-computed values, edge cases, and sum-to-zero properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zrl.algorithms.advantages import (
    ADVANTAGE_NAMES,
    compute_advantages,
    drgrpo_advantages,
    filter_zero_variance_groups,
    grpo_advantages,
    maxrl_advantages,
)


# --- MaxRL ---------------------------------------------------------------------------------------

def test_maxrl_one_of_four_correct():
    # rbar = 1/4: correct -> (1 - 1/4) / (1/4) = 3 = (1-p)/p, incorrect -> -1.
    np.testing.assert_allclose(maxrl_advantages([1, 0, 0, 0]), [3.0, -1.0, -1.0, -1.0])


def test_maxrl_three_of_four_correct():
    # rbar = 3/4: correct -> (1/4)/(3/4) = 1/3, incorrect -> -1.
    np.testing.assert_allclose(maxrl_advantages([1, 1, 0, 1]), [1 / 3, 1 / 3, -1.0, 1 / 3])


@pytest.mark.parametrize("rewards", [[0, 0, 0, 0], [1, 1, 1, 1], [0.5, 0.5, 0.5], [0.1] * 7])
def test_maxrl_zero_variance_is_exactly_zero(rewards):
    a = maxrl_advantages(rewards)
    assert a.shape == (len(rewards),)
    assert np.all(a == 0.0)  # exact: no (0.1 - mean) rounding noise, no 0/0


@pytest.mark.parametrize("reward", [0.0, 1.0, 0.3])
def test_maxrl_group_of_one_is_zero_not_huge(reward):
    # The public (r - rbar) / (rbar + 1e-6) form is the reason for this test: a lone success must not
    # get a large advantage.
    assert maxrl_advantages([reward]).tolist() == [0.0]


def test_maxrl_empty_group():
    assert maxrl_advantages([]).shape == (0,)


def test_maxrl_continuous_rewards_in_range():
    # rbar = 0.2: (0.5 - 0.2)/0.2 = 1.5, (0.1 - 0.2)/0.2 = -0.5, (0 - 0.2)/0.2 = -1.
    np.testing.assert_allclose(maxrl_advantages([0.5, 0.1, 0.0]), [1.5, -0.5, -1.0])


def test_maxrl_bounded_by_group_size_for_tiny_mean():
    # One tiny positive reward: A = G - 1 for it, -1 for the rest (bound |A| <= G - 1).
    g = 16
    r = np.zeros(g)
    r[3] = 1e-3
    a = maxrl_advantages(r)
    assert a[3] == pytest.approx(g - 1)
    np.testing.assert_allclose(np.delete(a, 3), -1.0)


def test_maxrl_mean_below_floor_is_zero():
    assert np.all(maxrl_advantages([1e-9, 0.0, 0.0]) == 0.0)


@pytest.mark.parametrize("bad", [[1.5, 0.0], [-0.1, 1.0], [np.nan, 1.0], [np.inf, 0.0]])
def test_maxrl_rejects_out_of_range_or_non_finite(bad):
    with pytest.raises(ValueError, match="rewards"):
        maxrl_advantages(bad)


def test_maxrl_rejects_2d():
    with pytest.raises(ValueError, match="1-D"):
        maxrl_advantages([[1, 0]])


def test_maxrl_length_bonus_numerator_only():
    # rewards [1, 1, 0, 0], rbar = 0.5; bonus [0.1, -0.05, 0, 0]:
    # (1 + 0.1 - 0.5)/0.5 = 1.2, (1 - 0.05 - 0.5)/0.5 = 0.9, (0 - 0.5)/0.5 = -1.
    a = maxrl_advantages([1, 1, 0, 0], [0.1, -0.05, 0.0, 0.0])
    np.testing.assert_allclose(a, [1.2, 0.9, -1.0, -1.0])


def test_maxrl_all_correct_with_bonus_is_pure_length_signal():
    # rbar = 1 -> A_i = Δr_i.
    bonus = [0.25, -0.1, 0.0, 0.5]
    np.testing.assert_allclose(maxrl_advantages([1, 1, 1, 1], bonus), bonus)


def test_maxrl_bonus_in_all_wrong_group_is_an_error():
    with pytest.raises(ValueError, match="length bonus"):
        maxrl_advantages([0, 0, 0], [0.1, 0.0, 0.0])


def test_maxrl_bonus_length_mismatch():
    with pytest.raises(ValueError, match="entries"):
        maxrl_advantages([1, 0], [0.1])


# --- GRPO / Dr-GRPO --------------------------------------------------------------------------------

def test_grpo_hand_values():
    # mean 1/4, population std sqrt(1/4 · 3/4) = 0.4330127: 0.75/0.4330127 = 1.7320508, -0.25/.. = -0.5773503
    a = grpo_advantages([1, 0, 0, 0])
    np.testing.assert_allclose(a, [1.7320508, -0.5773503, -0.5773503, -0.5773503], rtol=1e-5)


def test_grpo_ties_and_continuous():
    # [0.2, 0.2, 0.8]: mean 0.4, std sqrt((0.04 + 0.04 + 0.16)/3) = 0.2828427
    a = grpo_advantages([0.2, 0.2, 0.8])
    np.testing.assert_allclose(a, [-0.7071068, -0.7071068, 1.4142136], rtol=1e-5)
    assert a[0] == a[1]


@pytest.mark.parametrize("rewards", [[1, 1, 1], [0, 0], [0.7], []])
def test_grpo_zero_std_is_zero(rewards):
    assert np.all(grpo_advantages(rewards) == 0.0)


def test_drgrpo_hand_values():
    np.testing.assert_allclose(drgrpo_advantages([1, 0, 0, 1, 1]), [0.4, -0.6, -0.6, 0.4, 0.4])
    np.testing.assert_allclose(drgrpo_advantages([1, 0], [0.2, 0.0]), [0.7, -0.5])
    assert drgrpo_advantages([1]).tolist() == [0.0]


def test_drgrpo_accepts_any_finite_reward():
    np.testing.assert_allclose(drgrpo_advantages([-2.0, 4.0]), [-3.0, 3.0])


# --- dispatch ----------------------------------------------------------------------------------------

def test_dispatch_names_match_recipe_schema():
    assert ADVANTAGE_NAMES == ("maxrl", "grpo", "drgrpo")
    r = [1, 0, 0, 0]
    np.testing.assert_allclose(compute_advantages("maxrl", r), maxrl_advantages(r))
    np.testing.assert_allclose(compute_advantages("grpo", r), grpo_advantages(r))
    np.testing.assert_allclose(compute_advantages("drgrpo", r, [0.1, 0, 0, 0]), drgrpo_advantages(r, [0.1, 0, 0, 0]))


def test_dispatch_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="maxrl"):
        compute_advantages("ppo", [1, 0])


def test_grpo_rejects_length_bonus():
    with pytest.raises(ValueError, match="length bonus"):
        compute_advantages("grpo", [1, 1], [0.1, 0.0])
    # an all-zero bonus is the same as none
    np.testing.assert_allclose(compute_advantages("grpo", [1, 0], [0.0, 0.0]), grpo_advantages([1, 0]))


# --- dynamic sampling -------------------------------------------------------------------------------

def test_filter_drops_zero_variance_and_empty_groups():
    groups = [[1, 0, 1], [0, 0, 0], [1, 1, 1], [1], [], [0.3, 0.3], [0.2, 0.9]]
    res = filter_zero_variance_groups(groups)
    assert res.kept == (0, 6)
    assert res.num_dropped == 5
    assert res.num_kept_for_length == 0


def test_filter_keeps_all_correct_group_with_length_signal():
    groups = [[1, 1, 1], [1, 1, 1], [0, 0, 0], [1, 0, 0]]
    bonuses = [[0.1, -0.2, 0.0], [0.0, 0.0, 0.0], None, [0.0, 0.0, 0.0]]
    res = filter_zero_variance_groups(groups, bonuses)
    assert res.kept == (0, 3)
    assert res.num_dropped == 2
    assert res.num_kept_for_length == 1


def test_filter_drops_exactly_the_groups_with_all_zero_advantages():
    groups = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    bonuses = [[0.1, 0.1, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    res = filter_zero_variance_groups(groups, bonuses)
    nonzero = [g for g in range(4) if np.any(maxrl_advantages(groups[g], bonuses[g]) != 0)]
    assert list(res.kept) == nonzero == [0, 1]


def test_filter_length_mismatch():
    with pytest.raises(ValueError, match="length bonuses"):
        filter_zero_variance_groups([[1, 0]], [])


# --- properties ---------------------------------------------------------------------------------------

binary_groups = st.lists(st.integers(0, 1), min_size=1, max_size=32)
unit_groups = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=32)


@settings(max_examples=60, deadline=None)
@given(binary_groups)
def test_property_maxrl_binary_sums_to_zero_and_matches_closed_form(rewards):
    a = maxrl_advantages(rewards)
    assert abs(a.sum()) <= 1e-9 * len(rewards)
    k, g = sum(rewards), len(rewards)
    if 0 < k < g:
        p = k / g
        expected = [(1 - p) / p if r else -1.0 for r in rewards]
        np.testing.assert_allclose(a, expected, rtol=1e-12)
    else:
        assert np.all(a == 0.0)


@settings(max_examples=60, deadline=None)
@given(unit_groups)
def test_property_maxrl_continuous_sums_to_zero_and_is_bounded(rewards):
    a = maxrl_advantages(rewards)
    g = len(rewards)
    # float64 sum of G values of magnitude <= G: error well under 1e-9 · G
    assert abs(a.sum()) <= 1e-9 * g
    assert np.all(np.abs(a) <= g - 1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-100.0, 100.0, allow_nan=False), min_size=1, max_size=32))
def test_property_drgrpo_sums_to_zero(rewards):
    assert abs(drgrpo_advantages(rewards).sum()) <= 1e-9 * 100 * len(rewards)
