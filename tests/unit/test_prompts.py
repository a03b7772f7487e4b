"""Prompt source: weighted environment mixture, deterministic stream, resumable from its counter."""

import collections

import pytest

from zrl.config.schema import EnvironmentSpec
from zrl.env import Environment
from zrl.env.base import EnvironmentFault
from zrl.prompts import PromptSource
from zrl.types import Message, Prompt


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
    with pytest.raises(ValueError, match="'arithmetic' rejected options {'colour': 1}: TypeError"):
        PromptSource([EnvironmentSpec(name="arithmetic", options={"colour": 1})], seed=0)


class Broken(Environment):
    """Its `sample` misbehaves in the way its `fault` option names."""

    name = "broken"

    def __init__(self, fault: str):
        self.fault = fault

    def sample(self, n, seed, split="train", difficulty=None):
        good = [Prompt(env=self.name, prompt_id=f"{seed}:{i}", messages=(Message("user", "q"),), answer="",
                       data_source=self.name) for i in range(n)]
        return {"raises": lambda: 1 / 0, "fewer": lambda: good[:-1], "none": lambda: [], "more": lambda: good * 2,
                "nothing": lambda: None, "dicts": lambda: good[:1] + [{"q": 1}] * (n - 1)}[self.fault]()

    def verify(self, prompt, response):
        return 0.0


@pytest.mark.parametrize("fault, what", [
    ("raises", r"raised ZeroDivisionError: division by zero"),
    ("fewer", r"returned 2 prompts"),
    ("none", r"returned 0 prompts"),
    ("more", r"returned 6 prompts"),
    ("nothing", r"returned None \(NoneType\), not a list of prompts"),
    ("dicts", r"returned {'q': 1} \(dict\) at index 1, not a zrl.types.Prompt"),
])
def test_a_misbehaving_sample_is_one_environment_fault_naming_the_entry(fault, what):
    source = PromptSource([EnvironmentSpec(name=f"{__name__}:Broken", key="bad", options={"fault": fault})], seed=0)
    with pytest.raises(EnvironmentFault, match=rf"^environment 'bad': sample\(3, seed=\d+\) {what}$"):
        source.next_prompts(3)
    assert source.state_dict()["draws"] == 0  # the failed draw is not counted


def test_a_fixed_difficulty_reaches_the_environment():
    easy = PromptSource([EnvironmentSpec(name="strings", options={"tasks": "copy", "min_letters": 3, "max_letters": 3})],
                        seed=0).next_prompts(8)
    hard = PromptSource([EnvironmentSpec(name="strings", options={"tasks": "copy", "min_letters": 3, "max_letters": 3},
                                         difficulty=2)], seed=0).next_prompts(8)
    assert {len(p.answer) for p in easy} == {3}
    assert {len(p.answer) for p in hard} == {7}  # +2 letters per level
    assert {p.difficulty for p in hard} == {2}


def test_an_adaptive_entry_is_drawn_at_the_level_handed_to_the_draw():
    copy = {"tasks": "copy", "min_letters": 3, "max_letters": 3}
    specs = [EnvironmentSpec(name="strings", key="adaptive", options=copy, difficulty="adaptive"),
             EnvironmentSpec(name="strings", key="fixed", options=copy, difficulty=1)]
    prompts = PromptSource(specs, seed=0).next_prompts(32, levels={"adaptive": 3, "fixed": 9})
    by_key = collections.defaultdict(set)
    for p in prompts:
        by_key[p.env].add((len(p.answer), p.difficulty))
    assert by_key["adaptive"] == {(9, 3)}   # 3 + 2 x 3 letters, the level stamped
    assert by_key["fixed"] == {(5, 1)}      # a fixed level ignores what the curriculum hands out
    unlevelled = PromptSource(specs[:1], seed=0).next_prompts(4)
    assert {len(p.answer) for p in unlevelled} == {3}  # no level handed: the environment's default
