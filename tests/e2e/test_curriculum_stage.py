"""Adaptive difficulty end to end: `zrl run recipes/tiny-curriculum-cpu.yaml` (SFT warm start, then RL
on `strings` with `difficulty: adaptive`), SIGKILLed during the RL stage and finished with `--resume`.

1. The RL stage calibrates before it trains (one "calibrated" line; the first step's row already has
   `curriculum/calibrating` 0) and the level follows the policy: the estimated crossing ends above
   where calibration put it, and at the highest level the stage trained at for at least a quarter of
   its steps the trained policy's held-out accuracy is above the warm start's (the scheduler kept it
   there because the policy improved at it). Measured on the 2-core CPU machine: 2026-11-24, calibrated
   at level 2 (crossing 1.8), crossing 3.1 after the 30 RL steps, held-out accuracy at level 3 (7-8
   letters) 0.31 -> 0.58; 2026-11-25, crossing 1.9 -> 3.3, most steps at levels 2 and 3, held-out
   0.54 -> 0.71 at level 2 and 0.31 -> 0.53 at level 3. That run reached level 4 at its last step,
   where neither policy copies 9-10 letters (0.02 -> 0.01 of 400 samples): the level a stage ends at
   can be one it never trained at, so it is not the level compared. The warm start stops while SFT's
   loss is still falling fast, so its profile differs between CPUs; the assertions hold for any
   profile whose crossing lies inside the levels.
2. The schedulers' state is in the checkpoint and survives the kill: the resumed run does not calibrate
   again and its group count continues from the checkpoint's.
"""

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_testlib import ROOT, ZRL, kill_marked, read_latest, read_rows, run_zrl, start_zrl, wait_until_gone, zrl_env

log = logging.getLogger(__name__)  # measured values; visible with pytest --log-cli-level=INFO
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RL_STAGE = "copy_rl_adaptive"
KEY = "curriculum/strings"


def _kill_after_rl_checkpoint(proc, run_dir: Path, timeout_s: float = 900) -> dict:
    """SIGKILL the driver once an RL checkpoint exists and a later step was logged; the checkpoint."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        latest = read_latest(run_dir)
        if latest and latest["stage"] == RL_STAGE and any(r["step"] > latest["step"] for r in read_rows(run_dir)):
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return read_latest(run_dir)
        time.sleep(0.2)
    raise AssertionError("no RL checkpoint followed by a logged step within the time limit")


def _held_out_accuracy(export: Path, level: int) -> float:
    """Words of the recipe's entry at `level` (1 + 2 level to 2 + 2 level letters), 100 prompts x 4
    samples at temperature 1."""
    options = f"{{tasks: copy, min_letters: {1 + 2 * level}, max_letters: {2 + 2 * level}}}"
    out = subprocess.run([ZRL, "eval", str(export), "--env", "strings", "--options", options,
                          "--num-prompts", "100", "--samples", "4",
                          "--temperature", "1.0", "--max-response-tokens", "48", "--seed", "7", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)["accuracy"]


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("curriculum")
    run_dir = tmp / "run"
    args = ["run", "recipes/tiny-curriculum-cpu.yaml", "--set", f"output_dir={run_dir}",
            "--set", "metrics.wandb.enabled=false"]
    env = zrl_env()
    marker = env["ZRL_TEST_MARKER"]
    try:
        proc = start_zrl(args, env, tmp / "first.log")
        checkpoint = _kill_after_rl_checkpoint(proc, run_dir)
        assert not wait_until_gone(marker, timeout_s=120), "the killed run left processes behind"
        saved = json.loads((Path(checkpoint["path"]) / "trainer_state.json").read_text())["data_state"]
        resumed_log = tmp / "resumed.log"
        rc = run_zrl([*args, "--resume"], env, resumed_log)  # ~1 min on 2 CPU cores
        assert rc == 0, resumed_log.read_text()[-6000:]
        yield {"run_dir": run_dir, "checkpoint": checkpoint, "saved": saved, "first_log": (tmp / "first.log").read_text(),
               "resumed_log": resumed_log.read_text()}
    finally:
        kill_marked(marker)


def _rl_rows(run_dir: Path) -> list[dict]:
    return [r for r in read_rows(run_dir) if f"{KEY}/groups" in r]


def test_calibration_comes_first_and_the_level_follows_the_improving_policy(interrupted_run):
    run_dir = interrupted_run["run_dir"]
    first_log = interrupted_run["first_log"]
    assert first_log.count("curriculum: strings calibrated at level") == 1, \
        [line for line in first_log.splitlines() if "curriculum:" in line]
    rows = _rl_rows(run_dir)
    assert rows[0]["curriculum/calibrating"] == 0.0
    first, last = rows[0][f"{KEY}/mu_mean"], rows[-1][f"{KEY}/mu_mean"]
    levels = [int(r[f"{KEY}/difficulty"]) for r in rows]
    common = [level for level in set(levels) if 4 * levels.count(level) >= len(levels)]
    trained = max(common) if common else max(set(levels), key=levels.count)
    warm = _held_out_accuracy(run_dir / "stages" / "sft_warm_start" / "hf", trained)
    final = _held_out_accuracy(run_dir / "stages" / RL_STAGE / "hf", trained)
    log.info("crossing %.2f -> %.2f; levels %s; held-out accuracy at level %d: %.3f -> %.3f", first, last, levels,
             trained, warm, final)
    assert final > warm
    assert last > first


def test_the_scheduler_state_survives_a_killed_driver(interrupted_run):
    saved = interrupted_run["saved"]["curriculum"]
    assert not saved["calibrating"]
    groups_at_checkpoint = saved["curriculum"]["schedulers"]["strings"]["n_updates"]
    assert groups_at_checkpoint > 0
    assert "calibrated at level" not in interrupted_run["resumed_log"]
    assert "did not calibrate" not in interrupted_run["resumed_log"]
    # restored from the checkpoint, not taken over as if from a previous stage
    assert "curriculum: inherited" not in interrupted_run["resumed_log"]
    after = [r for r in _rl_rows(interrupted_run["run_dir"]) if r["step"] > interrupted_run["checkpoint"]["step"]]
    assert after, "no RL step after the checkpoint"
    # a fresh scheduler would start from 0 groups and calibrate again; the restored one continues
    assert after[0][f"{KEY}/groups"] > groups_at_checkpoint
    assert all(r["curriculum/calibrating"] == 0.0 for r in after)


def test_an_rlve_gym_stage_with_adaptive_difficulty_runs_on_the_tiny_model(tmp_path, tmp_path_factory):
    """RLVE-Gym problems are far beyond the tiny model (its rewards are ~0, so zero-signal groups are
    kept: `dynamic_sampling: false`); the stage must still generate, verify, schedule and train."""
    from e2e_testlib import recipe, rl_stage, run_to_completion, write_recipe

    stage = rl_stage(steps=3, env="rlve_gym")
    stage["environments"] = [{"name": "rlve_gym", "options": {"environments": ["Multiplication", "Sorting"]},
                              "difficulty": "adaptive", "curriculum": {"calibration_max_groups": 4}}]
    stage["sampling"].update(max_prompt_tokens=1000, max_response_tokens=24)
    stage["algorithm"]["dynamic_sampling"] = False
    run_dir = tmp_path / "run"
    path = write_recipe(tmp_path / "recipe.yaml", recipe(run_dir, tmp_path_factory.getbasetemp() / "tiny-model",
                                                         stages=[stage]))
    run_to_completion(path, tmp_path / "run.log")
    rows = [r for r in read_rows(run_dir) if "curriculum/rlve_gym/mean_difficulty" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for task in ("Multiplication", "Sorting"):  # a scheduler per RLVE environment
        assert 0 <= rows[-1][f"curriculum/rlve_gym/{task}/difficulty"] <= 50
    assert "env/rlve_gym/generation_failures" in rows[-1]
    checkpoint = json.loads((run_dir / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    schedulers = checkpoint["data_state"]["curriculum"]["curriculum"]["schedulers"]
    assert sorted(schedulers) == ["rlve_gym/Multiplication", "rlve_gym/Sorting"]
    assert sum(s["n_updates"] for s in schedulers.values()) >= 8  # calibration: 4 groups each at least
