"""The README's environment examples run as written and follow the base classes' rules.

Each code block is an example package's module, verbatim below its docstring: "Add your environment in 20
lines" is examples/reverse-word-env's, "A multi-turn environment" examples/lookup-env's (both installed
and used by tests/unit/test_examples.py). Here they run straight from the README: deterministic sampling,
held-out problems kept out of training (`in_split`), a verifier or an episode, and demonstrations that
earn reward 1, so an `sft` stage (every shipped recipe starts with one) passes `zrl validate`'s checks and
builds its examples from them with the tiny model's tokenizer, as `run_sft_stage` does.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from zrl.env import Environment, EpisodicEnvironment, safe_verify

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class ReadmeExample:
    heading: str   # the README text the code block follows
    module: Path   # the example package's module
    cls: str


REVERSE_WORD = ReadmeExample("## Add your environment in 20 lines",
                             ROOT / "examples" / "reverse-word-env" / "reverse_word_env" / "envs.py", "ReverseWord")
LOOKUP = ReadmeExample("**A multi-turn environment.**", ROOT / "examples" / "lookup-env" / "lookup_env" / "envs.py",
                       "Lookup")
EXAMPLES = [REVERSE_WORD, LOOKUP]


def readme_code(example: ReadmeExample) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(example.heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_class(example: ReadmeExample):
    namespace = {}
    exec(compile(readme_code(example), "README.md", "exec"), namespace)
    return namespace[example.cls]


def key(prompt) -> str:
    """The problem's key, what the split partitions: the prompt's last word (the word, the looked-up key)."""
    return prompt.messages[0].content.split()[-1].rstrip(".")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.cls)
def test_the_readme_code_is_the_example_packages_module(example):
    code, text = readme_code(example), example.module.read_text()
    assert text.endswith(code)
    head = ast.parse(text[: -len(code)])
    assert ast.get_docstring(head) and len(head.body) == 1  # above the README's code: the module docstring only


def test_the_single_turn_example_fits_its_title():
    code = readme_code(REVERSE_WORD)
    class_lines = code[code.index("class ReverseWord"):].strip().splitlines()
    assert len(class_lines) <= 20  # the section's title


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.cls)
def test_held_out_problems_stay_out_of_training(example):
    env = readme_class(example)()
    assert env.sample(5, seed=1) == env.sample(5, seed=1) and len(env.sample(5, seed=1)) == 5
    train = {key(p) for seed in range(5) for p in env.sample(100, seed=seed)}
    held_out = {key(p) for seed in range(5) for p in env.sample(100, seed=seed, split="eval")}
    assert len(held_out) > 20 and train.isdisjoint(held_out)


def test_readme_environment_example_runs():
    env = readme_class(REVERSE_WORD)()
    assert isinstance(env, Environment)
    prompts = env.sample(5, seed=1)
    w = key(prompts[0])
    assert safe_verify(env, prompts[0], f"reversing...</think>{w[::-1]}").reward == 1.0
    assert safe_verify(env, prompts[0], f"</think>{w}").reward == (1.0 if w == w[::-1] else 0.0)


def test_the_multi_turn_example_answers_lookups_and_scores_the_answer():
    env = readme_class(LOOKUP)()
    assert isinstance(env, EpisodicEnvironment)
    prompt = env.sample(1, seed=1)[0]
    k, value = key(prompt), prompt.answer
    episode = env.episode(prompt)
    turn = episode.step(f"</think>get {k}x")  # a key it does not hold: told so, the episode goes on
    assert turn.messages == ({"role": "user", "content": "unknown key"},) and not turn.done
    turn = episode.step(f"looking it up</think>get {k}")
    assert turn.messages == ({"role": "user", "content": value},) and not turn.done
    turn = episode.step(f"</think>{value}")
    assert turn.done and turn.reward == 1.0
    guess = env.episode(prompt).step(f"</think>{int(value) % 90 + 10}")  # an answer without asking: wrong
    assert guess.done and guess.reward == 0.0
    assert safe_verify(env, prompt, f"</think>get {k}</think>{value}").reward == 1.0  # a transcript, scored whole


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.cls)
def test_demonstrations_earn_the_reward(example):
    env = readme_class(example)()
    prompts = env.sample(50, seed=0) + env.sample(50, seed=0, split="eval")
    if not isinstance(env, EpisodicEnvironment):
        assert [safe_verify(env, p, env.demonstration(p)).reward for p in prompts] == [1.0] * 100
        return
    for p in prompts:  # the transcript played through an episode: the replies it shows, then reward 1
        demo, episode = env.demonstration(p), env.episode(p)
        ask, reply, answer = demo
        assert episode.step(ask["content"]).messages == (reply,)
        assert episode.step(answer["content"]).reward == 1.0


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.cls)
def test_an_sft_stage_validates_and_builds_its_examples(example, tmp_path, monkeypatch):
    """The README environment as a user's module referenced by `module:Class` in an sft stage."""
    from transformers import AutoTokenizer

    from zrl.assets import build_tiny_model
    from zrl.config import parse_recipe
    from zrl.pipeline.sft_stage import build_examples
    from zrl.preflight import check
    from zrl.prompts import PromptSource

    module = f"readme_{example.cls.lower()}"
    (tmp_path / f"{module}.py").write_text(readme_code(example))
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_tiny_model(tmp_path / "tiny-zaya")
    recipe = parse_recipe({
        "name": "readme", "model": {"path": str(model)}, "output_dir": str(tmp_path / "run"),
        "stages": [{"name": "warm", "kind": "sft", "steps": 1, "examples_per_step": 16, "max_sequence_tokens": 96,
                    "environments": [{"name": f"{module}:{example.cls}"}]}]})
    findings = check(recipe)
    assert (findings.problems, findings.missing) == ([], [])

    [stage] = recipe.stages
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples, skipped = build_examples(PromptSource(stage.environments, seed=0), tokenizer, 16,
                                       stage.max_sequence_tokens)
    assert (len(examples), skipped) == (16, 0)
    demo = tokenizer.decode(examples[0].token_ids)
    assert "</think>" in demo and demo.endswith("<|im_end|>")
    if example is LOOKUP:  # the environment's reply is context: only the assistant's turns are trained
        trained = tokenizer.decode(examples[0].token_ids[examples[0].loss_mask])
        assert trained.count("<|im_end|>") == 2 and "user" not in trained
