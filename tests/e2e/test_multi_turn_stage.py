"""recipes/tiny-skyrl-gym-cpu.yaml through `zrl run`: an environment taken unchanged from skyrl-gym (its own
`gsm8k_multi_turn`, which answers a message without the right `#### N` answer with a format nudge until
max_turns) feeds an SFT stage with the adapter's demonstrations and trains an asynchronous RL stage end to end
through the adapter (environments/skyrl_gym_env.py): episodes run several turns on the rollout worker's
engine, their rewards come from the environment as it ran, the trainer steps on sequences whose environment
tokens are context, and the held-out evaluation runs episodes, during the stage and after it.

The test shortens the recipe (a shorter warm start, 4 RL steps, a small evaluation, none after the warm
start): it checks the episode path, not learning; the recipe's header has the full run's figures."""

import json
from pathlib import Path

import pytest
import yaml
from e2e_testlib import kill_marked, read_rows, run_zrl, wait_until_gone, write_recipe, zrl_env

from zrl.env.episodes import END_REASONS
from zrl.run_dir import RunDir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-skyrl-gym-cpu.yaml"


def test_a_skyrl_gym_environment_trains_a_stage_unchanged(tmp_path, tmp_path_factory):
    data = yaml.safe_load(RECIPE.read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["model"]["path"] = str(tmp_path_factory.getbasetemp() / "tiny-model")
    data["metrics"] = {"wandb": {"enabled": False}, "tensorboard": False}
    sft, rl = data["stages"]
    sft["steps"], sft["evaluation"] = 40, {"prompts": 0}
    rl["steps"], rl["evaluation"] = 4, {**rl["evaluation"], "prompts": 8, "samples": 2, "every_steps": 2}
    env = zrl_env()
    try:
        rc = run_zrl(["run", str(write_recipe(tmp_path / "recipe.yaml", data))], env, tmp_path / "run.log")
        assert rc == 0, (tmp_path / "run.log").read_text()[-6000:]
        assert wait_until_gone(env["ZRL_TEST_MARKER"], timeout_s=30) == {}
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])

    every = read_rows(tmp_path / "run")
    sft_rows = [r for r in every if "loss/sft" in r]  # the warm start on the adapter's demonstrations, all fitting
    assert len(sft_rows) == sft["steps"] and all(r["sft/skipped_long_examples"] == 0 for r in sft_rows)
    rows = [r for r in every if r["step"] > sft["steps"] and "loss/policy" in r]
    assert [r["step"] for r in rows] == list(range(sft["steps"] + 1, sft["steps"] + rl["steps"] + 1))
    # every trained batch is of episodes; some ran past their first turn (the env's nudge, the next message)
    assert all(1 <= r["episodes/turns_mean"] <= rl["environments"][0]["options"]["max_turns"] for r in rows)
    assert max(r["episodes/turns_mean"] for r in rows) > 1
    reasons = {key.rsplit("/", 1)[1] for r in rows for key in r if key.startswith("verify/skyrl_gym/")}
    assert reasons and reasons <= set(END_REASONS), reasons
    assert rows[-1]["env/verifier_errors"] == 0
    assert all(r["episodes/tool_calls_mean"] == 0 for r in rows)  # gsm8k_multi_turn has no tools
    held_out = json.loads(RunDir(tmp_path / "run").stage_record(rl["name"]).read_text())["evaluation"]["skyrl_gym"]
    assert held_out["num_prompts"] == rl["evaluation"]["prompts"] and held_out["verifier_errors"] == 0
    assert held_out["metadata_means"]["turns"] >= 1 and set(held_out["reasons"]) <= set(END_REASONS)
    during = [r["eval/policy_version"] for r in every if "eval/skyrl_gym/accuracy" in r]
    assert during == [sft["steps"] + k for k in (0, 2, 4)]  # the stage's start, then every 2 steps
