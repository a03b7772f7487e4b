"""The stop logic of zrl/pipeline/faults.py without Ray: watchdog reasons, the stop request."""

import signal

import pytest

from zrl.pipeline.faults import Interrupted, ProgressWatchdog, StopRequest, raise_if_stop_requested


def test_watchdog_stops_after_n_discarded_groups_in_a_row_and_names_the_kinds():
    w = ProgressWatchdog(progress_timeout_s=1e9, max_discarded_groups=6)
    for _ in range(3):
        w.group_verified(["ConnectionError: down"] * 4)
        w.group_admitted("dropped_zero_signal")
    w.prompts_skipped(2)
    assert w.reason() is None  # 5 in a row
    w.group_admitted("duplicate")
    reason = w.reason()
    assert reason.startswith("the last 6 groups were all discarded: 3 dropped with zero signal")
    assert "12 verifier error(s), e.g. 'ConnectionError: down'" in reason
    assert "2 prompt(s) skipped" in reason and "1 repeat(s)" in reason and "max_discarded_batches" in reason


def test_a_buffered_group_resets_the_discard_run():
    w = ProgressWatchdog(progress_timeout_s=1e9, max_discarded_groups=3)
    w.group_admitted("dropped_zero_signal")
    w.group_admitted("dropped_zero_signal")
    w.group_admitted("buffered")
    w.group_admitted("dropped_zero_signal")
    w.group_admitted("evicted_stale")  # admitted (then evicted): the stage is not stuck on its inputs
    w.group_admitted("dropped_zero_signal")
    assert w.discarded_in_a_row == 1 and w.reason() is None


def test_watchdog_stops_when_no_step_completes_in_time():
    w = ProgressWatchdog(progress_timeout_s=100, max_discarded_groups=10)
    start = w.last_progress
    assert w.reason(now=start + 99) is None
    assert w.reason(now=start + 101) == "no trainer step completed in 101 s (asynchrony.progress_timeout_s)"
    w.step_done()
    assert w.reason(now=w.last_progress + 50) is None


def test_the_first_signal_requests_a_stop_at_a_step_boundary_the_second_stops_at_once():
    StopRequest.clear()
    saved = []
    raise_if_stop_requested(3, saved.append)
    assert saved == []
    try:
        StopRequest.handle(signal.SIGTERM, None)
        with pytest.raises(Interrupted, match="stopped on SIGTERM at trainer step 3") as info:
            raise_if_stop_requested(3, saved.append)
        assert saved == [3] and info.value.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            StopRequest.handle(signal.SIGINT, None)
    finally:
        StopRequest.clear()
