"""Learning-health checks: which rows raise an alarm, once per onset; the stop and rollback requests; the
run's alarm record; the rollback's checkpoint."""

import json

import pytest

from zrl.config.schema import Health
from zrl.pipeline.faults import StageStopped
from zrl.pipeline.health import (HealthMonitor, RollBack, baseline_from_metrics, read_alarms, record_rollback,
                                 rollbacks_made, standard_error)


def monitor(tmp_path=None, **health):
    return HealthMonitor("rl", Health(**health), eval_samples=80, start_version=240,
                         alarms_path=None if tmp_path is None else tmp_path / "alarms.jsonl")


def evaluated(version, accuracy):
    return {"eval/policy_version": float(version), "eval/tools/accuracy": accuracy}


def test_held_out_accuracy_below_the_start_beyond_the_noise_raises_one_alarm_until_it_recovers(tmp_path):
    m = monitor(tmp_path)
    m.check_evaluation(evaluated(240, 0.35))  # the baseline: the policy the stage started from
    assert m.check(241, {}) == {"health/alarms": 0.0, "health/active": 0.0}
    # 2 standard errors of the difference at n = 80: 2 * hypot(se(0.35), se(0.275)) = 0.146
    m.check_evaluation(evaluated(242, 0.275))
    assert m.check(243, {})["health/alarms"] == 0  # within the noise
    m.check_evaluation(evaluated(244, 0.15))  # raised as it comes in, before any row carries it
    assert len(m.alarms) == 1 and m.alarms[0].step == 244
    assert m.check(245, {}) == {"health/alarms": 1.0, "health/active": 1.0}
    assert m.check(246, {})["health/active"] == 1.0  # no new evaluation: the latest verdict holds
    m.check_evaluation(evaluated(246, 0.1))
    assert m.check(247, {})["health/alarms"] == 1  # still the same onset
    m.check_evaluation(evaluated(248, 0.3))
    assert m.check(249, {}) == {"health/alarms": 1.0, "health/active": 0.0}
    m.check_evaluation(evaluated(250, 0.05))
    assert m.check(251, {})["health/alarms"] == 2  # a new onset
    alarms = read_alarms(tmp_path / "alarms.jsonl")
    assert [(a["step"], a["signal"], a["action"]) for a in alarms] == [(244, "held_out_drop", "warn"),
                                                                        (250, "held_out_drop", "warn")]
    assert "tools 0.150 at policy version 244 is below the stage's start 0.350" in alarms[0]["message"]


def test_standard_error_is_binomial():
    assert standard_error(0.5, 100) == pytest.approx(0.05) and standard_error(0.0, 10) == 0.0
    assert standard_error(0.3, 0) == 0.0


@pytest.mark.parametrize("row,signal", [
    ({"canary/lz77_flagged_fraction": 0.53}, "canary"),
    ({"canary/gibberish_frac": 0.3}, "canary"),
    ({"mismatch/onpolicy_kl_k3": 0.05, "mismatch/onpolicy_num_tokens": 2048.0}, "mismatch"),
])
def test_a_row_past_a_band_raises_its_signal(row, signal):
    m = monitor()
    assert m.check(241, {"canary/lz77_flagged_fraction": 0.0, "mismatch/onpolicy_kl_k3": 1e-8})["health/active"] == 0
    assert m.check(242, row) == {"health/alarms": 1.0, "health/active": 1.0}
    assert m.alarms[0].signal == signal and m.alarms[0].step == 242
    m.check(243, row)
    assert len(m.alarms) == 1  # reported at its onset only


def test_a_mismatch_over_a_handful_of_tokens_is_not_a_band_crossing():
    m = monitor()
    assert m.check(241, {"mismatch/onpolicy_kl_k3": 0.0225, "mismatch/onpolicy_num_tokens": 2.0})["health/active"] == 0
    assert m.check(242, {"mismatch/onpolicy_kl_k3": 0.0225, "mismatch/onpolicy_num_tokens": 32.0})["health/active"] == 1


def test_grad_norm_spikes_count_after_the_warmup_steps():
    m = monitor(grad_norm_warmup_steps=3, grad_norm_factor=10.0)
    assert m.check(241, {"grad/norm_total": 50.0})["health/active"] == 0  # before the warmup: no median yet
    for step, norm in zip((242, 243, 244), (0.2, 0.3, 0.25)):
        assert m.check(step, {"grad/norm_total": norm})["health/active"] == 0
    assert m.check(245, {"grad/norm_total": 2.5})["health/active"] == 0  # 2.5 < 10 x median(50, .2, .3, .25)
    assert m.check(246, {"grad/norm_total": 13.0})["health/active"] == 1  # 13 > 10 x 0.3 (median of five)
    assert "grad/norm_total 13 > 10 x the stage's median 0.3" in m.alarms[0].message


def test_a_null_threshold_turns_its_check_off():
    m = monitor(max_canary_frac=None, held_out_sigmas=None, max_mismatch_kl=None, grad_norm_factor=None)
    for step in range(241, 250):
        m.check_evaluation(evaluated(step - 1, 0.0 if step > 241 else 1.0))
        assert m.check(step, {"canary/lz77_flagged_fraction": 1.0, "mismatch/onpolicy_kl_k3": 9.0,
                              "grad/norm_total": 10.0 ** step})["health/active"] == 0


def test_warn_never_asks_to_stop_and_stop_asks_once_an_alarm_fired():
    quiet = monitor(on_alarm="warn")
    quiet.check(241, {"canary/lz77_flagged_fraction": 0.9})
    assert quiet.stop_request() is None
    m = monitor(on_alarm="stop")
    m.check(241, {"canary/lz77_flagged_fraction": 0.0})
    assert m.stop_request() is None
    m.check(242, {"canary/lz77_flagged_fraction": 0.9})
    stop = m.stop_request()
    assert type(stop) is StageStopped and str(stop).startswith("stage 'rl' stopped at step 242: canary:")


def test_rollback_goes_to_the_last_healthy_step_and_to_before_a_bad_evaluation(caplog):
    m = monitor(on_alarm="rollback", max_rollbacks=1)
    m.check_evaluation(evaluated(240, 0.4))
    for step in range(241, 246):
        m.check(step, {})
    m.check(246, {"canary/lz77_flagged_fraction": 0.9})
    request = m.stop_request()
    assert isinstance(request, RollBack) and (request.alarm_step, request.good_step) == (246, 245)
    # an evaluation of policy 244 that arrives after row 246 says the rows after 242's evaluation were not good
    m = monitor(on_alarm="rollback")
    m.check_evaluation(evaluated(240, 0.4))
    for step in range(241, 247):
        if step == 243:
            m.check_evaluation(evaluated(242, 0.41))
        m.check(step, {})
    m.check_evaluation(evaluated(244, 0.05))
    assert m.stop_request().good_step == 242
    used = HealthMonitor("rl", Health(on_alarm="rollback", max_rollbacks=1), eval_samples=80, start_version=240,
                         rollbacks=1)
    used.check(241, {"canary/gibberish_frac": 0.5})
    assert "the stage stops (health.on_alarm: rollback)" in caplog.messages[-1]
    stop = used.stop_request()
    assert type(stop) is StageStopped and "health.max_rollbacks=1 used up" in str(stop)


def test_the_record_counts_rollbacks_per_stage_and_keeps_the_baseline(tmp_path):
    path = tmp_path / "alarms.jsonl"
    assert read_alarms(path) == [] and rollbacks_made(path, "rl") == 0
    record_rollback(path, "rl", 266, 260)
    record_rollback(path, "other", 20, 10)
    assert rollbacks_made(path, "rl") == 1 and read_alarms(path)[0]["good_step"] == 260
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 241, "eval/policy_version": 240, "eval/tools/accuracy": 0.35}) + "\n"
                       + json.dumps({"step": 243, "eval/policy_version": 242, "eval/tools/accuracy": 0.2}) + "\n")
    assert baseline_from_metrics(metrics, 240) == {"tools": 0.35}
    assert baseline_from_metrics(metrics, 100) == {} and baseline_from_metrics(tmp_path / "none", 240) == {}
