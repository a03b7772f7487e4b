"""A third-party environment package, registered through the `zrl.environments` entry-point group and
used by name in a recipe, trains one RL stage through `zrl run`.

The package is a module plus a `.dist-info` directory on PYTHONPATH, which is what `pip install` of
a package declaring the entry point leaves behind; Ray actors (rollout workers, verifiers) find it
through the PYTHONPATH the driver forwards to them.
"""

import textwrap

import pytest
from e2e_testlib import kill_marked, read_rows, recipe, rl_stage, run_zrl, wait_until_gone, write_recipe, zrl_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 4

PLUGIN = '''
"""Even-length replies: reward 1 when the reply has an even number of characters (test plugin)."""

from zrl.env import Environment
from zrl.types import Message, Prompt


class EvenLength(Environment):
    """Reply with an even number of characters."""

    name = "even_length"
    reward_type = "binary"

    def sample(self, n, seed, split="train", difficulty=None):
        return [Prompt(env=self.name, prompt_id=f"even:{split}:{seed}:{i}", answer="", data_source=self.name,
                       messages=(Message("user", f"Write {seed % 89 + i} in words."),)) for i in range(n)]

    def verify(self, prompt, response):
        return float(len(response) % 2 == 0)
'''


def _install_plugin(root):
    (root / "zrl_even_length.py").write_text(textwrap.dedent(PLUGIN))
    dist = root / "zrl_even_length-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zrl-even-length\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[zrl.environments]\neven_length = zrl_even_length:EvenLength\n")


def test_entry_point_environment_trains_by_name(tmp_path, tmp_path_factory):
    plugin_root = tmp_path / "site"
    plugin_root.mkdir()
    _install_plugin(plugin_root)
    env = zrl_env(pythonpath=[plugin_root])
    stage = rl_stage(steps=STEPS, env="even_length")
    path = write_recipe(tmp_path / "recipe.yaml",
                        recipe(tmp_path / "run", tmp_path_factory.getbasetemp() / "tiny-model", [stage]))
    try:
        assert run_zrl(["envs"], env, tmp_path / "envs.log") == 0
        listing = (tmp_path / "envs.log").read_text()
        assert "even_length" in listing and "Reply with an even number of characters." in listing
        rc = run_zrl(["run", str(path)], env, tmp_path / "run.log")
        assert rc == 0, (tmp_path / "run.log").read_text()[-6000:]
        assert wait_until_gone(env["ZRL_TEST_MARKER"], timeout_s=30) == {}
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])

    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # The verifier actors built the plugin by name and scored every rollout (an error would score 0, counted).
    rewarded = [r["reward/even_length"] for r in rows if "reward/even_length" in r]
    assert any(0.0 < v < 1.0 for v in rewarded)  # mixed rewards: the groups carry signal
    assert rows[-1]["env/verifier_errors"] == 0 and rows[-1]["buffer/received"] >= STEPS * 4
    assert (tmp_path / "run" / "stages" / "rl" / "hf" / "config.json").is_file()
