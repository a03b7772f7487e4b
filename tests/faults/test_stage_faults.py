"""Faults inside an RL stage, injected into a real cascade (Ray actors, vLLM engine, 2 FSDP2 ranks):
a rollout worker killed twice, verifiers that return garbage, hang or always raise, a prompt source
that stalls. For each: the outcome, what was lost, what was duplicated (the prompt ledger), the time
to recover. The numbers are logged (the fault table in bench/results/faults_cpu.md comes from them).

One Ray instance serves the module; each test runs its own cascade in it.
"""

import json
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from pipeline_testlib import recipe_data

from zrl.config import parse_recipe
from zrl.runtime_env import apply_defaults

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HERE = Path(__file__).resolve().parent
PIPELINE = HERE.parent / "integration" / "pipeline"
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def ray_session():
    import os

    import ray

    caller = filter(None, [os.environ.get("PYTHONPATH")])  # e.g. the tree under test
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(PIPELINE), *caller])
    apply_defaults()
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def make_recipe(tmp_path, model_dir, env: str, steps: int, **asynchrony):
    data = recipe_data(tmp_path, model_dir, steps=steps, **asynchrony)
    data["stages"][0]["environments"] = [{"name": env}]
    return parse_recipe(data)


def rows_of(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_cascade(recipe):
    """Run the cascade to its end; returns (final step or the exception it raised, seconds)."""
    from zrl.pipeline.controller import Cascade
    from zrl.run import prepare_model

    started = time.monotonic()
    try:
        outcome = Cascade(recipe, prepare_model(recipe)).run()
    except Exception as exc:  # the outcome under test
        outcome = exc
    return outcome, time.monotonic() - started


def assert_exactly_once(last: dict) -> None:
    assert last["ledger/duplicates"] == 0
    assert last["ledger/prompts"] == last["buffer/received"]
    assert last["buffer/received"] == last["buffer/dropped_zero_signal"] + last["buffer/admitted"]


def test_rollout_worker_killed_twice_trains_no_prompt_twice(ray_session, tmp_path, tmp_path_factory):
    """Two RL stages; the second takes the first one's rollout worker over, and that worker is killed twice
    in it: Ray restarts it with the first stage's arguments, and it must come back into the second."""
    ray = ray_session
    from zrl.pipeline.controller import Cascade
    from zrl.run import prepare_model

    steps, first_steps = 8, 2
    data = recipe_data(tmp_path, tmp_path_factory.getbasetemp() / "tiny-model", steps=steps - first_steps)
    data["stages"].insert(0, {**data["stages"][0], "name": "warm", "steps": first_steps,
                              "sampling": {**data["stages"][0]["sampling"], "max_response_tokens": 4}})
    recipe = parse_recipe(data)
    cascade = Cascade(recipe, prepare_model(recipe))
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(step=cascade.run()), daemon=True)
    runner.start()
    recovery, workers = [], []
    for at_step in (1, 4, 6):
        deadline = time.monotonic() + 600
        while len(rows_of(tmp_path)) < at_step:
            assert runner.is_alive() and time.monotonic() < deadline, f"the stage did not reach step {at_step}"
            time.sleep(0.2)
        [worker] = cascade.rollout_pool.actors
        workers.append(worker._actor_id.hex())
        if at_step == 1:
            continue
        killed_at, rows_before = time.monotonic(), len(rows_of(tmp_path))
        ray.kill(worker, no_restart=False)  # Ray restarts it (max_worker_restarts 3)
        while len(rows_of(tmp_path)) == rows_before and runner.is_alive():
            time.sleep(0.2)
        recovery.append(time.monotonic() - killed_at)
    runner.join(timeout=600)
    assert not runner.is_alive() and outcome.get("step") == steps
    assert len(set(workers)) == 1, "the second stage started a rollout worker of its own"
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    assert last["faults/worker_restarts"] == 2
    assert_exactly_once(last)
    assert max(r["batch/max_staleness"] for r in rows) <= 2
    log.info("fault: rollout worker killed twice | outcome: stage completed (%d steps) | lost: %d group(s) in its "
             "engine | duplicated: %d | time to the next step after each kill: %s s", steps,
             last["faults/lost_groups"], last["ledger/duplicates"], ", ".join(f"{t:.1f}" for t in recovery))


def test_verifier_garbage_and_hangs_cost_only_their_rewards(ray_session, tmp_path, tmp_path_factory):
    steps = 6
    recipe = make_recipe(tmp_path, tmp_path_factory.getbasetemp() / "tiny-model", "fault_envs:GarbageOrHang", steps,
                         verifier_timeout_s=1.0)
    outcome, seconds = run_cascade(recipe)
    assert outcome == steps, outcome
    rows = rows_of(tmp_path)
    last = rows[-1]
    assert_exactly_once(last)
    assert last["env/verifier_errors"] > last["faults/verifier_timeouts"] > 0  # garbage and hangs: reward 0
    log.info("fault: verifier returns garbage (~30%%) or hangs (~3%%) | outcome: stage completed (%d steps in "
             "%.0f s) | lost: %d reward(s) scored 0 with an error (%d of them timed out) | duplicated: %d", steps,
             seconds, last["env/verifier_errors"], last["faults/verifier_timeouts"], last["ledger/duplicates"])


def stop_message(tmp_path, tmp_path_factory, env: str, steps: int, **asynchrony) -> tuple[str, float]:
    """Run a cascade that must stop: its one-line StageStopped message and the seconds it took."""
    from zrl.pipeline.faults import StageStopped

    recipe = make_recipe(tmp_path, tmp_path_factory.getbasetemp() / "tiny-model", env, steps, **asynchrony)
    outcome, seconds = run_cascade(recipe)
    assert isinstance(outcome, StageStopped), outcome
    assert "\n" not in str(outcome)
    return str(outcome), seconds


def test_a_verifier_that_always_raises_stops_the_stage_with_the_reason(ray_session, tmp_path, tmp_path_factory,
                                                                      caplog):
    with caplog.at_level(logging.WARNING, logger="zrl"):
        message, seconds = stop_message(tmp_path, tmp_path_factory, "fault_envs:AlwaysRaises", 4,
                                        max_discarded_batches=3)
    assert int(re.search(r"the last (\d+) groups were all discarded", message)[1]) >= 12  # 3 batches of 4
    assert "ConnectionError: reward service unreachable" in message
    # every rollout's verifier raised the same error: the driver's console shows it once, under the entry's key
    shown = [r.getMessage() for r in caplog.records if r.getMessage().startswith("environment ")]
    assert shown == ["environment 'always_raises': ConnectionError: reward service unreachable (the "
                     "rollout's reward is 0; each distinct error is shown once)"]
    assert rows_of(tmp_path) == []  # no step trained
    log.info("fault: verifier always raises | outcome: stopped after %.0f s: %s", seconds, message)


def test_a_stalled_prompt_source_stops_the_stage_with_the_reason(ray_session, tmp_path, tmp_path_factory):
    message, seconds = stop_message(tmp_path, tmp_path_factory, "fault_envs:StallingSource", 8, progress_timeout_s=20.0)
    assert "no trainer step completed in" in message and "progress_timeout_s" in message
    log.info("fault: prompt source stalls after 4 draws | outcome: stopped after %.0f s (%d steps trained): %s",
             seconds, len(rows_of(tmp_path)), message)


def test_a_reward_model_actor_killed_mid_stage_costs_only_its_groups_rewards(ray_session, tmp_path, tmp_path_factory):
    ray = ray_session
    from zrl.config.schema import RewardModelSpec
    from zrl.pipeline.controller import Cascade
    from zrl.run import prepare_model

    steps = 6
    recipe = make_recipe(tmp_path, tmp_path_factory.getbasetemp() / "tiny-model", "fault_envs:ScoresEveryResponse",
                         steps)
    stage = recipe.stages[0].model_copy(update={"algorithm": recipe.stages[0].algorithm.model_copy(
        update={"advantage": "grpo"})})
    recipe = recipe.model_copy(update={"stages": [stage], "reward_model": RewardModelSpec(
        path=str(tmp_path_factory.getbasetemp() / "tiny-rm"), build_tiny_if_missing=True, dtype="float32",
        max_tokens=128)})
    recipe.resources.cpus_per_reward_model_worker = 0.0
    cascade = Cascade(recipe, prepare_model(recipe))
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(step=cascade.run()), daemon=True)
    runner.start()
    deadline = time.monotonic() + 600
    while len(rows_of(tmp_path)) < 2:
        assert runner.is_alive() and time.monotonic() < deadline, "the stage did not reach step 2"
        time.sleep(0.2)
    killed_at = time.monotonic()
    ray.kill(ray.get_actor("zrl-reward-model-0"), no_restart=False)  # Ray restarts it (max_restarts=-1)
    runner.join(timeout=600)
    assert not runner.is_alive() and outcome.get("step") == steps, outcome
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    last = rows[-1]
    assert_exactly_once(last)
    # Scoring works again after the restart: the last window's responses were all scored.
    scored = [r["verify/scores_every_response/scored"] for r in rows if "verify/scores_every_response/scored" in r]
    assert scored[-1] == 1.0, scored
    with pytest.raises(ValueError):  # the cascade stopped its reward-model actors with the stage
        ray.get_actor("zrl-reward-model-0")
    log.info("fault: reward-model actor killed at step 2 | outcome: stage completed (%d steps, %.0f s after the "
             "kill) | lost: %d reward(s) scored 0 with an error | duplicated: %d", steps,
             time.monotonic() - killed_at, last["env/verifier_errors"], last["ledger/duplicates"])
