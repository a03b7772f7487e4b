"""Rollout-worker deaths: one death is handled once, however many of its calls fail, and the limit holds."""

import pytest

from zrl.pipeline.faults import StageStopped
from zrl.pipeline.worker_restarts import WorkerRestarts


def test_the_calls_that_failed_with_a_handled_death_are_ignored():
    r = WorkerRestarts("s", num_workers=2, max_worker_restarts=2, restart_timeout_s=1.0)
    round_seq, sync_seq = r.next_seq(), r.next_seq()  # two calls of worker 0 in flight when it dies
    assert r.died(0, round_seq, RuntimeError("died"))
    r.handled(0, lost_groups=3)
    assert not r.died(0, sync_seq, RuntimeError("died"))  # the same death
    assert r.died(0, r.next_seq(), RuntimeError("died again"))  # a call of the restarted worker
    assert r.deaths == [2, 0]
    assert r.died(1, sync_seq, RuntimeError("died"))  # every worker has its own deaths


def test_a_worker_that_dies_more_often_than_allowed_stops_the_stage():
    r = WorkerRestarts("s", num_workers=1, max_worker_restarts=1, restart_timeout_s=1.0)
    assert r.died(0, r.next_seq(), RuntimeError("first"))
    r.handled(0, lost_groups=0)
    with pytest.raises(StageStopped, match=r"rollout worker 0 died 2 times \(asynchrony.max_worker_restarts 1\); "
                                           r"last: second"):
        r.died(0, r.next_seq(), RuntimeError("second"))
