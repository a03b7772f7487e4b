"""safe_verify: whatever a verifier returns or raises, the result is a Verification with a float reward;
anything that is not a reward in range becomes reward 0 with an error saying what came back."""

import math

import numpy as np
import pytest

from zrl.env.base import Environment, safe_verify
from zrl.types import Message, Prompt, Verification

PROMPT = Prompt(env="returns", prompt_id="p", messages=(Message("user", "q"),), answer="", data_source="returns")


class Returns(Environment):
    """Its verifier returns whatever the test put in `result` (or raises it, when it is an exception)."""

    name = "returns"
    reward_type = "continuous"

    def __init__(self, result, reward_type="continuous"):
        self.result = result
        self.reward_type = reward_type

    def sample(self, n, seed, split="train", difficulty=None):
        return []

    def verify(self, prompt, response):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def verified(result, reward_type="continuous") -> Verification:
    return safe_verify(Returns(result, reward_type), PROMPT, "response")


@pytest.mark.parametrize("result, error", [
    ("yes", "verify returned 'yes' (str), not a number"),
    ("1.0", "verify returned '1.0' (str), not a number"),  # float() would parse it; a string is no reward
    (None, "verify returned None (NoneType), not a number"),
    ([1.0], "verify returned [1.0] (list), not a number"),
    (np.array([0.0, 1.0]), "verify returned array([0., 1.]) (ndarray), not a number"),
    (Verification(reward="yes"), "verify returned a Verification with reward 'yes' (str), not a number"),
    (Verification(reward=None), "verify returned a Verification with reward None (NoneType), not a number"),
    (math.nan, "reward nan outside [0, 1]"),
    (math.inf, "reward inf outside [0, 1]"),
    (-math.inf, "reward -inf outside [0, 1]"),
    (Verification(reward=math.nan), "reward nan outside [0, 1]"),
    (1.5, "reward 1.5 outside [0, 1]"),
    (ValueError("bad response"), "ValueError: bad response"),
])
def test_what_is_not_a_reward_costs_one_reward_with_the_reason(result, error):
    assert verified(result) == Verification(reward=0.0, error=error)


@pytest.mark.parametrize("result, reward", [
    (True, 1.0), (False, 0.0),             # a binary verifier may return `response == answer`
    (1, 1.0), (np.float32(0.25), 0.25), (np.True_, 1.0), (np.array(0.5), 0.5),
])
def test_numbers_become_plain_float_rewards(result, reward):
    out = verified(result)
    assert out == Verification(reward=reward) and type(out.reward) is float


def test_a_verification_keeps_its_metadata_with_a_float_reward():
    out = verified(Verification(reward=np.float64(1.0), metadata={"parsed": "42"}))
    assert out == Verification(reward=1.0, metadata={"parsed": "42"}) and type(out.reward) is float


def test_binary_environments_take_booleans_and_reject_fractions():
    assert verified(True, reward_type="binary") == Verification(reward=1.0)
    assert verified(0.5, reward_type="binary") == Verification(reward=0.0,
                                                               error="binary environment returned reward 0.5")


class GroupReturns(Returns):
    """verify_group returns (or raises) whatever the test put in `result`."""

    def verify_group(self, prompt, responses):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_safe_verify_group_checks_each_result_like_safe_verify():
    from zrl.env.base import safe_verify_group, verifies_groups

    env = GroupReturns([0.25, Verification(reward=2.0), "x", Verification(reward=1, metadata={"reason": "ok"})])
    assert verifies_groups(env) and not verifies_groups(Returns(0.5))
    out = safe_verify_group(env, PROMPT, ["a", "b", "c", "d"])
    assert [(v.reward, v.error) for v in out] == [
        (0.25, None), (0.0, "reward 2.0 outside [0, 1]"), (0.0, "verify returned 'x' (str), not a number"),
        (1.0, None)]
    assert out[3].metadata == {"reason": "ok"}


@pytest.mark.parametrize("result, error", [
    (RuntimeError("reward model actor died"), "RuntimeError: reward model actor died"),
    ([0.5], "verify_group returned 1 results for 2 responses"),
    (None, "TypeError: 'NoneType' object is not iterable"),
])
def test_a_failing_group_call_costs_the_group_its_rewards(result, error):
    from zrl.env.base import safe_verify_group

    assert [(v.reward, v.error) for v in safe_verify_group(GroupReturns(result), PROMPT, ["a", "b"])] == \
        [(0.0, error)] * 2
