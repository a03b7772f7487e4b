"""How `zrl run` ends when a stage stops (zrl/run.py `_run`), with a stand-in cascade and no Ray: trainer
failures restart from the latest checkpoint while `resources.trainer_restarts` allows, every other stop
is one log line with the resume command and its exit code."""

import errno
import json
import logging
import signal
from pathlib import Path

import pytest
import yaml

from zrl import run as run_module
from zrl.config import parse_recipe
from zrl.pipeline import controller
from zrl.pipeline.faults import Interrupted, StageStopped, TrainerFailed

RESUME = "zrl run r.yaml --resume"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipe(tmp_path):
    data = yaml.safe_load((ROOT / "recipes" / "tiny-cpu.yaml").read_text())
    data["output_dir"] = str(tmp_path / "run")
    data["resources"]["trainer_restarts"] = 1
    return parse_recipe(data)


def fake_run(monkeypatch, outcomes: list):
    """Each Cascade(...).run() takes the next outcome: an exception to raise or a step to return."""
    starts = []

    class FakeCascade:
        def __init__(self, recipe, model_path, resume=None):
            starts.append(resume)

        def run(self):
            outcome = outcomes.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

    class FakeRay:
        def cluster_resources(self):
            return {"CPU": 64.0, "GPU": 0.0}

        def shutdown(self):
            pass

    monkeypatch.setattr(controller, "Cascade", FakeCascade)
    monkeypatch.setattr(run_module, "connect_ray", lambda address: FakeRay())
    monkeypatch.setattr(run_module, "prepare_model", lambda recipe: "model")
    return starts


def checkpoint_at(recipe, step: int) -> None:
    checkpoints = Path(recipe.output_dir) / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    (checkpoints / "latest.json").write_text(json.dumps({"stage": "copy_rl", "step": step,
                                                         "path": str(checkpoints / f"step_{step:06d}")}))


def stop_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_failed_trainer_rank_restarts_from_the_latest_checkpoint_within_the_budget(recipe, monkeypatch, caplog):
    checkpoint_at(recipe, 170)
    failure = TrainerFailed("trainer rank 1 failed during step 171: ActorDiedError")
    starts = fake_run(monkeypatch, [failure, 190])
    assert run_module._run(recipe, None, None, RESUME) == 0
    assert starts[0] is None and starts[1].step == 170

    starts = fake_run(monkeypatch, [failure, failure])
    assert run_module._run(recipe, None, None, RESUME) == 1
    assert stop_lines(caplog)[-1] == ("trainer rank 1 failed during step 171: ActorDiedError (resources.trainer_restarts "
                                      f"used up); latest checkpoint: trainer step 170; resume with: {RESUME}")


def test_no_checkpoint_no_restart(recipe, monkeypatch, caplog):
    fake_run(monkeypatch, [TrainerFailed("trainer rank 0 failed during step 3: boom")])
    assert run_module._run(recipe, None, None, RESUME) == 1
    assert stop_lines(caplog)[-1] == ("trainer rank 0 failed during step 3: boom (no checkpoint to restart from); no "
                                      "checkpoint was saved")


@pytest.mark.parametrize("outcome, code, line", [
    (StageStopped("stage 'copy_rl' stopped: no trainer step completed in 3601 s"), 1,
     "stage 'copy_rl' stopped: no trainer step completed in 3601 s"),
    (Interrupted(175, signal.SIGTERM), 143, "zrl run stopped on SIGTERM at trainer step 175"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/tensorboard/events.out"), 1,
     "writing /runs/x/tensorboard/events.out failed: No space left on device"),
])
def test_every_other_stop_is_one_line_with_the_resume_command(recipe, monkeypatch, caplog, outcome, code, line):
    checkpoint_at(recipe, 175)
    fake_run(monkeypatch, [outcome])
    assert run_module._run(recipe, None, None, RESUME) == code
    assert stop_lines(caplog) == [f"{line}; latest checkpoint: trainer step 175; resume with: {RESUME}"]


def test_a_rollback_resumes_from_the_newest_checkpoint_at_or_before_the_healthy_step(recipe, monkeypatch, caplog):
    from zrl.pipeline.health import RollBack, read_alarms

    checkpoints = Path(recipe.output_dir) / "checkpoints"
    for step in (160, 170, 180):  # the SFT stage ends at 160, copy_rl covers 161-190
        (checkpoints / f"step_{step:06d}").mkdir(parents=True)
    checkpoint_at(recipe, 180)
    starts = fake_run(monkeypatch, [RollBack("stage 'copy_rl' stopped at step 183: canary: ...", "copy_rl", 183, 178),
                                    RollBack("stage 'copy_rl' stopped at step 171: ...", "copy_rl", 171, 165),
                                    190])
    assert run_module._run(recipe, None, None, RESUME) == 0
    assert [(s.stage, s.step) for s in starts[1:]] == [("copy_rl", 170), ("sft_warm_start", 160)]
    assert json.loads((checkpoints / "latest.json").read_text())["step"] == 160  # a crash now resumes there
    assert [(a["step"], a["good_step"]) for a in read_alarms(Path(recipe.output_dir) / "alarms.jsonl")] == [
        (183, 170), (171, 160)]

    starts = fake_run(monkeypatch, [RollBack("stage 'copy_rl' stopped at step 2: ...", "copy_rl", 2, 1)])
    for path in checkpoints.glob("step_*"):
        path.rmdir()
    assert run_module._run(recipe, None, None, RESUME) == 1
    assert "(no checkpoint at or before step 1 to roll back to)" in stop_lines(caplog)[-1]


def test_an_embedded_ray_is_its_own_instance_even_beside_a_running_cluster(monkeypatch):
    import ray

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    run_module.connect_ray(None)
    assert calls[0].get("address") == "local" and calls[0]["num_cpus"] >= 1, calls
