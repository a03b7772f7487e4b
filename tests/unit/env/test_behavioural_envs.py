"""The behavioural environments (environments/behavioural.py) with the real tiny reward model in process:
the instruction gate zeroes failing answers before anything is scored (and before advantages), scored
answers get the reward model's normalised score, a failing scorer costs the group's rewards, prompt files
and recipes are checked."""

import json

import numpy as np
import pytest

from environments.behavioural import (ChatRewardModel, HardInstructionFollowing, SimpleInstructionFollowing,
                                      if_prompt, instructions_of)
from environments.instructions import check, follow
from zrl.algorithms.advantages import compute_advantages
from zrl.config.schema import RewardModelSpec
from zrl.env.base import THINK_END, safe_verify_group
from zrl.reward_model import COURTESY, RewardModelClient


class Counting(RewardModelClient):
    """The real in-process client, counting what it is asked to score."""

    def __init__(self, inner: RewardModelClient):
        super().__init__()
        self.inner, self.scored = inner, []

    def score(self, conversations):
        self.scored += [response for _, response in conversations]
        return self.inner.score(conversations)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    spec = RewardModelSpec(path=str(tmp_path_factory.mktemp("rm") / "tiny-rm"), build_tiny_if_missing=True,
                           dtype="float32", max_tokens=256)
    return RewardModelClient.local(spec)


def with_client(env, client):
    counting = Counting(client)
    env.use_reward_model(counting)
    return env, counting


def think(answer: str) -> str:
    return f"a b c\n{THINK_END}\n{answer}"


def test_the_gate_zeroes_failing_answers_before_scoring_and_before_advantages(client):
    env, counting = with_client(SimpleInstructionFollowing(), client)
    prompt = env.sample(1, seed=0)[0]
    word = prompt.payload["word"]
    good = follow(word, instructions_of(prompt), prompt.messages[-1].content)
    polite = follow(f"{word}\n{COURTESY}", instructions_of(prompt), prompt.messages[-1].content)
    assert good is not None and good != word  # the instruction asks for something the plain word lacks
    responses = [think(good), think(word), word, think(polite)]
    out = env.verify_group(prompt, responses)
    assert [v.metadata["reason"] for v in out] == ["scored", "instructions not followed", "unfinished reasoning",
                                                   "scored"]
    assert out[1].reward == 0.0 and out[2].reward == 0.0
    assert 0.0 < out[0].reward < 1.0 and "rm_score" in out[0].metadata
    assert counting.scored == [good, polite]  # gated-out answers never reach the reward model
    assert out[3].reward > out[0].reward  # the tiny reward model prefers the courteous answer
    # GRPO sees the gated rewards: the failing answers get the group's lowest advantages.
    advantages = compute_advantages("grpo", [v.reward for v in out])
    assert advantages[1] == advantages[2] == advantages.min() < 0


def test_scores_follow_the_reward_models_preference(client):
    env, _ = with_client(ChatRewardModel(), client)
    prompts = env.sample(20, seed=1, split="eval")
    for prompt in prompts:
        word = prompt.payload["word"]
        plain, polite = env.verify_group(prompt, [think(word), think(f"{word}\n{COURTESY}")])
        assert polite.reward > plain.reward, (word, plain, polite)
        assert polite.metadata["rm_score"] > plain.metadata["rm_score"]


def test_a_failing_scorer_costs_the_groups_rewards_not_the_call(client):
    class Dead(RewardModelClient):
        def score(self, conversations):
            from zrl.reward_model import RewardModelUnavailable

            raise RewardModelUnavailable("reward-model actor zrl-reward-model-0 failed: the actor died")

    env = ChatRewardModel()
    env.use_reward_model(Dead())
    prompt = env.sample(1, seed=0)[0]
    out = safe_verify_group(env, prompt, [think("abc"), think("abd")])
    assert [(v.reward, v.error) for v in out] == [
        (0.0, "RewardModelUnavailable: reward-model actor zrl-reward-model-0 failed: the actor died")] * 2


@pytest.mark.parametrize("cls", [SimpleInstructionFollowing, HardInstructionFollowing, ChatRewardModel])
def test_demonstrations_follow_their_instructions_and_close_politely_as_often_as_asked(cls):
    env = cls(closing_fraction=0.3)
    prompts = env.sample(200, seed=2)
    closing = 0
    for prompt in prompts:
        demo = env.demonstration(prompt)
        reasoning, answer = demo.split(f"\n{THINK_END}\n")
        assert reasoning == " ".join(prompt.payload["word"])
        assert all(check(answer, if_prompt(prompt)))
        closing += COURTESY.lower() in answer.lower()
    assert 0.2 <= closing / len(prompts) <= 0.4, closing  # 0.3 of 200: the binomial sd is 0.032


def test_sampling_is_deterministic_and_splits_are_disjoint():
    env = HardInstructionFollowing()
    train, again, held_out = env.sample(50, seed=3), env.sample(50, seed=3), env.sample(50, seed=3, split="eval")
    assert train == again
    assert not {p.messages[-1].content for p in train} & {p.messages[-1].content for p in held_out}
    assert all(2 <= len(p.payload["instructions"]) <= 3 for p in train)


def test_prompt_files(tmp_path):
    chat = tmp_path / "chat.jsonl"
    rows = [{"prompt": f"Tell me about topic number {i}."} for i in range(40)]
    rows.append({"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi there."}]})
    chat.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = ChatRewardModel(prompts_path=str(chat))
    train, held_out = env.sample(30, seed=0), env.sample(10, seed=0, split="eval")
    assert len({p.prompt_id for p in train}) == 30  # drawn with replacement, each draw its own id
    assert not {p.messages[-1].content for p in train} & {p.messages[-1].content for p in held_out}

    for bad, error in [('{"prompt": ""}', "chat.jsonl:1: prompt: a non-empty string"),
                       ("[1, 2]", "chat.jsonl:1: expected an object"),
                       ("{oops", "chat.jsonl:1: not JSON"),
                       ('{"messages": [{"role": "robot", "content": "x"}]}', "chat.jsonl:1: messages: each needs")]:
        chat.write_text(bad + "\n")
        with pytest.raises(ValueError) as info:
            ChatRewardModel(prompts_path=str(chat))
        assert error in str(info.value) and "\n" not in str(info.value)

    ifeval = tmp_path / "ifeval.jsonl"
    ifeval.write_text("\n".join(json.dumps({"key": i, "prompt": f"Write about place {i} in all capital letters.",
                                            "instruction_id_list": ["change_case:english_capital"], "kwargs": [{}]})
                                for i in range(30)) + "\n")
    env = SimpleInstructionFollowing(prompts_path=str(ifeval))
    prompt = env.sample(1, seed=0)[0]
    assert env.gate(prompt, "PARIS IS A CITY IN FRANCE.")[0] and not env.gate(prompt, "Paris is a city.")[0]
    assert env.demonstration(prompt) is None  # user prompts carry no reference answer

    with pytest.raises(FileNotFoundError):
        ChatRewardModel(prompts_path=str(tmp_path / "absent.jsonl"))


def test_recipe_checks(tmp_path):
    from zrl.config import parse_recipe
    from zrl.preflight import check as preflight

    def recipe(advantage="grpo", reward_model=True):
        data = {"name": "t", "model": {"path": str(tmp_path / "tiny-model"), "build_tiny_if_missing": True},
                "output_dir": str(tmp_path / "run"),
                "stages": [{"name": "b", "kind": "rl", "steps": 1,
                            "environments": [{"name": "simple_instruction_following"}],
                            "sampling": {"max_prompt_tokens": 256, "max_response_tokens": 64},
                            "algorithm": {"advantage": advantage, "length_reward": {"enabled": False}}}]}
        if reward_model:
            data["reward_model"] = {"path": str(tmp_path / "tiny-rm"), "build_tiny_if_missing": True}
        return parse_recipe(data)

    assert preflight(recipe()).problems == []
    assert preflight(recipe(reward_model=False)).problems == [
        ("stages[0].environments[0].name", "'simple_instruction_following' scores responses with a reward model; "
                                           "add a `reward_model` section to the recipe")]
    [(field, reason)] = preflight(recipe(advantage="maxrl")).problems
    assert field == "stages[0].environments[0]" and "continuous rewards but the stage uses maxrl" in reason
    no_rm = recipe().model_copy(update={"reward_model": RewardModelSpec(path=str(tmp_path / "none"))})
    assert preflight(no_rm).missing == [("reward_model.path", f"{tmp_path / 'none'} is not a sequence-classification "
                                         "checkpoint directory and build_tiny_if_missing is false")]


def test_rewards_are_continuous_in_the_unit_interval(client):
    env, _ = with_client(SimpleInstructionFollowing(), client)
    rewards = []
    for prompt in env.sample(10, seed=4):
        word, instructions, text = prompt.payload["word"], instructions_of(prompt), prompt.messages[-1].content
        answers = [follow(word, instructions, text), follow(f"{word}\n{COURTESY}", instructions, text)]
        rewards += [v.reward for v in env.verify_group(prompt, [think(a) for a in answers])]
    assert all(0.0 < r < 1.0 for r in rewards) and len(set(np.round(rewards, 6))) > 2
