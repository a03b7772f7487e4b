"""Fault tolerance: killing the rollout worker mid-stage does not stop the stage, and counts stay consistent."""

import json
import threading
import time
from pathlib import Path

import pytest
from pipeline_testlib import recipe_data

from zrl.config import parse_recipe
from zrl.runtime_env import apply_defaults

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HERE = Path(__file__).resolve().parent
STEPS = 6


def test_killed_rollout_worker_is_restarted_and_the_stage_completes(tmp_path, tmp_path_factory, monkeypatch):
    import ray

    from zrl.pipeline.controller import Cascade
    from zrl.run import prepare_model

    monkeypatch.setenv("PYTHONPATH", str(HERE))
    apply_defaults()
    recipe = parse_recipe(recipe_data(tmp_path, tmp_path_factory.getbasetemp() / "tiny-model", steps=STEPS))
    model_path = prepare_model(recipe)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        cascade = Cascade(recipe, model_path)
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.update(step=cascade.run()), daemon=True)
        runner.start()
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert runner.is_alive() and time.monotonic() < deadline, "the stage did not reach step 2"
            time.sleep(0.5)
        [worker] = cascade.rollout_pool.actors
        ray.kill(worker, no_restart=False)  # Ray restarts it (max_restarts=1)
        runner.join(timeout=600)
        assert not runner.is_alive() and outcome.get("step") == STEPS
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    assert last["faults/worker_restarts"] == 1
    assert last["buffer/received"] == last["buffer/dropped_zero_signal"] + last["buffer/admitted"]
    assert last["buffer/admitted"] == (last["buffer/released"] + last["buffer/evicted_capacity"]
                                       + last["buffer/evicted_stale"] + last["buffer/occupancy"])
    assert max(r["batch/max_staleness"] for r in rows) <= 2
