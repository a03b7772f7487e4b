"""Prompt source: weighted environment mixture, deterministic stream, resumable from its counter."""

import collections

import pytest

from zrl.config.schema import EnvironmentSpec
from zrl.prompts import PromptSource


def source(seed=0):
    specs = [EnvironmentSpec(name="arithmetic", weight=3.0, options={"max_operand": 9}),
             EnvironmentSpec(name="math", weight=1.0)]
    return PromptSource(specs, seed=seed)


def test_stream_is_deterministic_and_resumable():
    a, b = source(), source()
    first = [p.prompt_id for p in a.next_prompts(16)]
    assert first == [p.prompt_id for p in b.next_prompts(16)]
    second = a.next_prompts(16)
    resumed = source()
    resumed.load_state_dict(a.state_dict() | {"draws": 1})
    assert [p.prompt_id for p in resumed.next_prompts(16)] == [p.prompt_id for p in second]
    assert [p.messages for p in second] != [p.messages for p in a.next_prompts(16)]
    with pytest.raises(ValueError, match="seed 0, this stage uses 1"):
        source(seed=1).load_state_dict(a.state_dict())


def test_mixture_follows_the_weights():
    counts = collections.Counter(p.env for p in source().next_prompts(2000))
    assert counts["arithmetic"] / 2000 == pytest.approx(0.75, abs=0.03)


def test_bad_options_name_the_environment():
    with pytest.raises(ValueError, match="environment 'arithmetic': bad options {'colour': 1}"):
        PromptSource([EnvironmentSpec(name="arithmetic", options={"colour": 1})], seed=0)
