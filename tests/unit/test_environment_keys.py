"""One environment listed twice in a stage (different options): each prompt is verified, and in SFT
demonstrated, by the instance that made it, found by the entry's key stamped on the prompt."""

import random

import pytest

from zrl.config.schema import EnvironmentSpec
from zrl.env import Environment
from zrl.pipeline.sft_stage import build_examples
from zrl.pipeline.verifier import Verifier
from zrl.prompts import PromptSource
from zrl.types import Message, Prompt


class Tagged(Environment):
    """Its verifier and demonstration depend on the instance's option, not only on the prompt."""

    name = "tagged"
    description = "answer with the instance's tag"

    def __init__(self, tag: str):
        self.tag = tag

    def sample(self, n, seed, split="train", difficulty=None):
        rng = random.Random(f"{self.tag}:{seed}:{split}")
        return [Prompt(env=self.name, prompt_id=f"{split}:{seed}:{i}", answer="", data_source=self.name,
                       messages=(Message("user", f"say your tag {rng.random():.6f}"),), payload={"made_by": self.tag})
                for i in range(n)]

    def verify(self, prompt, response):
        return float(response == self.tag)

    def demonstration(self, prompt):
        return self.tag


TAGGED = f"{__name__}:Tagged"


def specs():
    return [EnvironmentSpec(name=TAGGED, key="tag_a", options={"tag": "a"}),
            EnvironmentSpec(name=TAGGED, key="tag_b", options={"tag": "b"})]


class CharTokenizer:
    """Enough of a Hugging Face tokenizer for build_examples: one id per character."""

    eos_token = "\n"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(m["content"] for m in messages) + "|"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def get_vocab(self):
        return {}


def test_prompts_carry_the_key_of_the_entry_that_made_them():
    prompts = PromptSource(specs(), seed=0).next_prompts(64)
    keys = {p.env for p in prompts}
    assert keys == {"tag_a", "tag_b"}
    assert all(p.env == f"tag_{p.payload['made_by']}" for p in prompts)


def test_each_prompt_is_verified_by_the_instance_that_made_it():
    verifier = Verifier(specs(), timeout_s=30)
    prompts = PromptSource(specs(), seed=0).next_prompts(64)
    for p in prompts:
        made_by = p.payload["made_by"]
        other = "b" if made_by == "a" else "a"
        assert [v.reward for v in verifier.verify(p, [made_by, other])] == [1.0, 0.0], p.env


def test_sft_demonstrations_come_from_the_instance_that_made_the_prompt():
    expected = [p.payload["made_by"] for p in PromptSource(specs(), seed=3).next_prompts(32)]
    examples, skipped = build_examples(PromptSource(specs(), seed=3), CharTokenizer(), 32, max_tokens=10_000)
    assert skipped == 0 and {"a", "b"} <= set(expected)
    assert ["".join(map(chr, e.token_ids)) for e in examples] == [tag + "\n" for tag in expected]


def test_without_keys_the_entries_are_named_by_the_environment():
    # Without explicit keys, a stage of distinct environments keeps the environment's name (metric names).
    source = PromptSource([EnvironmentSpec(name=TAGGED, options={"tag": "a"}),
                           EnvironmentSpec(name="strings", options={"tasks": "copy"})], seed=0)
    assert [e.key for e in source.entries] == ["tagged", "strings"]
    # A clash the recipe schema cannot see (the first key is the class's name, known once it is loaded).
    with pytest.raises(ValueError, match=r"environments \['tagged'\] are listed more than once"):
        PromptSource([EnvironmentSpec(name=TAGGED, options={"tag": "a"}),
                      EnvironmentSpec(name=f"{__name__}:Tagged", key="tagged", options={"tag": "b"})], seed=0)
