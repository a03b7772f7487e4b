"""Per-step metrics are over the batch the step trains on (zrl.metrics.batch_metrics, carried by the
buffer's release ticket): reward, staleness, verification reasons, response-length percentiles and the
truncation rate; the buffer's own staleness histogram is cumulative and named so.

Hand-built groups, hand-computed values. Before these metrics, `reward/mean` averaged the groups
received since the previous step (absent when none arrived) and `staleness/*` counted every rollout
released in the stage.
"""

import numpy as np
import pytest

from zrl.buffer import RolloutBuffer
from zrl.config.schema import Algorithm, Asynchrony, Canaries, LengthReward, LZ77Canary, Sampling
from zrl.types import Message, Prompt, Rollout, RolloutGroup, Verification


def group(group_id, rewards, *, version, lengths=(8, 8, 8, 8), finish=("stop",) * 4, env="arith", reasons=None):
    rollouts = [Rollout(prompt_ids=np.arange(3, dtype=np.int32), token_ids=np.arange(n, dtype=np.int32),
                        logprobs=np.full(n, -1.0, np.float32), routing=None, version_segments=((0, version),),
                        finish_reason=f) for n, f in zip(lengths, finish)]
    reasons = reasons or [None] * len(rewards)
    verifications = [Verification(float(r), metadata={"reason": why} if why else {}) for r, why in zip(rewards, reasons)]
    prompt = Prompt(env=env, prompt_id=f"{env}-{group_id}", messages=(Message("user", "q"),), answer="a",
                    data_source=env)
    return RolloutGroup(group_id, prompt, rollouts, verifications)


def buffer() -> RolloutBuffer:
    return RolloutBuffer(Asynchrony(sync_every_steps=1, max_staleness_steps=2, min_ready_batches=1,
                                    buffer_capacity_batches=4),
                         Algorithm(length_reward=LengthReward(enabled=False),
                                   canaries=Canaries(lz77=LZ77Canary(enabled=False))),
                         Sampling(prompts_per_batch=2, group_size=4, max_response_tokens=10), stage_steps=10)


@pytest.fixture
def released():
    """Two released batches: steps 1 and 2, every group admitted before step 1."""
    buf = buffer()
    buf.admit(group("g1", [1, 0, 0, 0], version=0, lengths=(4, 4, 4, 10), finish=("stop",) * 3 + ("length",)))
    buf.admit(group("g2", [1, 1, 0, 0], version=0, lengths=(2, 4, 6, 8)))
    buf.admit(group("g3", [1, 1, 1, 0], version=2))
    buf.admit(group("g4", [0, 1, 0, 0], version=1, env="logic", reasons=["late", "scored", "scored", "late"]))
    buf.admit(group("g5", [0, 0, 0, 0], version=1))  # zero signal: dropped, never trained
    ticket1 = buf.release(1, 1, 64)[0]
    window1 = buf.metrics()
    ticket2 = buf.release(2, 1, 64)[0]
    window2 = buf.metrics()
    return ticket1.metrics, window1, ticket2.metrics, window2


def test_step_values_are_those_of_the_trained_batch(released):
    step1, _, step2, _ = released
    # step 1 trains g1, g2 (the oldest): 3 of 8 rewards are 1, every rollout 1 step stale
    assert step1["reward/mean"] == 3 / 8 and step1["reward/arith"] == 3 / 8
    assert (step1["staleness/0"], step1["staleness/1"], step1["staleness/2"]) == (0, 8, 0)
    assert step1["staleness/mean"] == 1 and step1["staleness/max"] == 1
    # step 2 trains g4 (version 1, staleness 1) and g3 (version 2, staleness 0): not the stage's sums
    assert step2["reward/mean"] == 4 / 8
    assert step2["reward/logic"] == 1 / 4 and step2["reward/arith"] == 3 / 4
    assert (step2["staleness/0"], step2["staleness/1"], step2["staleness/2"]) == (4, 4, 0)
    assert step2["staleness/mean"] == 0.5 and step2["staleness/max"] == 1
    assert step2["verify/logic/late"] == 0.5 and step2["verify/logic/scored"] == 0.5


def test_response_lengths_and_truncation_rate(released):
    step1, _, step2, _ = released
    # lengths 4 4 4 10 2 4 6 8 -> sorted 2 4 4 4 4 6 8 10; p90 interpolates 8 and 10 at 0.3
    assert step1["lengths/response_mean"] == 42 / 8
    assert step1["lengths/response_p50"] == 4 and step1["lengths/response_p90"] == pytest.approx(8.6)
    assert step1["lengths/response_max"] == 10
    assert step1["lengths/truncated_frac"] == 1 / 8  # one response hit max_response_tokens
    assert step2["lengths/truncated_frac"] == 0 and step2["lengths/response_p90"] == 8


def test_a_step_without_new_groups_still_has_its_batch_values(released):
    _, window1, step2, window2 = released
    assert window1["reward/received_mean"] == 7 / 20  # every group received (g5 included), step 1's window
    assert "reward/received_mean" not in window2 and step2["reward/mean"] == 0.5  # nothing new arrived


def test_the_buffer_histogram_is_cumulative_and_named_so(released):
    _, window1, _, window2 = released
    assert (window1["staleness/cumulative_0"], window1["staleness/cumulative_1"]) == (0, 8)
    assert (window2["staleness/cumulative_0"], window2["staleness/cumulative_1"]) == (4, 12)
    assert window2["staleness/cumulative_mean"] == 12 / 16 and window2["staleness/cumulative_max"] == 1
    assert not {"staleness/mean", "staleness/max", "staleness/0"} & set(window2)


def test_episode_metrics_come_from_the_episodes_of_the_batch():
    def episode(reward, turns, calls, errors, reason):
        return Verification(float(reward), metadata={"reason": reason, "turns": turns, "tool_calls": calls,
                                                     "tool_errors": errors, "used_tools": float(calls > 0)})

    buf = buffer()
    g = group("e1", [1, 0, 1, 0], version=0, env="tools")
    episodes = [episode(1, 2, 1, 0, "done"), episode(0, 3, 3, 1, "max_turns"), episode(1, 1, 0, 0, "done"),
                episode(0, 2, 2, 2, "done")]
    buf.admit(type(g)(g.group_id, g.prompt, list(g.rollouts), episodes))
    buf.admit(group("g2", [1, 1, 0, 0], version=0))   # a single-turn group: not an episode
    step = buf.release(1, 1, 64)[0].metrics
    assert step["episodes/turns_mean"] == 2.0 and step["episodes/tool_calls_mean"] == 1.5
    assert step["episodes/used_tools_frac"] == 0.75 and step["episodes/tool_error_frac"] == 3 / 6
    assert step["verify/tools/done"] == 0.75 and step["verify/tools/max_turns"] == 0.25


def test_a_batch_without_episodes_has_no_episode_metrics(released):
    assert not any(key.startswith("episodes/") for key in released[0])
