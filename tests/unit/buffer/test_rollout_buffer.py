"""Rollout buffer rules, hand-checked: canary gate before advantages, length bonus, zero-signal filter,
capacity and staleness eviction (per-token versions), min-ready release, pacing, metrics, resume."""

import dataclasses
import json

import numpy as np
import pytest
from buffer_helpers import (
    assert_conservation,
    looping_tokens,
    make_buffer,
    make_group,
    make_rollout,
    random_tokens,
    rollout_staleness_from_versions,
)

from zrl.algorithms import SolveRateFrontier
from zrl.buffer import RolloutBuffer
from zrl.config.schema import Algorithm, LengthReward, RLStage
from zrl.types import TrainBatch

# c fixed at 1, plain lambda (no tolerance), so the bonus is c * p * m * lambda with nothing hidden.
LENGTH_C1 = LengthReward(c_start=1.0, c_end=1.0, tolerance_tokens=None, accuracy_tolerance=0.1)


def frontier(p_star, source="arith"):
    f = SolveRateFrontier()
    f.update(source, p_star)
    return f


# --- canary gate ---------------------------------------------------------------------------------

def test_canary_zeroes_a_flagged_reward_before_advantages():
    buf = make_buffer()
    looped = make_rollout(looping_tokens(300))
    others = [make_rollout(length=8, seed=i) for i in range(3)]
    res = buf.admit(make_group("g", [1, 1, 0, 0], rollouts=[looped, *others]))
    assert res.status == "buffered" and res.canary_flagged == 1
    g = buf.buffered()[0]
    assert g.canary_flags.tolist() == [True, False, False, False]
    assert g.rewards.tolist() == [0.0, 1.0, 0.0, 0.0]
    # MaxRL on the gated rewards: rbar = 1/4, A = (r - 1/4) / (1/4) -> [-1, 3, -1, -1]
    np.testing.assert_allclose(g.advantages, [-1.0, 3.0, -1.0, -1.0])
    assert g.task_rewards().tolist() == [1.0, 1.0, 0.0, 0.0]  # the verifier's reward is kept
    assert buf.counts()["canary_flagged"] == 1


def test_canary_monitor_only_keeps_the_reward():
    buf = make_buffer(zero_reward=False)
    looped = make_rollout(looping_tokens(300))
    buf.admit(make_group("g", [1, 1, 0, 0], rollouts=[looped, *[make_rollout(seed=i) for i in range(3)]]))
    g = buf.buffered()[0]
    assert g.canary_flags.tolist() == [True, False, False, False]
    np.testing.assert_allclose(g.advantages, [1.0, 1.0, -1.0, -1.0])  # rbar = 1/2
    assert buf.counts()["canary_flagged"] == 1


def test_canary_zeroing_the_only_success_makes_the_group_zero_signal():
    buf = make_buffer()
    res = buf.admit(make_group("g", [1, 0, 0, 0], rollouts=[make_rollout(looping_tokens(300)),
                                                             *[make_rollout(seed=i) for i in range(3)]]))
    assert res.status == "dropped_zero_signal"
    assert buf.counts()["dropped_zero_signal"] == 1 and buf.num_buffered == 0


def test_canary_disabled_flags_nothing():
    buf = make_buffer(lz77=False)
    buf.admit(make_group("g", [1, 0, 0, 0], rollouts=[make_rollout(looping_tokens(300)),
                                                       *[make_rollout(seed=i) for i in range(3)]]))
    assert buf.buffered()[0].canary_flags.tolist() == [False] * 4


# --- length bonus --------------------------------------------------------------------------------

def test_length_bonus_with_two_correct_hand_values():
    buf = make_buffer(length_reward=LENGTH_C1, max_response_tokens=100, frontier=frontier(0.5))
    buf.admit(make_group("g", [1, 1, 0, 0], lengths=[10, 60, 5, 100]))
    g = buf.buffered()[0]
    # p = 0.5 > p* - T_acc = 0.4, k = 2; l_min = 10, l_max = 100: lambda = [0.5, 0.5 - 50/90, ., .]
    lam1 = 0.5 - 50 / 90
    np.testing.assert_allclose(g.length_bonuses, [0.5 * 0.5, 0.5 * lam1, 0.0, 0.0])
    # MaxRL, bonus in the numerator only: A = (r + dr - 0.5) / 0.5
    np.testing.assert_allclose(g.advantages, [1.5, 1.0 + lam1, -1.0, -1.0])


def test_no_length_bonus_with_one_correct():
    buf = make_buffer(length_reward=LENGTH_C1, frontier=frontier(0.2))
    buf.admit(make_group("g", [1, 0, 0, 0], lengths=[10, 60, 5, 100]))
    g = buf.buffered()[0]
    assert g.length_bonuses.tolist() == [0.0] * 4
    np.testing.assert_allclose(g.advantages, [3.0, -1.0, -1.0, -1.0])


def test_length_gate_closed_until_the_source_is_observed_then_frontier_updates_per_batch():
    buf = make_buffer(batch=2, length_reward=LENGTH_C1)
    buf.admit(make_group("a", [1, 1, 0, 0], lengths=[10, 60, 5, 100]))
    assert buf.buffered()[0].length_bonuses.tolist() == [0.0] * 4  # p* unknown: gate closed
    assert buf.frontier.p_star("arith") is None
    # The second group completes the observation batch; it is still scored with the closed gate.
    res = buf.admit(make_group("b", [0, 0, 0, 0]))
    assert res.status == "dropped_zero_signal"
    assert buf.frontier.p_star("arith") == pytest.approx(2 / 8)  # dropped groups count: 2 of 8 solved
    buf.admit(make_group("c", [1, 1, 0, 0], lengths=[10, 60, 5, 100]))
    assert buf.buffered()[-1].length_bonuses[0] == pytest.approx(0.25)  # 0.5 > 0.25 - 0.1: open


def test_all_correct_group_kept_for_its_length_signal():
    buf = make_buffer(length_reward=LENGTH_C1, max_response_tokens=100, frontier=frontier(0.9))
    res = buf.admit(make_group("g", [1, 1, 1, 1], lengths=[10, 10, 100, 100]))
    assert res.status == "buffered" and buf.counts()["kept_for_length"] == 1
    # p = 1, lambda = [0.5, 0.5, -0.5, -0.5]; MaxRL with rbar = 1: A = dr
    np.testing.assert_allclose(buf.buffered()[0].advantages, [0.5, 0.5, -0.5, -0.5])


def test_length_coefficient_ramps_with_the_stage_local_trainer_step():
    spec = LengthReward(c_start=0.0, c_end=1.0, tolerance_tokens=None)
    buf = make_buffer(length_reward=spec, stage_steps=11, first_version=100, frontier=frontier(0.5),
                      staleness=20, sync=1)
    assert buf.length_coef() == 0.0
    buf.set_trainer_step(105)  # local step 5 of 0..10 -> c = 0.5
    assert buf.length_coef() == pytest.approx(0.5)
    buf.admit(make_group("g", [1, 1, 0, 0], lengths=[10, 60, 5, 100], version=105))
    assert buf.buffered()[0].length_bonuses[0] == pytest.approx(0.5 * 0.5 * 0.5)
    assert make_buffer().length_coef() == 0.0  # disabled


def test_grpo_with_length_reward_enabled_is_a_configuration_error():
    with pytest.raises(ValueError, match="length_reward.enabled: false"):
        make_buffer(advantage="grpo", length_reward=LengthReward())
    buf = make_buffer(advantage="grpo")
    buf.admit(make_group("g", [1, 0, 0, 0]))
    # population std of [1,0,0,0] = sqrt(3)/4: A_0 = 0.75 / (sqrt(3)/4 + 1e-6) = sqrt(3) (1 - 2.3e-6)
    assert buf.buffered()[0].advantages[0] == pytest.approx(np.sqrt(3), rel=1e-5)


# --- zero-signal filter ----------------------------------------------------------------------------

def test_zero_signal_groups_are_dropped_and_counted():
    buf = make_buffer()
    assert buf.admit(make_group("wrong", [0, 0, 0, 0])).status == "dropped_zero_signal"
    assert buf.admit(make_group("right", [1, 1, 1, 1])).status == "dropped_zero_signal"
    assert buf.admit(make_group("mixed", [0, 1, 0, 0])).status == "buffered"
    c = buf.counts()
    assert (c["received"], c["dropped_zero_signal"], c["admitted"], c["buffered"]) == (3, 2, 1, 1)
    assert_conservation(buf)


def test_without_dynamic_sampling_zero_signal_groups_are_kept_with_zero_advantage():
    buf = make_buffer(dynamic_sampling=False)
    assert buf.admit(make_group("wrong", [0, 0, 0, 0])).status == "buffered"
    assert buf.buffered()[0].advantages.tolist() == [0.0] * 4


# --- capacity --------------------------------------------------------------------------------------

def test_capacity_evicts_the_oldest_first():
    buf = make_buffer(batch=2, ready=2, capacity=2)  # 4 groups
    for i in range(4):
        assert buf.admit(make_group(f"g{i}", [1, 0, 0, 0], seed=i)).status == "buffered"
    res = buf.admit(make_group("g4", [1, 0, 0, 0]))
    assert res.status == "buffered" and res.evicted_capacity == 1
    assert [g.group_id for g in buf.buffered()] == ["g1", "g2", "g3", "g4"]
    assert buf.counts()["evicted_capacity"] == 1
    assert_conservation(buf)


def test_capacity_evicts_the_oldest_policy_version_even_if_it_arrived_last():
    buf = make_buffer(batch=2, ready=2, capacity=2)
    buf.set_trainer_step(2)
    for i in range(4):
        buf.admit(make_group(f"new{i}", [1, 0, 0, 0], version=2, seed=i))
    res = buf.admit(make_group("late", [1, 0, 0, 0], version=1))  # a long rollout that started earlier
    assert res.status == "evicted_capacity" and res.evicted_capacity == 1
    assert [g.group_id for g in buf.buffered()] == ["new0", "new1", "new2", "new3"]


# --- staleness -----------------------------------------------------------------------------------

def mixed_version_group(group_id, min_version, newer):
    """One rollout spans an in-flight sync: tokens 0-3 from `min_version`, 4-7 from `newer`."""
    mixed = make_rollout(length=8, segments=((0, min_version), (4, newer)))
    return make_group(group_id, [1, 0, 0, 0], rollouts=[mixed, *[make_rollout(version=newer, seed=i)
                                                                 for i in range(3)]])


def test_a_rollout_mixing_versions_is_as_stale_as_its_oldest_token():
    buf = make_buffer(batch=1, ready=1, staleness=2)
    buf.set_trainer_step(5)
    buf.admit(mixed_version_group("mixed", min_version=3, newer=5))   # staleness 2 at step 5
    buf.admit(make_group("fresh", [1, 0, 0, 0], version=5))
    assert buf.set_trainer_step(6) == 1                              # mixed: 6 - 3 = 3 > 2
    assert [g.group_id for g in buf.buffered()] == ["fresh"]
    batch = buf.take_batch(6)
    assert [g.group_id for g in batch.groups] == ["fresh"] and batch.staleness.tolist() == [1] * 4
    assert buf.counts()["evicted_stale"] == 1
    assert_conservation(buf)


def test_stale_groups_are_never_released_even_when_they_are_the_oldest():
    buf = make_buffer(batch=2, ready=1, staleness=2)
    buf.set_trainer_step(3)
    buf.admit(mixed_version_group("old", min_version=1, newer=3))
    buf.admit(make_group("a", [1, 0, 0, 0], version=2))
    buf.admit(make_group("b", [1, 0, 0, 0], version=3))
    batch = buf.take_batch(3)  # 'old' has staleness 2 at step 3: still allowed, and it is the oldest
    assert [g.group_id for g in batch.groups] == ["old", "a"]
    for g in batch.groups:
        for r in g.rollouts:
            assert rollout_staleness_from_versions(batch.trainer_step, r) <= 2
    assert batch.staleness.tolist() == [2, 0, 0, 0, 1, 1, 1, 1]  # mixed rollout counts from version 1
    buf.admit(mixed_version_group("old2", min_version=1, newer=3))
    assert buf.take_batch(4) is None  # old2 (stale 3) evicted, 'b' alone is under one batch
    assert buf.counts()["evicted_stale"] == 1


def test_a_group_stale_on_arrival_is_counted_and_not_kept():
    buf = make_buffer(staleness=2)
    buf.set_trainer_step(10)
    res = buf.admit(make_group("g", [1, 0, 0, 0], version=7))
    assert res.status == "evicted_stale" and res.evicted_stale == 1 and buf.num_buffered == 0
    assert_conservation(buf)


def test_a_version_newer_than_the_trainer_step_is_an_error_at_release():
    buf = make_buffer(batch=1, ready=1)
    buf.admit(make_group("g", [1, 0, 0, 0], version=3))  # the buffer was not told about step 3 yet
    with pytest.raises(ValueError, match="newer than trainer step 0"):
        buf.take_batch(0)
    assert buf.num_buffered == 1  # nothing was lost
    assert buf.take_batch(3).groups[0].group_id == "g"


# --- release ---------------------------------------------------------------------------------------

def test_release_only_with_min_ready_batches_and_at_most_once_per_step():
    buf = make_buffer(batch=2, ready=2, capacity=3)
    for i in range(3):
        buf.admit(make_group(f"g{i}", [1, 0, 0, 0], seed=i))
    assert not buf.ready() and buf.take_batch(0) is None  # 3 < 2 x 2
    buf.admit(make_group("g3", [1, 0, 0, 0]))
    assert buf.ready()
    batch = buf.take_batch(0)
    assert [g.group_id for g in batch.groups] == ["g0", "g1"] and batch.trainer_step == 0
    assert not buf.ready()
    with pytest.raises(ValueError, match="already released for trainer step 0"):
        buf.take_batch(0)
    buf.admit(make_group("g4", [1, 0, 0, 0]))
    assert buf.take_batch(1) is None  # 3 buffered again
    buf.admit(make_group("g5", [1, 0, 0, 0]))
    second = buf.take_batch(1)
    assert [g.group_id for g in second.groups] == ["g2", "g3"]
    assert buf.counts()["released"] == 4 and buf.counts()["released_batches"] == 2
    assert_conservation(buf)


def test_train_batch_global_counts_and_order():
    buf = make_buffer(batch=2, ready=1)
    buf.admit(make_group("a", [1, 0], lengths=[3, 0]))  # an empty response still counts in N_seq
    buf.admit(make_group("b", [0, 1, 1], lengths=[5, 7, 2]))
    batch = buf.take_batch(0)
    assert batch.num_sequences == 5 and batch.num_response_tokens == 17
    np.testing.assert_allclose(batch.advantages(), [1.0, -1.0, -1.0, 0.5, 0.5])
    assert [len(r.token_ids) for r in batch.rollouts()] == [3, 0, 5, 7, 2]
    assert not batch.groups[0].advantages.flags.writeable


def test_train_batch_rejects_unscored_groups():
    with pytest.raises(ValueError, match="not admitted"):
        TrainBatch(groups=(make_group("g", [1, 0]),), trainer_step=0)


def test_synchronous_mode_with_the_same_code():
    buf = make_buffer(batch=2, sync=1, staleness=0, ready=1, capacity=1)
    for step in range(3):
        buf.set_trainer_step(step)
        assert buf.admission_credit(0, generating_version=step) == 2
        buf.admit(make_group(f"s{step}a", [1, 0, 0, 0], version=step))
        assert buf.admission_credit(1, generating_version=step) == 0   # one buffered + one in flight
        buf.admit(make_group(f"s{step}b", [0, 1, 0, 0], version=step))
        batch = buf.take_batch(step)
        assert batch.staleness.tolist() == [0] * 8
        assert buf.admission_credit(0, generating_version=step) == 0   # until the weights move on
    buf.admit(make_group("late", [1, 0, 0, 0], version=2))          # an extra group from version 2
    assert buf.set_trainer_step(3) == 1                            # stale at once under the bound 0
    assert_conservation(buf)


# --- pacing ----------------------------------------------------------------------------------------

def test_admission_credit_hand_values():
    # B = 2, S = 2, m = 2, capacity 8 groups.
    buf = make_buffer(batch=2, sync=2, staleness=2, ready=2, capacity=4)
    # step 0, workers at 0, no pull yet: pulls at 0, 1, 2 may take a version-0 group -> 6
    assert buf.queue_limit(0) == 6 and buf.admission_credit(1, 0) == 5
    for i in range(4):
        buf.admit(make_group(f"g{i}", [1, 0, 0, 0], seed=i))
    buf.take_batch(0)
    # pulled at 0: next pulls 1 and 2 -> 4; 2 buffered, 1 in flight -> 1
    assert buf.queue_limit(0) == 4 and buf.admission_credit(1, 0) == 1
    buf.set_trainer_step(1)
    assert buf.queue_limit(0) == 4    # not pulled at 1: pulls 1, 2 for version 0
    for i in range(4, 6):
        buf.admit(make_group(f"g{i}", [1, 0, 0, 0], seed=i))
    buf.take_batch(1)
    # pulled at 1, workers still at 0: only the pull at 2 is left (2 groups, already buffered); the
    # floor does not apply while the trainer is busy with step 1
    assert buf.queue_limit(0) == 2 and buf.admission_credit(0, 0) == 0
    buf.set_trainer_step(2)
    # the weights synced at 2; not pulled yet: pulls 2, 3, 4 -> 6
    assert buf.queue_limit(2) == 6
    # workers stuck at version 0 while the trainer waits at 2: one pull left, but the floor lets it pull
    assert buf.queue_limit(0) == 4
    assert buf.admission_credit(10, 2) == 0
    with pytest.raises(ValueError, match="newer than trainer step"):
        buf.admission_credit(0, 3)
    with pytest.raises(ValueError, match="in_flight_groups"):
        buf.admission_credit(-1, 2)


def test_queue_limit_is_capped_by_capacity():
    buf = make_buffer(batch=2, staleness=5, sync=1, ready=1, capacity=2)
    assert buf.queue_limit(0) == 4


# --- errors, metrics, resume -----------------------------------------------------------------------

def test_bad_calls_raise_clear_errors():
    buf = make_buffer()
    buf.admit(make_group("g", [1, 0, 0, 0]))
    with pytest.raises(ValueError, match="already scored"):
        buf.admit(buf.buffered()[0])
    buf.set_trainer_step(2)
    with pytest.raises(ValueError, match="went back from 2 to 1"):
        buf.set_trainer_step(1)
    with pytest.raises(ValueError, match="stage_steps"):
        make_buffer(stage_steps=0)
    with pytest.raises(ValueError, match="2 verifications for 1 rollouts"):
        make_group("x", [1, 0], rollouts=[make_rollout()])


def test_metrics_counts_and_window_means():
    buf = make_buffer(batch=1, ready=1, staleness=2)
    buf.admit(make_group("a", [1, 0, 0, 0], errors=[None, "TimeoutError", None, None], env="arith"))
    buf.admit(make_group("b", [1, 1, 0, 0], env="logic", lengths=[4, 4, 4, 12]))
    buf.admit(make_group("c", [0, 0, 0, 0], env="logic"))
    buf.set_trainer_step(1)
    buf.take_batch(1)
    m = buf.metrics()
    assert m["buffer/received"] == 3 and m["buffer/dropped_zero_signal"] == 1 and m["buffer/admitted"] == 2
    assert m["buffer/released"] == 1 and m["buffer/occupancy"] == 1
    assert m["env/verifier_errors"] == 1 and m["env/verifier_error_fraction"] == pytest.approx(1 / 12)
    assert m["reward/received_mean"] == pytest.approx(3 / 12)  # every group received, the dropped one too
    assert (m["staleness/cumulative_0"], m["staleness/cumulative_1"], m["staleness/cumulative_2"]) == (0, 4, 0)
    assert m["staleness/cumulative_max"] == 1 and m["staleness/cumulative_mean"] == 1
    # The released batch's own values travel with its ticket (zrl.metrics.batch_metrics), not here.
    assert not {"reward/mean", "staleness/max", "lengths/response_mean"} & set(m)
    m2 = buf.metrics()
    assert "reward/received_mean" not in m2 and m2["buffer/received"] == 3  # window reset, counts cumulative


def test_verifier_errors_are_counted_per_entry_and_survive_resume():
    buf = make_buffer(batch=1, ready=1)
    buf.admit(make_group("a", [1, 0, 0, 0], errors=[None, "KeyError: 'x'", "KeyError: 'x'", None], env="arith"))
    buf.admit(make_group("b", [1, 1, 0, 0], errors=["TimeoutError"] + [None] * 3, env="logic"))
    buf.admit(make_group("c", [1, 0, 0, 0], env="strings"))
    m = buf.metrics()
    assert (m["env/arith/verifier_errors"], m["env/logic/verifier_errors"], m["env/verifier_errors"]) == (2, 1, 3)
    assert "env/strings/verifier_errors" not in m  # an entry without errors has no series
    fresh = make_buffer(batch=1, ready=1)
    fresh.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert fresh.metrics()["env/arith/verifier_errors"] == 2
    older = {k: v for k, v in buf.state_dict().items() if k != "entry_errors"}  # saved before it was kept
    fresh.load_state_dict(older)
    assert not [k for k in fresh.metrics() if k.startswith("env/arith/")]


def test_verification_reasons_are_counted_per_environment():
    """A verifier's metadata["reason"] (why a response earned what it did) becomes the fraction of that
    environment's rollouts in the released batch: verify/<env>/<reason, spaces as underscores>."""
    buf = make_buffer(batch=1, ready=1)
    group = make_group("a", [1, 0, 0, 0], env="code")
    reasons = ["passed", "no code block", "no code block", None]
    group = dataclasses.replace(group, verifications=[
        dataclasses.replace(v, metadata={} if r is None else {"reason": r}) for v, r in zip(group.verifications, reasons)])
    buf.admit(group)
    buf.admit(make_group("b", [1, 0, 0, 0], env="arith"))
    m = buf.release(0, 1, 64)[0].metrics  # the batch of group "a" (the oldest)
    assert (m["verify/code/passed"], m["verify/code/no_code_block"]) == (0.25, 0.5)
    assert not [k for k in m if k.startswith("verify/arith")]
    assert not [k for k in buf.metrics() if k.startswith("verify/")]  # the batch's, not the buffer's


def test_state_dict_round_trip_drops_buffered_groups_and_keeps_conservation():
    buf = make_buffer(batch=2, ready=1, length_reward=LENGTH_C1)
    for i, r in enumerate([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]]):
        buf.admit(make_group(f"g{i}", r, seed=i))
    buf.take_batch(0)
    state = json.loads(json.dumps(buf.state_dict()))
    assert state["counts"]["discarded_on_resume"] == 1 and state["frontier"] == {"arith": 3 / 8}
    fresh = make_buffer(batch=2, ready=1, length_reward=LENGTH_C1)
    fresh.load_state_dict(state)
    assert fresh.num_buffered == 0 and fresh.trainer_step == 0 and fresh.frontier.p_star("arith") == 3 / 8
    assert_conservation(fresh)
    with pytest.raises(ValueError, match="already released for trainer step 0"):
        fresh.take_batch(0)
    # the pending observation (g2: 3 of 4) is restored: one more group completes the batch
    fresh.admit(make_group("g3", [1, 0, 0, 0]))
    assert fresh.frontier.p_star("arith") == pytest.approx(max(3 / 8, 4 / 8))
    with pytest.raises(ValueError, match="state version"):
        fresh.load_state_dict({**state, "version": 99})


def test_the_prompt_ledger_drops_a_repeated_group_before_scoring_and_survives_resume():
    buf = make_buffer(batch=2, ready=1)
    assert buf.admit(make_group("w0-d0.0-a", [1, 0, 0, 0])).status == "buffered"
    assert buf.admit(make_group("w0-d0.1-b", [1, 1, 1, 1])).status == "dropped_zero_signal"
    # the same stream places again (a worker that drew them twice): neither is scored nor buffered
    assert buf.admit(make_group("w0-d0.0-a", [0, 1, 0, 0])).status == "duplicate"
    assert buf.admit(make_group("w0-d0.1-b", [0, 1, 0, 0])).status == "duplicate"
    m = buf.metrics()
    assert (m["ledger/prompts"], m["ledger/duplicates"], m["buffer/received"], m["buffer/admitted"]) == (2, 2, 2, 1)
    assert buf.num_buffered == 1
    assert_conservation(buf)
    state = json.loads(json.dumps(buf.state_dict()))
    assert state["ledger"] == ["w0-d0.0-a", "w0-d0.1-b"]
    fresh = make_buffer(batch=2, ready=1)
    fresh.load_state_dict(state)
    assert fresh.admit(make_group("w0-d0.1-b", [0, 1, 0, 0])).status == "duplicate"
    assert fresh.admit(make_group("w0-d1.0-c", [0, 1, 0, 0])).status == "buffered"
    with pytest.raises(ValueError, match="ledger holds 1 ids but 2 groups"):
        fresh.load_state_dict({**state, "ledger": ["w0-d0.0-a"]})


def test_from_stage_uses_the_recipe_parts():
    stage = RLStage(name="s", steps=7, environments=[{"name": "arith"}], algorithm=Algorithm(),
                    sampling={"prompts_per_batch": 3, "group_size": 4})
    buf = RolloutBuffer.from_stage(stage, first_version=5)
    assert (buf.queue.batch_groups, buf.queue.capacity_groups, buf.queue.ready_groups) == (3, 12, 6)
    assert buf.trainer_step == 5 and buf.stage_steps == 7


def test_random_tokens_are_not_flagged():
    buf = make_buffer()
    group = make_group("g", [1, 0, 0, 0], rollouts=[make_rollout(random_tokens(300, s)) for s in range(4)])
    assert buf.admit(group).canary_flagged == 0
