"""`zrl run --resume` continues an interrupted cascade where it stopped.

1. A 2-stage cascade (SFT on arithmetic, then RL on the coin-flip environment) is SIGKILLed during the
   RL stage, after a checkpoint and after it logged a step past that checkpoint; `--resume` finishes it.
   The final metrics hold every step once (the interrupted run's rows after the checkpoint are
   replaced), the buffer's counters continue, both stages are exported and plotted, and no process
   of either run survives it.
2. SFT resume is exact: a run resumed from its step-2 checkpoint reproduces the losses and the final
   weights of the uninterrupted run (same data draws, optimizer state, schedule and RNG).
"""

import json
import logging
import os
import shutil
import signal
import time

import pytest
from e2e_testlib import (
    kill_marked,
    read_latest,
    read_rows,
    recipe,
    rl_stage,
    run_zrl,
    sft_stage,
    start_zrl,
    wait_until_gone,
    write_recipe,
    zrl_env,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SFT_STEPS, RL_STEPS = 2, 8
TOTAL = SFT_STEPS + RL_STEPS
PROMPTS_PER_BATCH = 4


def _tensorboard_steps(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _interrupt_during_rl(proc, run_dir, timeout_s=600):
    """SIGKILL the driver once an RL checkpoint exists and a later step was logged.

    The driver is stopped (SIGSTOP) before the files are read, so what the test sees is exactly what the
    killed run left behind: only the driver writes metrics and latest.json."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        latest, rows = read_latest(run_dir), read_rows(run_dir)
        if latest and latest["stage"] == "rl" and any(r["step"] > latest["step"] for r in rows):
            os.kill(proc.pid, signal.SIGSTOP)
            latest, rows = read_latest(run_dir), read_rows(run_dir)
            if any(r["step"] > latest["step"] for r in rows) and latest["step"] < TOTAL:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return latest, rows
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.1)
    raise AssertionError("no RL checkpoint followed by a logged step within the time limit")


def test_sigkilled_cascade_resumes_to_the_end(tmp_path, tmp_path_factory):
    run_dir = tmp_path / "run"
    data = recipe(run_dir, tmp_path_factory.getbasetemp() / "tiny-model", tensorboard=True,
                  stages=[sft_stage(steps=SFT_STEPS), rl_stage(steps=RL_STEPS, checkpoint_every_steps=3)])
    path = write_recipe(tmp_path / "recipe.yaml", data)
    env = zrl_env()
    marker = env["ZRL_TEST_MARKER"]
    try:
        proc = start_zrl(["run", str(path)], env, tmp_path / "first.log")
        latest, rows_at_kill = _interrupt_during_rl(proc, run_dir)
        # The driver's Ray head (GCS, raylet) shares its fate and the workers follow within seconds; the
        # raylet's agents would outlive it by about a minute, but the driver's reaper kills them.
        killed_at = time.monotonic()
        assert wait_until_gone(marker, timeout_s=15) == {}, "the killed driver left processes running"
        logging.getLogger(__name__).info("fault: driver SIGKILLed | nothing of it running %.1f s later",
                                         time.monotonic() - killed_at)

        rc = run_zrl(["run", str(path)], env, tmp_path / "fresh.log")
        assert rc == 2 and "--resume" in (tmp_path / "fresh.log").read_text()

        rc = run_zrl(["run", str(path), "--resume"], env, tmp_path / "resume.log")
        log = (tmp_path / "resume.log").read_text()
        assert rc == 0, log[-6000:]
        assert wait_until_gone(marker, timeout_s=30) == {}, "processes of the killed or the resumed run are alive"
    finally:
        kill_marked(marker)

    ckpt = latest["step"]
    assert SFT_STEPS < ckpt < TOTAL and ckpt % 3 == 0
    assert f"resuming from trainer step {ckpt} of stage 'rl'" in log
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TOTAL + 1))
    # Rows up to the checkpoint are the interrupted run's, untouched; later ones are the resumed run's.
    before = {r["step"]: r for r in rows_at_kill}
    assert all(r == before[r["step"]] for r in rows if r["step"] <= ckpt)
    replaced = [s for s in before if s > ckpt]
    assert replaced and all(rows[s - 1]["time"] > before[s]["time"] for s in replaced)
    assert [r["optim/version"] for r in rows] == [float(s) for s in range(1, TOTAL + 1)]

    # The buffer continues from its checkpointed counters: one batch released per RL step, none twice.
    resumed = rows[ckpt]
    assert resumed["buffer/released"] == before[ckpt]["buffer/released"] + PROMPTS_PER_BATCH
    last = rows[-1]
    assert last["buffer/released"] == RL_STEPS * PROMPTS_PER_BATCH
    assert last["buffer/received"] == last["buffer/dropped_zero_signal"] + last["buffer/admitted"]
    assert last["ledger/duplicates"] == 0 and last["ledger/prompts"] == last["buffer/received"]  # no prompt twice
    assert last["buffer/admitted"] == (last["buffer/released"] + last["buffer/evicted_capacity"]
                                       + last["buffer/evicted_stale"] + last["buffer/discarded_on_resume"]
                                       + last["buffer/occupancy"])
    assert max(r["batch/max_staleness"] for r in rows if "batch/max_staleness" in r) <= 2

    # Rollout workers continued their prompt streams instead of restarting them.
    def worker_draws(step):
        state = json.loads((run_dir / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())
        return state["data_state"]["workers"][0]["prompt_source"]["draws"]
    assert worker_draws(TOTAL) > worker_draws(ckpt)

    # TensorBoard shows each step once: the reader discards the interrupted run's events past the resume point.
    assert _tensorboard_steps(run_dir / "tensorboard", "optim/version") == list(range(1, TOTAL + 1))

    for name, last_step in (("sft", SFT_STEPS), ("rl", TOTAL)):
        stage_dir = run_dir / "stages" / name
        assert (stage_dir / "hf" / "config.json").is_file()
        assert (stage_dir / "summary.png").stat().st_size > 10_000
        assert json.loads((stage_dir / "stage.json").read_text())["last_step"] == last_step
    assert read_latest(run_dir)["step"] == TOTAL
    assert not (run_dir / "driver.json").exists()


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
