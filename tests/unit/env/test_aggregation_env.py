"""The `aggregation` environment: a wrapped environment's problems with C stored candidates' tails, in
the prompt test-time Markovian RSA builds, scored by the wrapped verifier on the original problem."""

import dataclasses
import json

import pytest

from environments.aggregation import Aggregation
from environments.strings import StringTask
from serving.rsa import AggregationPrompter
from zrl.config.schema import EnvironmentSpec
from zrl.prompts import build_environment

C, TAU = 3, 4


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from zrl.assets import build_tokenizer

    path = tmp_path_factory.mktemp("aggregation_tok")
    build_tokenizer(path)
    return path


def _spelled(word: str) -> str:
    return " ".join(word) + "\n</think>\n" + word


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """20 strings problems, each with one correct and three wrong stored responses (rewards included
    for the even ones only)."""
    path = tmp_path_factory.mktemp("aggregation") / "rollouts.jsonl"
    rows = []
    for i, prompt in enumerate(StringTask(min_letters=6, max_letters=8).sample(20, seed=1)):
        word = prompt.answer
        responses = [_spelled(word[::-1]), _spelled(word), "no idea", _spelled(word[:2])]
        row = {"prompt": dataclasses.asdict(prompt), "responses": responses}
        if i % 2 == 0:
            row["rewards"] = [0.0, 1.0, 0.0, 0.0]
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n")
    return path


def _env(rollouts, tokenizer_dir, **options) -> Aggregation:
    spec = EnvironmentSpec(name="aggregation", options={"env": "strings", "rollouts": str(rollouts),
                                                        "tokenizer": str(tokenizer_dir), "num_aggregated": C,
                                                        "tail_tokens": TAU, **options})
    return build_environment(spec)


def test_a_prompt_is_the_rsa_aggregation_prompt_of_its_problem_and_tails(rollouts, tokenizer_dir):
    env = _env(rollouts, tokenizer_dir)
    prompter = AggregationPrompter(env.prompter.tokenizer)
    tokenizer = env.prompter.tokenizer
    for prompt in env.sample(12, seed=5):
        original = env.original(prompt)
        problem = env.problems[prompt.payload["problem"]]
        assert len(prompt.payload["candidates"]) == C == len(set(prompt.payload["candidates"]))
        tails = []
        for i in prompt.payload["candidates"]:
            ids = tokenizer.encode(problem.responses[i], add_special_tokens=False)
            tail = prompter.tail(ids, "stop" if "</think>" in problem.responses[i] else "length", TAU, False)
            assert len(tail) <= TAU
            tails.append(tail)
        rendered = tokenizer.encode(tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True,
                                                                  tokenize=False), add_special_tokens=False)
        assert rendered == list(prompter.build(original, tails).ids)  # what serving/rsa.py submits
        assert prompt.answer == original.answer and prompt.data_source == f"aggregation:{original.data_source}"


def test_tails_are_the_reasoning_end_or_with_hybrid_a_finished_answer(rollouts, tokenizer_dir):
    env = _env(rollouts, tokenizer_dir)
    assert env.tail("a b c d e f</think>abcdef").split() == ["c", "d", "e", "f"]  # tokens " c" .. " f"
    assert env.tail("a b") == "a b"  # shorter than tau: whole, and an unclosed reasoning is all reasoning
    hybrid = _env(rollouts, tokenizer_dir, hybrid=True)
    assert hybrid.tail("a b c d e f</think>abcdef") == "cdef"  # the answer section, cut to tau tokens
    assert hybrid.tail("a b c d e f g").split() == ["d", "e", "f", "g"]  # unfinished: its reasoning tail


def test_sampling_is_deterministic_and_splits_problems_by_id(rollouts, tokenizer_dir):
    env = _env(rollouts, tokenizer_dir)
    assert env.sample(8, seed=3) == env.sample(8, seed=3)
    assert env.sample(8, seed=3) != env.sample(8, seed=4)
    train = {p.payload["prompt_id"] for p in env.sample(200, seed=0, split="train")}
    held_out = {p.payload["prompt_id"] for p in env.sample(50, seed=0, split="eval")}
    assert train and held_out and not train & held_out


def test_the_wrapped_verifier_scores_the_response_on_the_original_problem(rollouts, tokenizer_dir):
    env = _env(rollouts, tokenizer_dir)
    prompt = env.sample(1, seed=2)[0]
    word = env.original(prompt).answer
    assert env.verify(prompt, _spelled(word)) == 1.0
    assert env.verify(prompt, _spelled(word + "a")) == 0.0
    assert env.verify_group(prompt, [_spelled(word), "x"]) == [1.0, 0.0]
    assert env.reward_type == "binary"


def test_a_demonstration_is_a_correct_stored_response_else_the_wrapped_one(rollouts, tokenizer_dir, tmp_path):
    env = _env(rollouts, tokenizer_dir)
    for prompt in env.sample(6, seed=9):  # with and without stored rewards
        assert env.demonstration(prompt) == _spelled(env.original(prompt).answer)
    rows = [json.loads(line) for line in rollouts.read_text().splitlines()]
    for row in rows:
        row["responses"] = ["wrong"] * 4
        row.pop("rewards", None)
    none_correct = tmp_path / "wrong.jsonl"
    none_correct.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = _env(none_correct, tokenizer_dir)
    prompt = env.sample(1, seed=0)[0]
    assert env.demonstration(prompt) == StringTask().demonstration(env.original(prompt))


@pytest.mark.parametrize("row, reason", [
    ({"responses": ["a"] * 4}, "not a rollouts row (KeyError: 'prompt')"),
    ({"prompt": {"prompt_id": "p", "messages": [{"role": "user", "content": "q"}]}, "responses": ["a", "b"]},
     "responses has 2, fewer than num_aggregated (3)"),
    ({"prompt": {"prompt_id": "p", "messages": [{"role": "user", "content": "q"}]}, "responses": ["a"] * 3,
      "rewards": [1.0]}, "rewards has 1 entries for 3 responses"),
    ({"prompt": {"prompt_id": "p", "messages": [{"role": "system", "content": "q"}]}, "responses": ["a"] * 3},
     "prompt.messages has no user message"),
])
def test_a_malformed_rollouts_file_is_a_one_line_error_naming_the_line(tmp_path, tokenizer_dir, row, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="aggregation") as info:
        _env(path, tokenizer_dir)
    assert f"{path}:2: {reason}" in str(info.value) and "\n" not in str(info.value)


def test_options_the_wrapper_cannot_use_are_refused(rollouts, tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"'aggregation': rollouts: {tmp_path / 'none.jsonl'} does not exist"):
        _env(tmp_path / "none.jsonl", tokenizer_dir)
    with pytest.raises(FileNotFoundError, match="tokenizer: .*no-tokenizer does not exist"):
        _env(rollouts, tmp_path / "no-tokenizer")
    with pytest.raises(ValueError, match="tail_tokens must be >= 1"):
        _env(rollouts, tokenizer_dir, tail_tokens=0)
    with pytest.raises(ValueError, match="reward model"):
        _env(rollouts, tokenizer_dir, env="chat_reward_model")
