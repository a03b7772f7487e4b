"""recipes/tiny-code-cpu.yaml through `zrl run`: the `code` and `code_auxiliary` environments score every
response in bubblewrap sandboxes inside the verifier actors, the asynchronous stage takes all its steps
(rewards are ~0 for an untrained tiny model; the stage must not stall), and once the run ended no
process of any sandbox is left on the machine."""

from pathlib import Path

import pytest
import yaml
from e2e_testlib import kill_marked, read_rows, run_zrl, wait_until_gone, write_recipe, zrl_env
from processes_testlib import sandbox_processes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-code-cpu.yaml"


def test_code_stage_runs_its_steps_and_leaves_no_sandbox(tmp_path, tmp_path_factory):
    data = yaml.safe_load(RECIPE.read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["model"]["path"] = str(tmp_path_factory.getbasetemp() / "tiny-model")
    data["metrics"] = {"wandb": {"enabled": False}, "tensorboard": False}
    steps = data["stages"][0]["steps"]
    env = zrl_env()
    assert sandbox_processes() == []
    try:
        rc = run_zrl(["run", str(write_recipe(tmp_path / "recipe.yaml", data))], env, tmp_path / "run.log")
        assert rc == 0, (tmp_path / "run.log").read_text()[-6000:]
        assert wait_until_gone(env["ZRL_TEST_MARKER"], timeout_s=30) == {}
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])
    assert sandbox_processes() == []

    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert any("reward/code" in r for r in rows) and any("reward/code_auxiliary" in r for r in rows)
    assert rows[-1]["buffer/received"] >= steps * data["stages"][0]["sampling"]["prompts_per_batch"]
