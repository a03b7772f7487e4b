"""The RL stage's scheduling policy without Ray: rounds from credit, training, sync cadence, faults,
driven through its protocol (requests out, answers in) as both transports drive it."""

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from zrl.buffer import BatchQueue
from zrl.config.schema import Asynchrony
from zrl.pipeline import schedule as protocol
from zrl.pipeline.schedule import (REQUEST_TYPES, AskBatch, AskCredit, BatchAnswer, CreditAnswer, GroupAdmitted,
                                   GroupHandedOn, LaunchRound, RoundDone, StageSchedule, StartSync, StepDone,
                                   TrainerSynced, WorkerLost, WorkerSynced)

ROOT = Path(__file__).resolve().parents[3]


def schedule(workers=2, step=0, steps=6, prompts_per_batch=4, sync_every=2, synchronous=False):
    return StageSchedule(num_workers=workers, trainer_step=step, end_step=step + steps,
                         prompts_per_batch=prompts_per_batch, sync_every_steps=sync_every, synchronous=synchronous)


def launches(requests) -> list[tuple[int, int]]:
    assert all(isinstance(r, LaunchRound) for r in requests)
    return [(r.worker, r.new_groups) for r in requests]


def round_done(s, index, finished=0, in_engine=None, policy_version=0):
    in_engine = s.workers[index].groups_in_engine if in_engine is None else in_engine
    assert s.take(RoundDone(index, finished, in_engine, policy_version)) == []


def synced(s, policy_version=0):
    s.take(TrainerSynced())
    for index in range(len(s.workers)):
        s.take(WorkerSynced(index, policy_version))


def test_the_first_request_syncs_every_worker():
    s = schedule(step=3)
    assert s.start() == [StartSync(3)]
    assert s.syncing and all(w.syncing for w in s.workers)


def test_credit_is_shared_evenly_among_idle_workers_up_to_a_batch_each():
    s = schedule(workers=3)
    assert s.next_requests() == [AskCredit(in_flight_groups=0, generating_version=0), AskBatch(trainer_step=0)]
    assert s.next_requests() == []  # one question of each kind at a time
    assert launches(s.take(CreditAnswer(5))) == [(0, 2), (1, 2), (2, 1)]  # ceil(5 / 3) each, in worker order
    assert [w.groups_in_engine for w in s.workers] == [2, 2, 1]
    assert s.in_flight_groups() == 5
    assert not s.wants_credit()  # every worker runs a round
    for index in range(3):
        round_done(s, index)
    assert s.next_requests() == [AskCredit(in_flight_groups=5, generating_version=0)]
    assert launches(s.take(CreditAnswer(0))) == [(0, 0), (1, 0), (2, 0)]  # what is in the engines continues
    s = schedule(workers=2)
    s.next_requests()
    assert launches(s.take(CreditAnswer(20))) == [(0, 4), (1, 4)]  # never more than a batch per round


def test_a_worker_fills_only_up_to_its_share_of_everything_queued():
    s = schedule(workers=3)
    s.next_requests()
    assert launches(s.take(CreditAnswer(3))) == [(0, 1), (1, 1), (2, 1)]
    round_done(s, 0, in_engine=1)  # workers 1 and 2 still in their round
    # 3 in flight + 3 credit over 3 workers: worker 0 may hold 2, so it takes 1 and the rest waits
    # for the other workers' round ends rather than piling into worker 0's engine.
    assert s.next_requests() == [AskCredit(in_flight_groups=3, generating_version=0)]
    assert launches(s.take(CreditAnswer(3))) == [(0, 1)]
    assert s.in_flight_groups() == 4


def test_a_worker_with_groups_in_its_engine_continues_without_credit():
    s = schedule(workers=2)
    s.next_requests()
    s.take(CreditAnswer(4))
    round_done(s, 0, finished=1, in_engine=1)
    assert s.verifying == 1 and s.in_flight_groups() == 4
    assert launches(s.take(CreditAnswer(0))) == [(0, 0)]  # worker 1 is still in its round
    s.take(GroupHandedOn())
    assert s.in_flight_groups() == 3


def test_an_answer_that_starts_nothing_is_not_asked_again_until_progress():
    s = schedule()
    s.next_requests()
    assert s.take(CreditAnswer(0)) == []
    assert s.take(BatchAnswer(released=False)) == []
    assert s.next_requests() == []
    s.take(GroupAdmitted())  # progress
    assert s.next_requests() == [AskCredit(0, 0), AskBatch(0)]


def test_weights_sync_every_k_steps_but_not_after_the_last():
    s = schedule(steps=4, sync_every=2)
    due = []
    while not s.done:
        assert AskBatch(s.trainer_step) in s.next_requests()
        s.take(BatchAnswer(released=True))
        assert s.training and not s.wants_batch()
        requests = s.take(StepDone())
        due.append(requests == [StartSync(s.trainer_step)])
        if requests:
            synced(s, s.trainer_step)
    assert due == [False, True, False, False]
    assert s.trainer_step == 4


@pytest.mark.parametrize("sync_every, windows", [(1, [3, 3, 3, 3]), (2, [3, 2, 3, 2])])
def test_the_admission_window_after_each_step_follows_the_sync_cadence(sync_every, windows):
    """The batches the buffer lets be queued or in flight when the workers ask for credit after each
    step (staleness <= 2): a group started with weights one step old must be trained one step sooner,
    so between two syncs every 2 steps the window is a batch smaller (the planner's finding,
    bench/results/plan_zaya1.md); syncing every step keeps it at max_staleness_steps + 1."""
    queue = BatchQueue(Asynchrony(sync_every_steps=sync_every, max_staleness_steps=2), prompts_per_batch=4)
    s = schedule(steps=4, sync_every=sync_every)
    s.start()
    synced(s, 0)
    seen = []
    while not s.done:
        requests = s.next_requests()
        [ask] = [r for r in requests if isinstance(r, AskCredit)]
        queue.set_trainer_step(s.trainer_step)
        seen.append(queue.queue_limit(ask.generating_version) // 4)
        assert s.take(CreditAnswer(0)) == []
        assert AskBatch(s.trainer_step) in requests
        s.take(BatchAnswer(released=True))
        if s.take(StepDone()):
            synced(s, s.trainer_step)
    assert seen == windows


def test_synchronous_mode_starts_no_group_while_a_step_trains_or_weights_sync():
    s = schedule(synchronous=True)
    s.next_requests()
    s.take(CreditAnswer(4))
    round_done(s, 0, in_engine=4)
    s.take(BatchAnswer(released=True))
    assert s.paused and not s.wants_credit()
    assert launches(s.next_requests()) == [(0, 0)]  # what is in the engine continues
    s.take(StepDone())
    assert not s.paused
    s.start()
    assert s.paused and not s.wants_batch()


def test_a_lost_worker_loses_its_groups_and_every_worker_is_synced_again():
    s = schedule(workers=2, step=3)
    s.next_requests()
    s.take(CreditAnswer(8))
    assert s.take(WorkerLost(0)) == []
    assert s.lost_groups == 4 and s.worker_restarts == 1
    assert s.workers[0].policy_version == -1 and s.workers[0].restarted
    assert s.generating_version() == 3  # the restarted worker gets the latest weights before it generates
    assert StartSync(3) in s.next_requests()
    assert not s.wants_resync() and all(w.syncing for w in s.workers)
    s.take(WorkerSynced(0, 3))
    assert not s.workers[0].restarted and s.workers[0].policy_version == 3


def test_a_failed_sync_is_retried_for_every_worker():
    s = schedule()
    s.start()
    s.take(TrainerSynced())
    s.take(WorkerSynced(0, None))
    s.take(WorkerSynced(1, 0))
    assert s.workers[0].policy_version == -1
    assert StartSync(0) in s.next_requests()


def test_a_group_lost_on_its_way_to_the_buffer_is_counted():
    s = schedule()
    s.next_requests()
    s.take(CreditAnswer(2))
    round_done(s, 0, finished=1, in_engine=0)
    s.take(GroupHandedOn(lost=True))
    assert s.lost_groups == 1 and s.verifying == 0
    round_done(s, 1, finished=1, in_engine=0)
    s.take(GroupHandedOn())
    s.take(GroupAdmitted(lost=True))  # its arrays were gone when the buffer asked for them
    assert s.lost_groups == 2 and s.in_flight_groups() == 0


@pytest.mark.parametrize("released", [True, False])
def test_no_batch_is_asked_for_while_one_is_requested(released):
    s = schedule()
    assert AskBatch(0) in s.next_requests()
    assert not s.wants_batch()
    s.take(BatchAnswer(released))
    assert s.training == released


def test_synchronous_mode_generates_while_the_trainer_waits_for_a_batch():
    s = schedule(synchronous=True)
    s.start()
    synced(s)
    # the batch is asked for before any group exists (the answer will be "none yet"): credit still flows
    assert s.next_requests() == [AskCredit(0, 0), AskBatch(0)]
    assert launches(s.take(CreditAnswer(4))) == [(0, 2), (1, 2)]


def test_a_credit_answer_during_a_synchronous_pause_does_not_stall_the_loop():
    # The credit question left before a sync started; its answer arrives after the workers synced but
    # before the trainer's part of the sync returned.
    s = schedule(workers=1, synchronous=True)
    assert AskCredit(0, 0) in s.next_requests()
    s.take(BatchAnswer(released=False))
    s.start()
    s.take(WorkerSynced(0, 0))
    assert s.take(CreditAnswer(4)) == []  # paused: nothing starts
    s.take(TrainerSynced())
    assert s.next_requests() == [AskCredit(0, 0), AskBatch(0)]


def test_an_unknown_answer_is_refused():
    with pytest.raises(TypeError, match="not an answer"):
        schedule().take(AskCredit(0, 0))


def test_requests_and_answers_are_frozen_dataclasses():
    types = [t for t in vars(protocol).values() if isinstance(t, type) and t.__module__ == protocol.__name__
             and t not in (StageSchedule, protocol.WorkerState)]
    assert set(REQUEST_TYPES) < set(types)
    for t in types:
        assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen, t


def test_both_transports_handle_exactly_the_schedules_requests():
    from zrl.pipeline.rl_stage import RLStageRunner
    from zrl.plan.simulator import _Simulation

    assert set(RLStageRunner.HANDLERS) == set(REQUEST_TYPES)
    assert set(_Simulation.HANDLERS) == set(REQUEST_TYPES)


@pytest.mark.parametrize("path", ["zrl/pipeline/rl_stage.py", "zrl/plan/simulator.py",
                                  "zrl/pipeline/stage_admission.py", "zrl/pipeline/sync_coordinator.py"])
def test_no_transport_assigns_the_schedules_fields_or_calls_its_private_methods(path):
    """The transports drive the schedule by its protocol only: nothing outside schedule.py sets a field
    of it (`schedule.x = ...`, `s.x += ...`) or calls one of its `_methods`."""
    fields = {f.name for f in dataclasses.fields(StageSchedule)}
    tree = ast.parse((ROOT / path).read_text())
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in fields:
                assert not (isinstance(target.value, ast.Name) and target.value.id in ("s", "schedule")), \
                    f"{path}:{node.lineno} assigns schedule.{target.attr}"
                assert not (isinstance(target.value, ast.Attribute) and target.value.attr == "schedule"), \
                    f"{path}:{node.lineno} assigns schedule.{target.attr}"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            named = (isinstance(base, ast.Name) and base.id in ("s", "schedule")) or \
                (isinstance(base, ast.Attribute) and base.attr == "schedule")
            assert not (named and hasattr(StageSchedule, node.attr)), f"{path}:{node.lineno} calls schedule.{node.attr}"


def test_the_pool_totals_it_keeps_agree_with_the_workers_after_any_sequence_of_answers():
    # in_flight_groups, generating_version and wants_credit are kept up to date by the answers instead
    # of summed over the pool per question; a random walk through every answer checks them.
    rng = np.random.default_rng(0)
    s = schedule(workers=5, steps=1000)
    for _ in range(3000):
        event = rng.integers(8)
        index = int(rng.integers(5))
        worker = s.workers[index]
        if event == 0:
            s.next_requests()
            if s.credit_requested:
                s.take(CreditAnswer(int(rng.integers(0, 9))))
        elif event == 1 and worker.in_round:
            s.take(RoundDone(index, 0, int(rng.integers(0, worker.groups_in_engine + 1)),
                             int(rng.integers(0, s.trainer_step + 1))))
        elif event == 2:
            s.take(WorkerLost(index))
        elif event == 3 and not s.syncing:
            s.start()
        elif event == 4 and worker.syncing:
            s.take(WorkerSynced(index, None if rng.random() < 0.2 else s.trainer_step))
        elif event == 5 and s.training:
            s.take(StepDone())
        elif event == 6 and s.trainer_syncing:
            s.take(TrainerSynced())
        elif event == 7 and s.batch_requested:
            s.take(BatchAnswer(bool(rng.random() < 0.5)))
        assert s.in_flight_groups() == sum(w.groups_in_engine for w in s.workers) + s.verifying
        assert s.generating_version() == min(w.policy_version if w.policy_version >= 0 else s.trainer_step
                                             for w in s.workers)
        assert s.wants_credit() == (not s.credit_requested and not s.waiting and not s.paused
                                    and any(not w.in_round and not w.syncing for w in s.workers))
