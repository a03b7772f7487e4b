"""`zrl run --resume` continues an interrupted cascade where it stopped.

1. SFT resume is exact: a run resumed from its step-2 checkpoint reproduces the losses and the final
   weights of the uninterrupted run (same data draws, optimizer state, schedule and RNG).
2. A run stopped between two RL stages resumes into the second with what the first handed on.

A cascade SIGKILLed during its RL stage and resumed to the end (every step once, the buffer's counters
continued, no prompt trained twice, nothing of the killed run left running) is checked on the adaptive-
difficulty run of tests/e2e/test_curriculum_stage.py, which is killed and resumed for its own checks.
"""

import json
import shutil

import pytest
from e2e_testlib import kill_marked, read_latest, read_rows, recipe, rl_stage, run_zrl, sft_stage, write_recipe, zrl_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _safetensors(path):
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _run_then_resume_a_cut_copy(tmp_path, model_dir, stages, stage: str, step: int, unfinished=()) -> str:
    """Run `stages` to the end in tmp_path/full, then resume a copy (tmp_path/cut) made to look as if it
    had been killed right after the checkpoint of `step` (in `stage`), before the stages `unfinished`
    wrote their records; returns the resumed run's log."""
    full = write_recipe(tmp_path / "full.yaml", recipe(tmp_path / "full", model_dir, stages))
    env = zrl_env()
    try:
        assert run_zrl(["run", str(full)], env, tmp_path / "full.log") == 0, (tmp_path / "full.log").read_text()[-4000:]
        shutil.copytree(tmp_path / "full", tmp_path / "cut")
        (tmp_path / "cut" / "checkpoints" / "latest.json").write_text(
            json.dumps({"stage": stage, "step": step, "path": str(tmp_path / "cut" / "checkpoints" / f"step_{step:06d}")}))
        for name in unfinished:
            shutil.rmtree(tmp_path / "cut" / "stages" / name)
        cut = write_recipe(tmp_path / "cut.yaml", recipe(tmp_path / "cut", model_dir, stages))
        rc = run_zrl(["run", str(cut), "--resume"], env, tmp_path / "cut.log")
        log = (tmp_path / "cut.log").read_text()
        assert rc == 0, log[-4000:]
        return log
    finally:
        kill_marked(env["ZRL_TEST_MARKER"])


def test_sft_resume_reproduces_the_uninterrupted_run(tmp_path, tmp_path_factory):
    model_dir = tmp_path_factory.getbasetemp() / "tiny-model"
    stages = [sft_stage(steps=4, checkpoint_every_steps=2)]
    _run_then_resume_a_cut_copy(tmp_path, model_dir, stages, "sft", 2)

    full_rows, cut_rows = read_rows(tmp_path / "full"), read_rows(tmp_path / "cut")
    assert [r["step"] for r in cut_rows] == [1, 2, 3, 4]
    assert cut_rows[:2] == full_rows[:2]
    assert cut_rows[2]["time"] > full_rows[3]["time"]  # steps 3-4 were trained again
    # Same examples, weights, AdamW moments, LR schedule and reduction order: the losses agree exactly.
    assert [r["loss/sft"] for r in cut_rows[2:]] == [r["loss/sft"] for r in full_rows[2:]]
    assert [r["batch/input_tokens"] for r in cut_rows[2:]] == [r["batch/input_tokens"] for r in full_rows[2:]]
    full_weights = _safetensors(tmp_path / "full" / "stages" / "sft" / "hf")
    cut_weights = _safetensors(tmp_path / "cut" / "stages" / "sft" / "hf")
    assert full_weights.keys() == cut_weights.keys()
    assert all((full_weights[k] == cut_weights[k]).all() for k in full_weights)
    # The copied step-4 checkpoint lay after the resume point: it was removed, then saved again.
    assert "removed" in (tmp_path / "cut.log").read_text() and read_latest(tmp_path / "cut")["step"] == 4


def test_a_run_resumed_between_two_stages_hands_the_first_ones_state_to_the_second(tmp_path, tmp_path_factory):
    """A cascade stopped after stage `a` finished (its record written, its last checkpoint the latest) and
    before stage `b` saved anything resumes into `b` with what `a` handed on: the length-reward frontier
    and the difficulty scheduler of the adaptive entry both stages share (read from `a`'s checkpoint)."""
    model_dir = tmp_path_factory.getbasetemp() / "tiny-model"
    stages = []
    for name in ("a", "b"):
        stage = rl_stage(name=name, steps=2, env="strings")
        stage["environments"] = [{"name": "strings", "difficulty": "adaptive", "curriculum": {"calibration_max_groups": 4}}]
        stage["algorithm"].update(dynamic_sampling=False, length_reward={"enabled": True})
        stages.append(stage)
    log = _run_then_resume_a_cut_copy(tmp_path, model_dir, stages, "a", 2, unfinished=("b",))
    assert "stage 'a' finished before the interruption" in log
    assert "curriculum: inherited the scheduler state of strings from the previous stage" in log
    handed = json.loads((tmp_path / "full" / "stages" / "a" / "stage.json").read_text())["handoff"]
    expected = {"length_reward_frontier": sorted(handed["length_reward_frontier"]), "curriculum": ["strings"]}
    assert expected["length_reward_frontier"] == ["strings:copy"] and handed["curriculum"] == ["strings"]
    for run in ("full", "cut"):
        assert json.loads((tmp_path / run / "stages" / "b" / "stage.json").read_text())["inherited"] == expected, run
    assert [r["step"] for r in read_rows(tmp_path / "cut")] == [1, 2, 3, 4]
    assert (tmp_path / "cut" / "cascade_report.html").is_file()
