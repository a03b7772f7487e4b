"""The RL stage's scheduling policy without Ray: rounds from credit, training, sync cadence, faults."""

import numpy as np
import pytest

from zrl.pipeline.schedule import StageSchedule


def schedule(workers=2, version=0, steps=6, prompts_per_batch=4, sync_every=2, synchronous=False):
    return StageSchedule(num_workers=workers, policy_version=version, end_version=version + steps,
                         prompts_per_batch=prompts_per_batch, sync_every_steps=sync_every, synchronous=synchronous)


def test_credit_is_shared_evenly_among_idle_workers_up_to_a_batch_each():
    s = schedule(workers=3)
    assert s.wants_credit()
    s.credit_requested = True
    assert not s.wants_credit()  # one question at a time
    assert s.plan_rounds(5) == [(0, 2), (1, 2), (2, 1)]  # ceil(5 / 3) each, in worker order
    assert [w.groups_in_engine for w in s.workers] == [2, 2, 1]
    assert s.in_flight_groups() == 5
    assert not s.wants_credit()  # every worker runs a round
    for index in range(3):
        s.round_done(index, finished_groups=0, groups_in_engine=s.workers[index].groups_in_engine, policy_version=0)
    assert s.wants_credit()
    assert s.plan_rounds(0) == [(0, 0), (1, 0), (2, 0)]  # what is in the engines continues
    s = schedule(workers=2)
    assert s.plan_rounds(20) == [(0, 4), (1, 4)]  # never more than a batch per round


def test_a_worker_fills_only_up_to_its_share_of_everything_queued():
    s = schedule(workers=3)
    s.plan_rounds(3)
    for index in (1, 2):
        s.workers[index].in_round = True  # workers 1 and 2 still in their round
    s.round_done(0, finished_groups=0, groups_in_engine=1, policy_version=0)
    # 3 in flight + 3 credit over 3 workers: worker 0 may hold 2, so it takes 1 and the rest waits
    # for the other workers' round ends rather than piling into worker 0's engine.
    assert s.plan_rounds(3) == [(0, 1)]
    assert s.in_flight_groups() == 4


def test_a_worker_with_groups_in_its_engine_continues_without_credit():
    s = schedule(workers=2)
    s.plan_rounds(4)
    s.round_done(0, finished_groups=1, groups_in_engine=1, policy_version=0)
    assert s.verifying == 1 and s.in_flight_groups() == 4
    assert s.plan_rounds(0) == [(0, 0)]  # worker 1 is still in its round
    s.group_handed_on()
    assert s.in_flight_groups() == 3


def test_an_answer_that_starts_nothing_is_not_asked_again_until_progress():
    s = schedule()
    assert s.plan_rounds(0) == []
    assert not s.wants_credit() and not s.wants_batch()
    s.progressed()
    assert s.wants_credit() and s.wants_batch()
    s.batch_requested = True
    s.batch_answer(released=False)
    assert not s.wants_batch()


def test_weights_sync_every_k_steps_but_not_after_the_last():
    s = schedule(steps=4, sync_every=2)
    due = []
    while not s.done:
        s.batch_requested = True
        s.batch_answer(released=True)
        assert s.training and not s.wants_batch()
        due.append(s.step_done())
    assert due == [False, True, False, False]
    assert s.policy_version == 4


def test_synchronous_mode_starts_no_group_while_a_step_trains_or_weights_sync():
    s = schedule(synchronous=True)
    s.plan_rounds(4)
    s.round_done(0, finished_groups=0, groups_in_engine=4, policy_version=0)
    s.batch_requested = True
    s.batch_answer(released=True)
    assert s.paused and not s.wants_credit()
    assert s.plan_rounds(None) == [(0, 0)]  # what is in the engine continues
    s.step_done()
    assert not s.paused
    s.sync_started()
    assert s.paused and not s.wants_batch()


def test_a_lost_worker_loses_its_groups_and_every_worker_is_synced_again():
    s = schedule(workers=2, version=3)
    s.plan_rounds(8)
    assert s.worker_lost(0) == 4
    assert s.lost_groups == 4 and s.worker_restarts == 1
    assert s.workers[0].policy_version == -1 and s.workers[0].restarted
    assert s.generating_version() == 3  # the restarted worker gets the latest weights before it generates
    assert s.wants_resync()
    s.sync_started()
    assert not s.wants_resync() and all(w.syncing for w in s.workers)
    s.worker_synced(0, 3)
    assert not s.workers[0].restarted and s.workers[0].policy_version == 3


def test_a_failed_sync_is_retried_for_every_worker():
    s = schedule()
    s.sync_started()
    s.trainer_synced()
    s.worker_synced(0, None)
    s.worker_synced(1, 0)
    assert s.workers[0].policy_version == -1
    assert s.wants_resync()


@pytest.mark.parametrize("released", [True, False])
def test_no_batch_is_asked_for_while_one_is_requested(released):
    s = schedule()
    s.batch_requested = True
    assert not s.wants_batch()
    s.batch_answer(released)
    assert s.training == released


def test_synchronous_mode_generates_while_the_trainer_waits_for_a_batch():
    s = schedule(synchronous=True)
    s.sync_started()
    s.trainer_synced()
    s.worker_synced(0, 0)
    s.worker_synced(1, 0)
    s.batch_requested = True  # asked for before any group exists: the answer will be "none yet"
    assert s.wants_credit()
    assert s.plan_rounds(4) == [(0, 2), (1, 2)]


def test_a_credit_answer_during_a_synchronous_pause_does_not_stall_the_loop():
    # The credit question left before a sync started; its answer arrives after the workers synced but
    # before the trainer's part of the sync returned.
    s = schedule(workers=1, synchronous=True)
    s.credit_requested = True
    s.sync_started()
    s.worker_synced(0, 0)
    assert s.plan_rounds(4) == []  # paused: nothing starts
    s.trainer_synced()
    assert s.wants_credit() and s.wants_batch()


def test_the_pool_totals_it_keeps_agree_with_the_workers_after_any_sequence_of_events():
    # in_flight_groups, generating_version and wants_credit are kept up to date by the event methods
    # instead of summed over the pool per question; a random walk through every event checks them.
    rng = np.random.default_rng(0)
    s = schedule(workers=5, steps=1000)
    for _ in range(3000):
        event = rng.integers(7)
        index = int(rng.integers(5))
        worker = s.workers[index]
        if event == 0:
            s.plan_rounds(int(rng.integers(0, 9)))
        elif event == 1 and worker.in_round:
            s.round_done(index, finished_groups=0, groups_in_engine=int(rng.integers(0, worker.groups_in_engine + 1)),
                         policy_version=int(rng.integers(0, s.policy_version + 1)))
        elif event == 2:
            s.worker_lost(index)
        elif event == 3 and not s.syncing:
            s.sync_started()
        elif event == 4 and worker.syncing:
            s.worker_synced(index, None if rng.random() < 0.2 else s.policy_version)
        elif event == 5:
            s.step_done()
        elif event == 6 and s.trainer_syncing:
            s.trainer_synced()
        assert s.in_flight_groups() == sum(w.groups_in_engine for w in s.workers) + s.verifying
        assert s.generating_version() == min(w.policy_version if w.policy_version >= 0 else s.policy_version
                                             for w in s.workers)
        assert s.wants_credit() == (not s.credit_requested and not s.waiting and not s.paused
                                    and any(not w.in_round and not w.syncing for w in s.workers))
