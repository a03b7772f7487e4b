"""The README's environment example, packaged by a third party: registered through the
`zrl.environments` entry-point group and used by name in a recipe that trains one RL stage through
`zrl run`.

The package is the README's code block as a module plus a `.dist-info` directory on PYTHONPATH, which is
what `pip install` of a package declaring the entry point leaves behind; Ray actors (rollout workers,
verifiers) find it through the PYTHONPATH the driver forwards to them. An untrained tiny model cannot
reverse words, so the stage keeps zero-signal groups (`dynamic_sampling: false`) to train its 4 steps:
the test is about the plugin path, not about learning (tests/e2e/test_tiny_cascade_learns.py is).
"""

import re
from pathlib import Path

import pytest
from e2e_testlib import kill_marked, read_rows, recipe, rl_stage, run_zrl, wait_until_gone, write_recipe, zrl_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 4
README = Path(__file__).resolve().parents[2] / "README.md"


def _install_plugin(root):
    text = README.read_text()
    section = text[text.index("## Add your environment in 20 lines"):]
    (root / "zrl_reverse_word.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    dist = root / "zrl_reverse_word-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zrl-reverse-word\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[zrl.environments]\nreverse_word = zrl_reverse_word:ReverseWord\n")


def test_entry_point_environment_trains_by_name(tmp_path, tmp_path_factory):
    plugin_root = tmp_path / "site"
    plugin_root.mkdir()
    _install_plugin(plugin_root)
    env = zrl_env(pythonpath=[plugin_root])
    stage = rl_stage(steps=STEPS, env="reverse_word")
    stage["algorithm"]["dynamic_sampling"] = False
    path = write_recipe(tmp_path / "recipe.yaml",
                        recipe(tmp_path / "run", tmp_path_factory.getbasetemp() / "tiny-model", [stage]))
    try:
        assert run_zrl(["envs"], env, tmp_path / "envs.log") == 0
        listing = (tmp_path / "envs.log").read_text()
        assert "reverse_word" in listing and "reverse a random lowercase word" in listing
        rc = run_zrl(["run", str(path)], env, tmp_path / "run.log")
        assert rc == 0, (tmp_path / "run.log").read_text()[-6000:]
        assert wait_until_gone(env["ZRL_TEST_MARKER"], timeout_s=30) == {}
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])

    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # The verifier actors built the plugin by name and scored every rollout (an error would score 0, counted).
    assert any("reward/reverse_word" in r for r in rows)
    assert rows[-1]["env/verifier_errors"] == 0 and rows[-1]["buffer/received"] >= STEPS * 4
    assert (tmp_path / "run" / "stages" / "rl" / "hf" / "config.json").is_file()
