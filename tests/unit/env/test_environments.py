"""The plugin base class and the built-in environments, exercised as the pipeline will use them."""

import pytest

from environments.arithmetic import Arithmetic
from environments.math_verify_env import MathVerify
from environments.reasoning_gym_env import ReasoningGym
from zrl.env.base import Environment, extract_answer, in_split, safe_verify
from zrl.types import Message, Prompt, Verification


@pytest.mark.parametrize("response, answer", [
    ("12 + 7 = 19\n</think>\n19", "19"),
    ("no reasoning section 42", "no reasoning section 42"),
    ("a</think>b</think> final \\boxed{\\frac{1}{2}} ", "\\frac{1}{2}"),
    ("</think>\n\\boxed{3} then \\boxed{4}", "4"),
    ("", ""),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_split_is_a_deterministic_partition():
    keys = [f"problem {i}" for i in range(2000)]
    evals = [k for k in keys if in_split(k, "eval")]
    assert all(not in_split(k, "train") for k in evals)
    assert 0.15 < len(evals) / len(keys) < 0.25


class Flaky(Environment):
    name = "flaky"
    reward_type = "binary"

    def sample(self, n, seed, split="train", difficulty=None):
        return []

    def verify(self, prompt, response):
        if response == "crash":
            raise RuntimeError("verifier bug")
        return {"half": 0.5, "big": 2.0}.get(response, 1.0)


PROMPT = Prompt(env="flaky", prompt_id="p", messages=(Message("user", "q"),), answer="", data_source="flaky")


def test_safe_verify_costs_one_reward_not_the_run():
    assert safe_verify(Flaky(), PROMPT, "ok") == Verification(reward=1.0)
    crashed = safe_verify(Flaky(), PROMPT, "crash")
    assert crashed.reward == 0.0 and crashed.error == "RuntimeError: verifier bug"
    assert safe_verify(Flaky(), PROMPT, "big").error == "reward 2.0 outside [0, 1]"
    assert safe_verify(Flaky(), PROMPT, "half").error == "binary environment returned reward 0.5"


def test_arithmetic_prompts_verify_and_demonstrations():
    env = Arithmetic(max_operand=20)
    train = env.sample(64, seed=3)
    assert train == env.sample(64, seed=3) and train != env.sample(64, seed=4)
    evals = env.sample(200, seed=0, split="eval")
    assert not {p.payload["expression"] for p in train} & {p.payload["expression"] for p in evals}
    for prompt in train[:10]:
        demo = env.demonstration(prompt)
        assert env.verify(prompt, demo) == 1.0
        assert env.verify(prompt, demo + "1") == 0.0
        assert env.verify(prompt, prompt.answer) == 1.0  # no reasoning section: the whole text is the answer
    p = Prompt(env="arithmetic", prompt_id="x", messages=(Message("user", "What is 3 - 5?"),), answer="-2",
               data_source="arithmetic:-", payload={"expression": "3 - 5"})
    assert env.demonstration(p) == "3 - 5 = -2\n</think>\n-2"
    big = env.sample(50, seed=1, difficulty=3.0)
    assert max(int(x) for p in big for x in p.payload["expression"].split()[::2]) > 20
    with pytest.raises(ValueError, match="ops must be"):
        Arithmetic(ops="/")
    with pytest.raises(ValueError, match="too few eval problems"):
        Arithmetic(max_operand=1, ops="+").sample(10, seed=0, split="eval")


def test_reasoning_gym_scores_with_its_own_scorer():
    env = ReasoningGym(tasks={"chain_sum": {"min_terms": 2, "max_terms": 2}, "basic_arithmetic": {}})
    prompts = env.sample(6, seed=5)
    assert [p.payload["task"] for p in prompts] == ["chain_sum", "basic_arithmetic"] * 3  # from the seed's task on
    for prompt in prompts:
        assert env.verify(prompt, f"thinking...</think>{prompt.answer}") == 1.0
        assert env.verify(prompt, "</think>not a number") == 0.0
    evals = env.sample(6, seed=5, split="eval")
    assert all(in_split(p.payload["entry"]["question"], "eval") for p in evals)
    with pytest.raises(ValueError, match="unknown reasoning-gym tasks"):
        ReasoningGym(tasks=["no_such_task"])


def test_reasoning_gym_draws_of_one_prompt_visit_every_task_and_always_find_one():
    """A mixture draws one prompt of an entry at a time: every draw gives a problem of the split (its first
    generated problem is held out one time in five), and the tasks take turns across seeds."""
    env = ReasoningGym(tasks=["letter_counting", "spell_backward"])
    for split in ("train", "eval"):
        drawn = [env.sample(1, seed=seed, split=split)[0] for seed in range(100)]
        assert all(in_split(p.payload["entry"]["question"], split) for p in drawn)
        tasks = [p.payload["task"] for p in drawn]
        assert tasks.count("letter_counting") == tasks.count("spell_backward") == 50


def test_math_verify_normalises_answers(tmp_path):
    data = tmp_path / "m.jsonl"
    data.write_text("".join(f'{{"q": "Half of one, variant {i}?", "a": "\\\\frac{{1}}{{2}}"}}\n' for i in range(20)))
    env = MathVerify(data_files=str(data), problem_key="q", answer_key="a")
    half = env.sample(1, seed=0)[0]
    assert half.answer == "\\frac{1}{2}"
    assert env.verify(half, "so 0.5</think> The answer is \\boxed{0.5}") == 1.0
    assert env.verify(half, "</think>\\boxed{\\frac{2}{4}}") == 1.0
    assert env.verify(half, "</think>\\boxed{0.6}") == 0.0
    assert env.verify(half, "</think>") == 0.0
    with pytest.raises(ValueError, match="missing fields"):
        MathVerify(data_files=str(data))
    single = tmp_path / "one.jsonl"
    single.write_text('{"q": "Only one problem", "a": "1"}\n')
    split = "train" if in_split("Only one problem", "eval") else "eval"
    with pytest.raises(ValueError, match=f"no {split} problems"):
        MathVerify(data_files=str(single), problem_key="q", answer_key="a").sample(1, seed=0, split=split)


def test_default_math_data_ships_with_the_package():
    env = MathVerify()
    prompts = env.sample(8, seed=0)
    assert len(prompts) == 8 and all(p.answer for p in prompts)


def test_string_tasks_copy_and_reverse():
    from environments.strings import StringTask

    env = StringTask(tasks=["copy", "reverse"], min_letters=3, max_letters=4, alphabet_size=5)
    train, evals = env.sample(100, seed=2), env.sample(100, seed=2, split="eval")
    assert not {(p.payload["task"], p.payload["word"]) for p in train} & {(p.payload["task"], p.payload["word"]) for p in evals}
    for prompt in train[:20]:
        word = prompt.payload["word"]
        assert set(word) <= set("abcde") and 3 <= len(word) <= 4
        assert prompt.answer == (word if prompt.payload["task"] == "copy" else word[::-1])
        demo = env.demonstration(prompt)
        assert demo == f"{' '.join(word)}\n</think>\n{prompt.answer}" and env.verify(prompt, demo) == 1.0
    assert {p.payload["task"] for p in train} == {"copy", "reverse"}
    longer = env.sample(20, seed=2, difficulty=1.0)
    assert all(5 <= len(p.payload["word"]) <= 6 for p in longer)
    with pytest.raises(ValueError, match="tasks must be among"):
        StringTask(tasks="sort")
