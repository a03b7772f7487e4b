"""Faults of the run as a whole, on `zrl run` in a subprocess (embedded Ray), one after the other in one
run: a trainer rank killed mid-stage (the controller restarts the trainer pool from the latest
checkpoint), then Ctrl-C (SIGINT to the terminal's process group: a checkpoint at the next step boundary,
the resume command, exit 130, no traceback, nothing left running; the resumed run finishes with every step
and prompt once).
The SIGKILLed driver is tests/e2e/test_curriculum_stage.py (its adaptive run is killed and resumed).
The numbers are logged for bench/results/faults_cpu.md.
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


def test_a_killed_trainer_rank_restarts_the_pool_then_ctrl_c_checkpoints_and_the_run_resumes(tmp_path,
                                                                                             tmp_path_factory):
    """Both faults in one run: a trainer rank SIGKILLed at step 3, then Ctrl-C once a step after the restart was
    logged, then `--resume` to the end."""
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
        log_offset = (tmp_path / "first.log").stat().st_size  # what the run wrote before the Ctrl-C
        interrupted_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        rc = proc.wait(timeout=300)
        stop_s = time.monotonic() - interrupted_at
        text = (tmp_path / "first.log").read_text()
        assert wait_until_gone(marker, timeout_s=30) == {}, "processes of the interrupted run are alive"
        rc_resumed = None
        latest, rows_at_stop = read_latest(run_dir), len(read_rows(run_dir))
        if rc == 130:
            resumed = start_zrl(["run", str(path), "--resume"], env, tmp_path / "resume.log")
            rc_resumed = resumed.wait(timeout=600)
    finally:
        kill_marked(marker)
    failure = [line for line in text.splitlines() if "failed during" in line]
    assert failure and "trainer rank" in failure[0], text[-4000:]
    assert "restarting the trainer pool from the checkpoint at trainer step" in text
    restart_step = int(text.split("restarting the trainer pool from the checkpoint at trainer step ")[1].split()[0])
    assert rc == 130, text[-6000:]
    after_ctrl_c = text[log_offset:]
    assert "Traceback" not in after_ctrl_c, after_ctrl_c[-6000:]
    stop_lines = [line for line in text.splitlines() if "stopped on SIGINT at trainer step" in line]
    assert len(stop_lines) == 1, text[-4000:]
    step = int(stop_lines[0].split("stopped on SIGINT at trainer step ")[1].split(";")[0])
    assert f"resume with: zrl run {path} --resume" in stop_lines[0]
    assert latest["step"] == step == rows_at_stop and step_at_kill < step < STEPS
    second = (tmp_path / "resume.log").read_text()
    assert rc_resumed == 0, second[-6000:]
    last = assert_every_step_and_prompt_once(run_dir)
    log.info("fault: trainer rank killed at step %d | outcome: pool restarted from step %d | lost: %d trained "
             "step(s) redone | duplicated: %d | time to the next new step: %.0f s | message: %s", step_at_kill,
             restart_step, step_at_kill - restart_step, last["ledger/duplicates"], recovered_s,
             failure[0].split("] ", 1)[-1])
    log.info("fault: Ctrl-C after the restart | outcome: checkpoint at step %d, exit 130 after %.1f s, resumed to "
             "step %d | lost: 0 trained steps | duplicated: %d | message: %s", step, stop_s, STEPS,
             last["ledger/duplicates"], stop_lines[0].split("] ", 1)[-1])
