"""The buffer's queue on its own, with opaque groups (how the planner drives it): order, eviction,
release and credit from versions alone."""

import pytest

from zrl.buffer import BatchQueue
from zrl.config.schema import Asynchrony


def queue(staleness=1, ready=1, capacity=2, batch=2) -> BatchQueue:
    return BatchQueue(Asynchrony(sync_every_steps=1, max_staleness_steps=staleness, min_ready_batches=ready,
                                 buffer_capacity_batches=capacity), prompts_per_batch=batch)


def test_groups_leave_oldest_version_first_then_in_arrival_order():
    q = queue(capacity=3)
    q.set_trainer_step(1)
    for name, version in (("b1", 1), ("a1", 0), ("b2", 1), ("a2", 0)):
        assert q.push(name, version) == ("buffered", 0, 0)
    assert q.groups() == ("a1", "a2", "b1", "b2")
    assert q.take(1) == ["a1", "a2"]
    assert q.groups() == ("b1", "b2")


def test_a_full_queue_evicts_its_oldest_and_reports_whether_that_was_the_new_group():
    q = queue(capacity=1, batch=2)  # 2 groups
    q.set_trainer_step(1)
    q.push("new1", 1)
    q.push("new2", 1)
    assert q.push("old", 0) == ("evicted_capacity", 0, 1)
    assert q.push("newest", 1) == ("buffered", 0, 1)
    assert q.groups() == ("new2", "newest")
    assert q.counts == {"admitted": 4, "released": 0, "released_batches": 0, "evicted_capacity": 2,
                        "evicted_stale": 0}


def test_staleness_evicts_on_arrival_and_when_the_trainer_steps():
    q = queue(staleness=1)
    q.set_trainer_step(2)
    assert q.push("late", 0) == ("evicted_stale", 1, 0)
    q.push("ok", 1)
    assert q.set_trainer_step(3) == 1 and len(q) == 0
    assert q.counts["evicted_stale"] == 2 and q.counts["admitted"] == 2


def test_one_batch_per_step_and_nothing_leaves_when_the_batch_cannot_be_made():
    q = queue(ready=1, capacity=2)
    q.push("a", 0)
    assert q.take(0) is None  # under one batch
    q.push("b", 0)
    q.push("c", 0)

    def refuse(groups):
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        q.take(0, refuse)
    assert q.groups() == ("a", "b", "c") and q.ready()
    assert q.take(0, tuple) == ("a", "b")
    assert not q.ready()
    with pytest.raises(ValueError, match="already released for trainer step 0"):
        q.take(0)
    assert q.counts["released"] == 2 and q.counts["released_batches"] == 1


def test_credit_counts_queued_and_in_flight_groups_against_the_pulls_a_version_can_reach():
    q = queue(staleness=1, ready=1, capacity=2, batch=2)  # pulls at steps w .. w + 1: 2 batches, 4 groups
    assert q.admission_credit(0, 0) == 4
    q.push("a", 0)
    assert q.admission_credit(1, 0) == 2
    assert q.take(0) is None
    q.push("b", 0)
    q.take(0)                              # step 0 pulled: only step 1 is left for version 0
    assert q.admission_credit(0, 0) == 2
    with pytest.raises(ValueError, match="newer than trainer step 0"):
        q.admission_credit(0, 1)
