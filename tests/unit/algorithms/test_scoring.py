"""`score_group` (validate once, score one group) against the separate calls the buffer made before."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zrl.algorithms import compute_advantages, filter_zero_variance_groups, length_rewards, score_group

L_MAX = 1000


def separate(rewards, lengths, *, advantage, dynamic_sampling, c, p_star, tolerance_tokens=200):
    """The per-function path: Δr, then the filter, then the estimator (the buffer's order)."""
    if c is None:
        bonus = np.zeros(len(rewards))
    else:
        bonus = length_rewards(rewards, lengths, l_max=L_MAX, c=c, p_star=p_star, tolerance_tokens=tolerance_tokens)
    kept = filter_zero_variance_groups([rewards], [bonus])
    signal = "none" if kept.num_dropped else "length" if kept.num_kept_for_length else "task"
    if dynamic_sampling and kept.num_dropped:
        return bonus, signal, None
    return bonus, signal, compute_advantages(advantage, rewards, None if c is None else bonus)


def assert_same(rewards, lengths, **kw):
    got = score_group(rewards, lengths, l_max=L_MAX, **kw)
    want = separate(rewards, lengths, **kw)
    assert got.signal == want[1]
    assert got.length_bonus.tobytes() == want[0].tobytes()  # bit for bit, signs of zeros included
    assert (got.advantages is None) == (want[2] is None)
    if want[2] is not None:
        assert got.advantages.tobytes() == want[2].tobytes()


groups = st.integers(1, 20).flatmap(lambda g: st.tuples(
    st.lists(st.sampled_from([0.0, 1.0, 0.25, 0.5]), min_size=g, max_size=g),
    st.lists(st.integers(0, L_MAX), min_size=g, max_size=g)))


@settings(max_examples=300, deadline=None)
@given(groups, st.sampled_from(["maxrl", "drgrpo"]), st.booleans(), st.sampled_from([None, 0.0, 0.5, 1.0]),
       st.sampled_from([None, 0.0, 0.5, 0.95]), st.sampled_from([None, 0, 200]))
def test_same_as_separate_calls(group, advantage, dynamic_sampling, c, p_star, tolerance_tokens):
    rewards, lengths = group
    assert_same(rewards, lengths, advantage=advantage, dynamic_sampling=dynamic_sampling, c=c, p_star=p_star,
                tolerance_tokens=tolerance_tokens)


@pytest.mark.parametrize("rewards", [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0.3, 0.3], [-2.0, 4.0], [1]])
@pytest.mark.parametrize("dynamic_sampling", [True, False])
def test_grpo_and_no_length_reward(rewards, dynamic_sampling):
    for advantage in ("grpo", "drgrpo"):
        assert_same(rewards, [5] * len(rewards), advantage=advantage, dynamic_sampling=dynamic_sampling,
                    c=None, p_star=None)


def test_edge_cases():
    # All correct with an open gate: kept for the length signal alone (A_i = Δr_i under MaxRL).
    s = score_group([1, 1, 1, 1], [100, 300, 900, 100], advantage="maxrl", dynamic_sampling=True, c=1.0,
                    l_max=L_MAX, p_star=0.5)
    assert s.signal == "length" and s.advantages is not None and s.advantages.tolist() == s.length_bonus.tolist()
    # All wrong: dropped, no advantages computed; without dynamic sampling they are exact zeros.
    s = score_group([0, 0, 0], [1, 2, 3], advantage="maxrl", dynamic_sampling=True, c=1.0, l_max=L_MAX, p_star=0.5)
    assert s.signal == "none" and s.advantages is None
    s = score_group([0, 0, 0], [1, 2, 3], advantage="maxrl", dynamic_sampling=False, c=None, l_max=L_MAX, p_star=None)
    assert s.advantages.tolist() == [0.0, 0.0, 0.0]
    # Empty group: dropped by the filter, an empty array otherwise.
    s = score_group([], [], advantage="maxrl", dynamic_sampling=False, c=0.5, l_max=L_MAX, p_star=0.5)
    assert s.signal == "none" and s.advantages.shape == (0,)


@pytest.mark.parametrize("rewards, lengths, kw, match", [
    ([1.5, 0], [1, 2], dict(c=0.5), r"length reward needs task rewards in \[0, 1\]"),
    ([1.5, 0], [1, 2], dict(c=None), r"MaxRL .* needs rewards in \[0, 1\]"),
    ([np.nan, 0], [1, 2], dict(c=None), "rewards must be finite"),
    ([np.nan, 0], [1, 2], dict(c=0.5), r"\[0, 1\]"),
    ([1, 0], [1, np.nan], dict(c=0.5), "lengths must be finite"),
    ([1, 0], [1, -2], dict(c=0.5), "lengths must be finite and >= 0"),
    ([1, 0], [1, 2, 3], dict(c=0.5), "lengths must be 1-D with 2 entries"),
    ([[1, 0]], [1, 2], dict(c=None), "rewards must be 1-D"),
    ([1, 0], [1, 2], dict(c=-0.1), "c must be >= 0"),
    ([1, 1, 0], [1, 2, 3], dict(c=0.5, advantage="grpo", p_star=0.0), "does not take a length bonus"),
    ([1, 0], [1, 2], dict(c=None, advantage="ppo"), "unknown advantage estimator"),
])
def test_errors_are_the_separate_calls_errors(rewards, lengths, kw, match):
    kw = dict(dict(advantage="maxrl", dynamic_sampling=True, l_max=L_MAX, p_star=None), **kw)
    with pytest.raises(ValueError, match=match):
        score_group(rewards, lengths, **kw)
