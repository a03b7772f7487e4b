"""Fitting a plan's workload to a run's metric rows (zrl.plan.calibrate)."""

import math

import pytest

from zrl.config.schema import RLStage
from zrl.plan.calibrate import fit_workload, measured

STAGE = RLStage(name="s", steps=10, environments=[{"name": "e"}],
                sampling={"prompts_per_batch": 4, "group_size": 4, "max_response_tokens": 64})


def rows(n=5, window_s=2.0, mean_lengths=(30, 34, 26, 30)):
    """Steps of 16 responses; the engine busy half of each window at 400 tokens/s of the window."""
    out = []
    for i in range(n):
        mean = mean_lengths[i % len(mean_lengths)]
        out.append({"time": i * window_s, "batch/num_sequences": 16, "batch/num_response_tokens": 16 * mean,
                    "batch/input_tokens": 16 * (mean + 10), "throughput/rollout_idle_frac": 0.5,
                    "throughput/rollout_tokens_per_s": 400.0, "throughput/trainer_idle_frac": 0.75,
                    "perf/tokens_per_s": 2000.0, "sync/engine_update_s": 0.2,
                    "buffer/dropped_zero_signal": i, "buffer/received": 10 * (i + 1),
                    "staleness/cumulative_0": 3 * i, "staleness/cumulative_1": i})
    return out


def test_fit_reads_each_model_from_the_rows():
    r = rows()
    w = fit_workload(r, STAGE, rollout_workers=1)
    steady = [row["batch/num_response_tokens"] / 16 for row in r[1:]]  # 34, 26, 30, 30
    assert w.notes["mean_response_tokens"] == pytest.approx(sum(steady) / 4)
    assert w.notes["response_tokens_std"] == pytest.approx(math.sqrt(8) * 4)  # std of the means x sqrt(16)
    assert w.prompt_tokens == 10
    assert w.notes["rollout_tokens_per_busy_s"] == pytest.approx(800.0)  # 400/s of the window, busy half of it
    assert w.trainer.tokens_per_s == 2000.0
    # the loop's call takes a quarter of each 2 s window, the rank's compute 16 x (mean + 10) / 2000 s
    assert w.trainer.overhead_s == pytest.approx(0.5 - 16 * 40 / 2000)
    assert w.sync_s == pytest.approx(0.2)
    assert w.zero_signal_fraction == pytest.approx(4 / 50)


def test_fit_needs_three_rows():
    with pytest.raises(ValueError, match="at least 3"):
        fit_workload(rows(n=2), STAGE, rollout_workers=1)


def test_measured_counts_steps_after_the_first():
    m = measured(rows(n=5, window_s=3.0), max_staleness_steps=1)
    assert m["steps_per_min"] == pytest.approx(60 * 4 / 12)
    assert (m["rollout_idle"], m["trainer_idle"]) == (0.5, 0.75)
    assert m["staleness"] == {0: 12, 1: 4}
