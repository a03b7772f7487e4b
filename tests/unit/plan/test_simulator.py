"""The simulated stage: the real StageSchedule and the buffer's BatchQueue driven by simulated workers."""

import numpy as np
import pytest

from zrl.config.schema import RLStage
from zrl.pipeline.schedule import StageSchedule
from zrl.plan import DecodeModel, ResponseLengths, TrainerModel, Workload, simulate, synchronous_variant


def small_stage(**asynchrony) -> RLStage:
    return RLStage(name="s", steps=40, environments=[{"name": "e"}],
                   sampling={"prompts_per_batch": 8, "group_size": 4, "max_response_tokens": 256},
                   asynchrony=asynchrony)


def workload(trainer_tokens_per_s=2000.0, sync_s=0.2, zero_signal=0.1) -> Workload:
    return Workload(lengths=ResponseLengths.from_median_p90(60, 150, 256),
                    engine=DecodeModel(step_s=0.01, per_sequence_s=0.001), prompt_tokens=20,
                    trainer=TrainerModel(trainer_tokens_per_s, overhead_s=0.1), sync_s=sync_s,
                    zero_signal_fraction=zero_signal)


class RecordingSchedule(StageSchedule):
    calls: list[str] = []

    def take(self, answer):
        RecordingSchedule.calls.append(type(answer).__name__)
        return super().take(answer)


def test_drives_the_loops_schedule_and_buffer():
    RecordingSchedule.calls = []
    result = simulate(small_stage(), workload(), 2, steps=10, schedule_class=RecordingSchedule)
    assert RecordingSchedule.calls.count("StepDone") == 10
    assert "CreditAnswer" in RecordingSchedule.calls
    assert result.buffer_counts["released_batches"] == 10  # the BatchQueue's own counter


@pytest.mark.parametrize("sync", [False, True])
def test_conservation_of_groups(sync):
    stage = synchronous_variant(small_stage()) if sync else small_stage()
    r = simulate(stage, workload(), 3, steps=25)
    c = r.buffer_counts
    assert r.groups_started == c["received"] + r.groups_in_flight
    assert c["received"] == c["dropped_zero_signal"] + c["admitted"]
    assert c["admitted"] == c["released"] + c["evicted_capacity"] + c["evicted_stale"] + c["buffered"]
    assert c["released"] == 25 * 8
    assert c["dropped_zero_signal"] > 0  # the workload's zero-signal groups reach the buffer's filter


@pytest.mark.parametrize("dynamic_sampling", [True, False])
def test_the_plans_zero_signal_drop_is_the_buffers(dynamic_sampling):
    """The plan skips scoring and drops its zero-signal groups itself: the real buffer, scoring the
    same groups with the stage's algorithm (length bonus on), drops an all-failed group and keeps one
    with a success exactly when the plan does."""
    from zrl.buffer import RolloutBuffer
    from zrl.types import Prompt, Rollout, RolloutGroup, Verification

    stage = small_stage()
    stage = stage.model_copy(update={"algorithm": stage.algorithm.model_copy(
        update={"dynamic_sampling": dynamic_sampling})})
    assert stage.algorithm.length_reward.enabled
    buffer = RolloutBuffer.from_stage(stage)
    tokens = np.random.default_rng(0).integers(0, 1 << 20, 64).astype(np.int32)  # no LZ77 flag

    def group(group_id, rewards):
        rollouts = [Rollout(np.zeros(4, np.int32), tokens[:n], np.zeros(n, np.float32), None, ((0, 0),), "stop")
                    for n in (10, 40, 20, 64)]
        prompt = Prompt(env="e", prompt_id=group_id, messages=(), answer="", data_source="e")
        return RolloutGroup(group_id, prompt, rollouts, [Verification(r) for r in rewards])

    assert buffer.admit(group("mixed", [1, 0, 0, 0])).status == "buffered"
    flat = buffer.admit(group("flat", [0, 0, 0, 0]))
    assert flat.status == ("dropped_zero_signal" if dynamic_sampling else "buffered")
    plan = simulate(stage, workload(zero_signal=0.5), 2, steps=10)
    assert (plan.buffer_counts["dropped_zero_signal"] > 0) == dynamic_sampling


def test_sync_mode_trains_no_stale_token():
    r = simulate(synchronous_variant(small_stage()), workload(), 2, steps=20)
    assert r.staleness_tokens == {0: 1.0}
    assert r.staleness_rollouts == {0: 20 * 8 * 4}
    assert r.syncs == 20  # the first sync, then after every step but the last


def test_a_groups_tokens_carry_the_versions_of_the_syncs_they_were_decoded_after():
    from zrl.plan.simulator import _Engine, _Group, _tokens_by_version

    e = _Engine()
    e.sync_progress, e.sync_versions = [4.0, 12.0, 22.0], [1, 3, 4]   # the first sync was before the group
    group = _Group(policy_version=1, lengths=np.array([5, 20]), tokens=25, engine=e, start_progress=10.0,
                   first_sync=1)
    # 2 tokens of each sequence before progress 12, then 3 + 10 until 22, then the long one's last 8
    assert _tokens_by_version(group) == [(1, 4.0), (3, 13.0), (4, 8.0)]
    e.sync_progress.append(40.0)   # a sync after the group ended changes nothing
    e.sync_versions.append(5)
    assert _tokens_by_version(group) == [(1, 4.0), (3, 13.0), (4, 8.0)]


def test_tokens_are_fresher_than_their_rollouts_oldest_token():
    r = simulate(small_stage(), workload(), 2, steps=30)
    for histogram in (r.staleness_tokens, r.token_staleness):
        assert sum(histogram.values()) == pytest.approx(1.0) and max(histogram) <= 2
    mean = lambda histogram: sum(k * v for k, v in histogram.items())  # noqa: E731
    assert mean(r.token_staleness) < mean(r.staleness_tokens)
    sync = simulate(synchronous_variant(small_stage()), workload(), 2, steps=10)
    assert sync.token_staleness == {0: 1.0}


def test_async_staleness_is_bounded_and_used():
    r = simulate(small_stage(max_staleness_steps=2, sync_every_steps=2), workload(), 2, steps=30)
    assert max(r.staleness_tokens) <= 2
    assert r.staleness_tokens.get(1, 0) > 0
    assert sum(r.staleness_rollouts.values()) == 30 * 8 * 4


def test_syncing_every_step_trains_faster_than_every_two_within_the_same_bound():
    """The planner's finding at ZAYA1 scale (bench/results/plan_zaya1.md), on a small stage: between two
    syncs the workers generate with the weights of a step ago, and a group started with them must be
    trained one step sooner, so the buffer admits a batch less every other step and the pool waits."""
    every_step, every_two = (simulate(small_stage(sync_every_steps=k), workload(), 2, steps=40) for k in (1, 2))
    assert every_step.steps_per_hour > every_two.steps_per_hour
    assert every_step.rollout_idle_frac < every_two.rollout_idle_frac
    assert every_step.syncs > every_two.syncs
    for r in (every_step, every_two):
        assert max(r.staleness_tokens) <= 2 and r.evicted == 0
        assert r.buffer_counts["released_batches"] == 40


def test_instant_trainer_is_never_the_bottleneck():
    instant = Workload(lengths=ResponseLengths(60, 0.5, 256), engine=DecodeModel(0.01, 0.001),
                       trainer=TrainerModel(1e12), prompt_tokens=20, sync_s=0.0)
    r = simulate(small_stage(), instant, 2, steps=20)
    assert r.trainer_idle_frac > 0.999


def test_async_is_at_least_as_fast_as_sync():
    stage, w = small_stage(), workload()
    a = simulate(stage, w, 2, steps=30)
    s = simulate(synchronous_variant(stage), w, 2, steps=30)
    assert a.steps_per_hour >= s.steps_per_hour
    assert a.trainer_idle_frac < s.trainer_idle_frac


def test_deterministic_given_the_seed():
    a = simulate(small_stage(), workload(), 2, steps=10, seed=3)
    b = simulate(small_stage(), workload(), 2, steps=10, seed=3)
    assert (a.steps_per_hour, a.buffer_counts) == (b.steps_per_hour, b.buffer_counts)


def test_slower_trainer_lowers_throughput():
    fast = simulate(small_stage(), workload(trainer_tokens_per_s=1e5), 2, steps=20)
    slow = simulate(small_stage(), workload(trainer_tokens_per_s=200.0), 2, steps=20)
    assert slow.steps_per_hour < fast.steps_per_hour
    assert slow.trainer_idle_frac < fast.trainer_idle_frac


def test_lengths_fit_median_and_p90():
    lengths = ResponseLengths.from_median_p90(17600, 30000, 81920).sample(np.random.default_rng(0), 200_000)
    assert np.median(lengths) == pytest.approx(17600, rel=0.01)
    assert np.quantile(lengths, 0.9) == pytest.approx(30000, rel=0.01)
    assert lengths.max() <= 81920


def test_engine_throughput_saturates_and_falls_with_context():
    e = DecodeModel(step_s=0.005, per_sequence_s=3e-5, per_kv_token_s=1e-8, max_running_sequences=256)
    rates = [e.tokens_per_s(n) for n in (1, 16, 128, 256, 1024)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(rates[-2])  # capped at 256 running
    assert e.tokens_per_s(128, kv_tokens=1e6) < e.tokens_per_s(128)


def test_trainer_model_from_mfu():
    t = TrainerModel.from_mfu(mfu=0.5, peak_flops=1e15, gpus=2, active_params=1e9, layers=1, attention_dim=1)
    assert t.tokens_per_s == pytest.approx(1e15 / 6e9)
    assert t.step_s(np.array([1000])) == pytest.approx(6e9 * 1000 / 1e15 + 6 * 1000**2 / 1e15)


def test_an_engine_paused_and_resumed_ends_its_groups_when_a_token_by_token_decode_does():
    from zrl.plan.simulator import _Engine

    # Without a KV term a decode step's time depends only on the running sequences, so the engine's
    # piecewise trajectory is exact; pauses that resume at once must not move it.
    engine = DecodeModel(step_s=0.01, per_sequence_s=0.001)
    load = Workload(lengths=ResponseLengths(5, 0.5, 64), engine=engine, trainer=TrainerModel(1000.0))
    lengths = np.array([[3, 7, 5], [2, 9, 4], [6, 6, 1], [8, 2, 2]])
    left, steps_end, expected = lengths.copy(), [0.0], {}
    while left.any():
        steps_end.append(steps_end[-1] + engine.step_s + engine.per_sequence_s * np.count_nonzero(left))
        left = np.maximum(left - 1, 0)
        for group in np.flatnonzero(~left.any(axis=1)):
            expected.setdefault(int(group), steps_end[-1])

    def tokens_decoded(t):  # by every running sequence, at time t
        i = int(np.searchsorted(steps_end, t, side="right")) - 1
        return i + (t - steps_end[i]) / (steps_end[i + 1] - steps_end[i])

    e = _Engine()
    e.add(lengths, prompt_tokens=10, first_group=0)
    e.start_chain(0.0, load)
    ended, t = {}, 0.0
    while e.group_ends:
        end = e.first_group_end()
        pause = (t + end) / 2                       # a round end between two group ends
        assert e.advance(pause) == [] and e.resume(pause)
        assert e.progress == pytest.approx(tokens_decoded(pause), rel=1e-12)
        t = float(end)
        for group in e.advance(t):
            ended[group] = t
        assert e.resume(t) or not e.group_ends
    assert list(ended) == sorted(expected, key=lambda g: (expected[g], g))
    assert ended == pytest.approx(expected, rel=1e-12)
