"""The README's "Add your environment in 20 lines" example runs as written."""

import re
from pathlib import Path

from zrl.env import Environment, safe_verify

README = Path(__file__).resolve().parents[3] / "README.md"


def test_readme_environment_example_runs():
    text = README.read_text()
    section = text[text.index("## Add your environment in 20 lines"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 24
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    env = namespace["ReverseWord"]()
    assert isinstance(env, Environment)
    prompts = env.sample(5, seed=1)
    assert prompts == env.sample(5, seed=1)
    word = prompts[0].messages[0].content.split()[-1].rstrip(".")
    assert safe_verify(env, prompts[0], f"reversing...</think>{word[::-1]}").reward == 1.0
    assert safe_verify(env, prompts[0], f"</think>{word}").reward == (1.0 if word == word[::-1] else 0.0)
