"""The README's "Add your environment in 20 lines" example runs as written and follows the base class's rules.

The code block is the example package's module (examples/reverse-word-env, installed and used by
tests/unit/test_examples.py). Here it runs straight from the README: deterministic sampling, held-out
problems kept out of training (`in_split`), a verifier, and demonstrations that earn reward 1, so an
`sft` stage (every shipped recipe starts with one) passes `zrl validate`'s checks and builds its
examples from it with the tiny model's tokenizer, as `run_sft_stage` does.
"""

import re
from pathlib import Path

import pytest

from zrl.env import Environment, safe_verify

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "reverse-word-env" / "reverse_word_env" / "envs.py"


def readme_code() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Add your environment in 20 lines"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def word(prompt) -> str:
    return prompt.messages[0].content.split()[-1].rstrip(".")


@pytest.fixture
def env_class():
    namespace = {}
    exec(compile(readme_code(), "README.md", "exec"), namespace)
    return namespace["ReverseWord"]


def test_the_readme_code_is_the_example_packages_module():
    code = readme_code()
    assert code in EXAMPLE.read_text()
    class_lines = code[code.index("class ReverseWord"):].strip().splitlines()
    assert len(class_lines) <= 20  # the section's title


def test_readme_environment_example_runs(env_class):
    env = env_class()
    assert isinstance(env, Environment)
    prompts = env.sample(5, seed=1)
    assert prompts == env.sample(5, seed=1) and len(prompts) == 5
    w = word(prompts[0])
    assert safe_verify(env, prompts[0], f"reversing...</think>{w[::-1]}").reward == 1.0
    assert safe_verify(env, prompts[0], f"</think>{w}").reward == (1.0 if w == w[::-1] else 0.0)


def test_held_out_problems_stay_out_of_training(env_class):
    env = env_class()
    train = {word(p) for seed in range(5) for p in env.sample(100, seed=seed)}
    held_out = {word(p) for seed in range(5) for p in env.sample(100, seed=seed, split="eval")}
    assert len(held_out) > 20 and train.isdisjoint(held_out)


def test_demonstrations_earn_the_reward(env_class):
    env = env_class()
    prompts = env.sample(50, seed=0) + env.sample(50, seed=0, split="eval")
    assert [safe_verify(env, p, env.demonstration(p)).reward for p in prompts] == [1.0] * 100


def test_an_sft_stage_validates_and_builds_its_examples(tmp_path, monkeypatch):
    """The README environment as a user's module referenced by `module:Class` in an sft stage."""
    from transformers import AutoTokenizer

    from zrl.assets import build_tiny_model
    from zrl.config import parse_recipe
    from zrl.pipeline.sft_stage import build_examples
    from zrl.preflight import check
    from zrl.prompts import PromptSource

    (tmp_path / "readme_reverse_word.py").write_text(readme_code())
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_tiny_model(tmp_path / "tiny-zaya")
    recipe = parse_recipe({
        "name": "readme", "model": {"path": str(model)}, "output_dir": str(tmp_path / "run"),
        "stages": [{"name": "warm", "kind": "sft", "steps": 1, "examples_per_step": 16, "max_sequence_tokens": 96,
                    "environments": [{"name": "readme_reverse_word:ReverseWord"}]}]})
    findings = check(recipe)
    assert (findings.problems, findings.missing) == ([], [])

    [stage] = recipe.stages
    tokenizer = AutoTokenizer.from_pretrained(model)
    examples, skipped = build_examples(PromptSource(stage.environments, seed=0), tokenizer, 16,
                                       stage.max_sequence_tokens)
    assert (len(examples), skipped) == (16, 0)
    demo = tokenizer.decode(examples[0].token_ids)
    assert "</think>" in demo and demo.endswith("<|im_end|>")
