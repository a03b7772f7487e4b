"""What an RL stage reports: the console line, the metric cadence and the workers' seeds."""

from zrl.config import parse_recipe
from zrl.pipeline.controller import Cascade
from zrl.pipeline.rollout_worker import worker_seeds
from zrl.pipeline.schedule import StageSchedule
from zrl.pipeline.stage_report import StageCounters, progress_line, step_count, step_metrics


def values(**extra):
    schedule = StageSchedule(num_workers=1, trainer_step=3, end_step=6, prompts_per_batch=2,
                             sync_every_steps=2, synchronous=False)
    return step_metrics(StageCounters(), schedule, {"loss/policy": 0.5}, {}, extra, window_s=2.0)


def test_the_row_holds_the_trained_batch_the_buffer_and_each_pools_throughput():
    schedule = StageSchedule(num_workers=1, trainer_step=3, end_step=6, prompts_per_batch=2,
                             sync_every_steps=2, synchronous=False)
    counters = StageCounters(generated_tokens=300)
    row = step_metrics(counters, schedule, {"batch/input_tokens": 500.0}, {"reward/mean": 0.5, "staleness/max": 1.0},
                       {"staleness/cumulative_max": 2.0}, window_s=2.0)
    assert (row["reward/mean"], row["staleness/max"], row["staleness/cumulative_max"]) == (0.5, 1.0, 2.0)
    assert row["throughput/rollout_tokens_per_s"] == 150 and row["throughput/trainer_tokens_per_s"] == 250


def test_the_line_counts_the_run_and_the_stage_step():
    assert progress_line(4, 6, 3, values()).startswith("step 4/6 (stage 1/3) | reward")
    assert step_count(270, 270, 30) == "step 270/270 (stage 30/30)"
    assert step_count(241, 270, 30) == "step 241/270 (stage 1/30)"


def test_a_step_without_new_groups_shows_no_reward_instead_of_nan():
    assert "| reward - |" in progress_line(4, 6, 3, values())
    assert "| reward 0.250 |" in progress_line(4, 6, 3, values(**{"reward/mean": 0.25}))


def test_the_line_names_each_adaptive_entrys_level_and_crossing():
    assert "level" not in progress_line(4, 6, 3, values())
    line = progress_line(4, 6, 3, values(**{"curriculum/strings/difficulty": 3.0, "curriculum/strings/mu_mean": 2.64,
                                         "curriculum/calibrating": 0.0}))
    assert line.endswith(" | level strings 3 (crossing 2.6)")


def test_metrics_are_logged_every_log_every_steps_and_at_each_stage_end():
    recipe = parse_recipe({
        "name": "cadence", "model": {"path": "unused"}, "output_dir": "/nonexistent/cadence",
        "metrics": {"log_every_steps": 3},
        "stages": [{"name": "a", "kind": "rl", "steps": 4, "environments": [{"name": "arithmetic"}]},
                   {"name": "b", "kind": "rl", "steps": 4, "environments": [{"name": "arithmetic"}]}]})
    cascade = Cascade(recipe, "unused")
    logged, written = [], []
    cascade.metrics = type("Sink", (), {"log": lambda self, step, v: logged.append((step, v["stage/index"]))})()
    for index, stage in enumerate(recipe.stages):
        log = cascade._log(stage)
        for step in range(4 * index + 1, 4 * index + 5):
            written.append(log(step, {}))
    assert logged == [(3, 0.0), (4, 0.0), (6, 1.0), (8, 1.0)]
    assert written == [False, False, True, True, False, True, False, True]  # the runner keeps what was not


def test_the_sampling_seed_offsets_every_workers_streams():
    assert worker_seeds(10, 0, 1) == (11, 10001)  # no offset: the stage's own streams
    assert worker_seeds(10, 5, 1) == (16, 15001)
    assert len({worker_seeds(10, 0, w) for w in range(4)}) == 4  # workers differ


def test_an_evaluation_goes_with_the_next_row_and_what_no_row_carried_is_logged_at_the_end():
    import time
    from types import SimpleNamespace

    from zrl.pipeline.stage_report import StageReporter

    rows = []
    reporter = StageReporter("s", 3, StageCounters(), lambda step, values: rows.append((step, values)) or True)
    schedule = StageSchedule(num_workers=2, trainer_step=3, end_step=6, prompts_per_batch=2,
                             sync_every_steps=2, synchronous=False)
    report = SimpleNamespace(policy_version=2, seconds=1.0,
                             results=(("e", SimpleNamespace(accuracy=0.5, mean_response_tokens=10.0, metadata_means={})),))
    reporter.evaluated(report, worker=0)
    reporter.step(time.perf_counter(), schedule, {}, {}, {}, [{"e": {"timeouts": 1.0}}, {"e": {"timeouts": 2.0}}])
    step, row = rows[0]
    assert step == 3 and row["eval/e/accuracy"] == 0.5 and row["eval/policy_version"] == 2.0
    assert row["env/e/timeouts"] == 3.0  # summed over the workers
    reporter.flush_evaluation(3)
    assert len(rows) == 1  # the row carried it
    reporter.evaluated(report, worker=1)
    reporter.flush_evaluation(4)
    assert rows[1] == (4, {"eval/policy_version": 2.0, "eval/e/accuracy": 0.5, "eval/e/response_tokens_mean": 10.0})


def test_the_health_monitor_checks_each_row_and_each_evaluation_as_it_comes_in():
    import time
    from types import SimpleNamespace

    from zrl.config.schema import Health
    from zrl.pipeline.health import HealthMonitor
    from zrl.pipeline.stage_report import StageReporter

    rows = []
    reporter = StageReporter("s", 3, StageCounters(), lambda step, values: rows.append((step, values)) or True)
    reporter.health = HealthMonitor("s", Health(), eval_samples=200, start_version=3)
    schedule = StageSchedule(num_workers=1, trainer_step=3, end_step=6, prompts_per_batch=2,
                             sync_every_steps=1, synchronous=False)

    def evaluation(version, accuracy):
        return SimpleNamespace(policy_version=version, seconds=1.0, results=(
            ("e", SimpleNamespace(accuracy=accuracy, mean_response_tokens=10.0, metadata_means={})),))

    reporter.evaluated(evaluation(3, 0.6), worker=0)
    reporter.step(time.perf_counter(), schedule, {}, {}, {"canary/lz77_flagged_fraction": 0.5}, [])
    assert rows[-1][1]["health/alarms"] == 1 and reporter.health.alarms[0].signal == "canary"
    reporter.evaluated(evaluation(4, 0.1), worker=0)  # no row needed: a collapsed stage may make none
    assert [a.signal for a in reporter.health.alarms] == ["canary", "held_out_drop"]
