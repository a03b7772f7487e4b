"""Faults of the run as a whole, on `zrl run` in a subprocess (embedded Ray): a trainer rank killed
mid-stage (the controller restarts the trainer pool from the latest checkpoint), and Ctrl-C (SIGINT to
the terminal's process group: a checkpoint at the next step boundary, the resume command, exit 130,
no traceback, nothing left running; the resumed run finishes with every step and prompt once).
The SIGKILLed driver is tests/e2e/test_resume.py. The numbers are logged for bench/results/faults_cpu.md.
"""

import logging
import os
import signal
import time

import pytest
from e2e_testlib import kill_marked, marked_processes, read_latest, read_rows, recipe, rl_stage, start_zrl, \
    wait_until_gone, write_recipe, zrl_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 8
log = logging.getLogger(__name__)


def wait_for(condition, proc, what: str, timeout_s: float = 600):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.2)


def assert_every_step_and_prompt_once(run_dir) -> dict:
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    assert last["ledger/duplicates"] == 0 and last["ledger/prompts"] == last["buffer/received"]
    return last


def start_run(tmp_path, tmp_path_factory, checkpoint_every_steps: int):
    """`zrl run` of an 8-step RL recipe in a subprocess: (run dir, recipe path, env, marker, process)."""
    run_dir = tmp_path / "run"
    data = recipe(run_dir, tmp_path_factory.getbasetemp() / "tiny-model",
                  stages=[rl_stage(steps=STEPS, checkpoint_every_steps=checkpoint_every_steps)])
    path = write_recipe(tmp_path / "recipe.yaml", data)
    env = zrl_env()
    proc = start_zrl(["run", str(path)], env, tmp_path / "first.log")
    return run_dir, path, env, env["ZRL_TEST_MARKER"], proc


def test_a_killed_trainer_rank_restarts_the_pool_from_the_latest_checkpoint(tmp_path, tmp_path_factory):
    run_dir, path, env, marker, proc = start_run(tmp_path, tmp_path_factory, checkpoint_every_steps=2)
    try:
        wait_for(lambda: len(read_rows(run_dir)) >= 3, proc, "step 3")
        ranks = [pid for pid, cmd in marked_processes(marker).items() if "TrainerRank" in cmd]
        assert ranks, "no trainer rank process found"
        killed_at, step_at_kill = time.monotonic(), len(read_rows(run_dir))
        os.kill(ranks[-1], signal.SIGKILL)
        wait_for(lambda: max((r["step"] for r in read_rows(run_dir)), default=0) > step_at_kill
                 and read_latest(run_dir) is not None, proc, "a step after the restart")
        recovered_s = time.monotonic() - killed_at
        rc = proc.wait(timeout=600)
        text = (tmp_path / "first.log").read_text()
        assert rc == 0, text[-6000:]
        assert wait_until_gone(marker, timeout_s=30) == {}
    finally:
        kill_marked(marker)
    failure = [line for line in text.splitlines() if "failed during" in line]
    assert failure and "trainer rank" in failure[0], text[-4000:]
    assert "restarting the trainer pool from the checkpoint at trainer step" in text
    last = assert_every_step_and_prompt_once(run_dir)
    restart_step = int(text.split("restarting the trainer pool from the checkpoint at trainer step ")[1].split()[0])
    log.info("fault: trainer rank killed at step %d | outcome: pool restarted from step %d, run completed | lost: "
             "%d trained step(s) redone | duplicated: %d | time to the next new step: %.0f s | message: %s",
             step_at_kill, restart_step, step_at_kill - restart_step, last["ledger/duplicates"], recovered_s,
             failure[0].split("] ", 1)[-1])


def test_ctrl_c_checkpoints_at_the_next_step_and_the_run_resumes(tmp_path, tmp_path_factory):
    run_dir, path, env, marker, proc = start_run(tmp_path, tmp_path_factory, checkpoint_every_steps=50)
    try:
        wait_for(lambda: len(read_rows(run_dir)) >= 2, proc, "step 2")
        interrupted_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        rc = proc.wait(timeout=300)
        stop_s = time.monotonic() - interrupted_at
        first = (tmp_path / "first.log").read_text()
        assert wait_until_gone(marker, timeout_s=30) == {}, "processes of the interrupted run are alive"
        rc_resumed = None
        latest, rows_at_stop = read_latest(run_dir), len(read_rows(run_dir))
        if rc == 130:
            resumed = start_zrl(["run", str(path), "--resume"], env, tmp_path / "resume.log")
            rc_resumed = resumed.wait(timeout=600)
    finally:
        kill_marked(marker)
    assert rc == 130, first[-6000:]
    assert "Traceback" not in first, first[-6000:]
    stop_lines = [line for line in first.splitlines() if "stopped on SIGINT at trainer step" in line]
    assert len(stop_lines) == 1, first[-4000:]
    step = int(stop_lines[0].split("stopped on SIGINT at trainer step ")[1].split(";")[0])
    assert f"resume with: zrl run {path} --resume" in stop_lines[0]
    assert latest["step"] == step == rows_at_stop and 2 <= step < STEPS
    second = (tmp_path / "resume.log").read_text()
    assert rc_resumed == 0, second[-6000:]
    last = assert_every_step_and_prompt_once(run_dir)
    log.info("fault: Ctrl-C at step >= 2 | outcome: checkpoint at step %d, exit 130 after %.1f s, resumed to step %d | "
             "lost: 0 trained steps | duplicated: %d | message: %s", step, stop_s, STEPS, last["ledger/duplicates"],
             stop_lines[0].split("] ", 1)[-1])
