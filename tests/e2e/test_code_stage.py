"""recipes/tiny-code-cpu.yaml through `zrl run`, with the README's environment example riding along as a
third party's plugin: one asynchronous RL stage checks both.

- Sandboxes: the `code` and `code_auxiliary` environments score every response in bubblewrap sandboxes
  inside the verifier actors, the stage takes all its steps (rewards are ~0 for an untrained tiny model;
  the stage must not stall), and once the run ended no process of any sandbox is left on the machine.
- Plugins: the README's code block, packaged as a module plus a `.dist-info` directory on PYTHONPATH (what
  `pip install` of a package declaring the `zrl.environments` entry point leaves behind), is listed by
  `zrl envs` and used by name in the recipe; Ray actors (rollout workers, verifiers) find it through the
  PYTHONPATH the driver forwards to them. Learning is the main command's subject (tests/e2e/test_readme_commands.py).
"""

import re
from pathlib import Path

import pytest
import yaml
from e2e_testlib import kill_marked, read_rows, run_zrl, wait_until_gone, write_recipe, zrl_env
from processes_testlib import sandbox_processes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-code-cpu.yaml"


def _install_plugin(root: Path) -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Add your environment in 20 lines"):]
    (root / "zrl_reverse_word.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    dist = root / "zrl_reverse_word-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: zrl-reverse-word\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[zrl.environments]\nreverse_word = zrl_reverse_word:ReverseWord\n")


def test_code_and_plugin_environments_train_a_stage_and_leave_no_sandbox(tmp_path, tmp_path_factory):
    plugin_root = tmp_path / "site"
    plugin_root.mkdir()
    _install_plugin(plugin_root)
    data = yaml.safe_load(RECIPE.read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["model"]["path"] = str(tmp_path_factory.getbasetemp() / "tiny-model")
    data["metrics"] = {"wandb": {"enabled": False}, "tensorboard": False}
    stage = data["stages"][0]
    stage["environments"].append({"name": "reverse_word", "weight": 0.5})
    env = zrl_env(pythonpath=[plugin_root])
    assert sandbox_processes() == []
    try:
        assert run_zrl(["envs"], env, tmp_path / "envs.log") == 0
        listing = (tmp_path / "envs.log").read_text()
        assert "reverse_word" in listing and "reverse a random lowercase word" in listing
        rc = run_zrl(["run", str(write_recipe(tmp_path / "recipe.yaml", data))], env, tmp_path / "run.log")
        assert rc == 0, (tmp_path / "run.log").read_text()[-6000:]
        assert wait_until_gone(env["ZRL_TEST_MARKER"], timeout_s=30) == {}
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])
    assert sandbox_processes() == []

    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, stage["steps"] + 1))
    # The verifier actors built every entry (the plugin by name) and scored every rollout: an error would
    # score 0 and be counted.
    for key in ("reward/code", "reward/code_auxiliary", "reward/reverse_word"):
        assert any(key in r for r in rows), key
    assert rows[-1]["env/verifier_errors"] == 0
    assert rows[-1]["buffer/received"] >= stage["steps"] * stage["sampling"]["prompts_per_batch"]
    assert (tmp_path / "run" / "stages" / stage["name"] / "hf" / "config.json").is_file()
