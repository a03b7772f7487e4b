"""The multi-turn episode loop (zrl/env/episodes.py) on a stand-in engine: masks, logprobs, routing
provenance, versions across weight syncs, turn/token/context limits, tool errors and failing environments."""

from dataclasses import dataclass

import numpy as np
import pytest

from serving.engine import FinishedSample, SampleOutput, SamplingConfig, VersionSegment
from zrl.env.episode import Episode, Turn
from zrl.env.episodes import EpisodeRunner
from zrl.types import NO_ROUTE

L = 2


@dataclass
class Request:
    ids: np.ndarray
    max_tokens: int
    seed: int | None


class StandInEngine:
    """Generates `lengths[k]` tokens (id 100 + k) for its k-th request, logprob -(k + 1); every routing row a
    request's forward computes is k (NO_ROUTE for its last token); `sync_after[k] = j` puts a weight update
    after j of request k's tokens."""

    def __init__(self, lengths, max_model_len=64, sync_after=None):
        self.lengths, self.max_model_len, self.sync_after = list(lengths), max_model_len, sync_after or {}
        self.version, self.requests, self._queue = 0, [], []

    def submit(self, ids, num_samples, sampling, seed=None):
        assert num_samples == 1
        self.requests.append(Request(np.asarray(ids), sampling.max_tokens, seed))
        self._queue.append(len(self.requests) - 1)
        return len(self.requests) - 1

    def step(self):
        done, self._queue = self._queue, []
        return [self._finish(k) for k in done]

    def _finish(self, k):
        r = self.requests[k]
        n = min(self.lengths[k], r.max_tokens)
        segments = [VersionSegment(0, self.version)]
        if k in self.sync_after:
            self.version += 1
            segments.append(VersionSegment(self.sync_after[k], self.version))
        routing = np.full((len(r.ids) + n, L), k, np.uint8)
        routing[-1] = NO_ROUTE
        out = SampleOutput(prompt_ids=r.ids, token_ids=np.full(n, 100 + k), logprobs=np.full(n, -(k + 1.0), np.float32),
                           routing=routing, finish_reason="length" if n < self.lengths[k] else "stop",
                           version_segments=tuple(segments), text=f"turn{k}")
        return FinishedSample(k, 0, out)


class Scripted(Episode):
    """Answers the policy's k-th message with turns[k]; raises when the script says so."""

    def __init__(self, turns):
        self.turns, self.seen, self.closed = list(turns), [], 0

    def step(self, text):
        self.seen.append(text)
        turn = self.turns[len(self.seen) - 1]
        if isinstance(turn, Exception):
            raise turn
        return turn

    def close(self):
        self.closed += 1


def reply(n, content="tool says hi"):
    return Turn(messages=({"role": "tool", "content": content * n},))


def render(messages, last_token=None):
    """Stand-in chat continuation: one token (7) per character group of 12, at least one."""
    return [7] * max(1, sum(len(m["content"]) for m in messages) // 12)


def run(engine, episode, max_turns=4, max_response_tokens=40, prompt=(1, 2, 3), seed=None, max_tokens=8):
    runner = EpisodeRunner(engine, render)
    runner.start(episode, list(prompt), SamplingConfig(max_tokens=max_tokens), max_turns=max_turns,
                 max_response_tokens=max_response_tokens, seed=seed, key="k")
    outputs = []
    while len(runner):
        for sample in engine.step():
            runner.on_sample(sample)
        outputs += runner.poll(timeout=None)
    runner.close()
    assert len(outputs) == 1 and episode.closed == 1 and outputs[0].key == "k"
    return outputs[0]


def test_masks_logprobs_routing_and_versions_of_a_three_turn_episode():
    # Turn 0: 3 tokens; reply 1 token; turn 1: 2 tokens, a weight sync after its first; reply 2 tokens;
    # turn 2: 2 tokens, done.
    engine = StandInEngine([3, 2, 2], sync_after={1: 1})
    episode = Scripted([reply(1), reply(2), Turn(done=True, reward=0.75, tool_calls=2, tool_errors=1)])
    out = run(engine, episode, seed=5)
    r = out.rollout
    assert out.end_reason == "done" and out.reward == 0.75 and out.turns == 3
    assert (out.tool_calls, out.tool_errors) == (2, 1)
    assert episode.seen == ["turn0", "turn1", "turn2"]
    assert r.token_ids.tolist() == [100, 100, 100, 7, 101, 101, 7, 7, 102, 102]
    assert r.policy_mask.tolist() == [True] * 3 + [False] + [True] * 2 + [False] * 2 + [True] * 2
    assert r.logprobs.tolist() == [-1.0] * 3 + [0.0] + [-2.0] * 2 + [0.0] * 2 + [-3.0] * 2
    # Each position's rows come from the request that first computed it: the prompt and turn 0's first two
    # tokens from request 0; turn 0's last token, the reply and turn 1's first token from request 1; turn 1's
    # last token, the second reply and turn 2's first token from request 2; the last token from none.
    assert r.routing[:, 0].tolist() == [0] * 5 + [1] * 3 + [2] * 4 + [NO_ROUTE]
    # The sync in the middle of turn 1 versions its second token and everything after; replies sit inside.
    assert r.version_segments == ((0, 0), (5, 1))
    assert r.token_versions()[r.policy_mask].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert r.min_version == 0 and r.num_policy_tokens == 7
    # Every turn's request is the sequence so far; turn k is seeded 5 + k * 2**20.
    assert [len(q.ids) for q in engine.requests] == [3, 7, 11]
    assert [q.seed for q in engine.requests] == [5, 5 + 2**20, 5 + 2**21]


def test_turn_limit_ends_the_episode_with_its_last_reward():
    engine = StandInEngine([2, 2])
    out = run(engine, Scripted([Turn(messages=({"role": "user", "content": "again"},), reward=0.5), reply(1)]),
              max_turns=2)
    assert out.end_reason == "max_turns" and out.turns == 2 and out.reward == 0.5
    assert out.rollout.finish_reason == "stop" and out.rollout.policy_mask.tolist()[-2:] == [True, True]


def test_a_failing_environment_costs_the_episode_its_reward_only():
    out = run(StandInEngine([2, 2]), Scripted([Turn(messages=({"role": "tool", "content": "x"},), reward=1.0),
                                              RuntimeError("sandbox died")]))
    assert out.end_reason == "env_error" and out.reward == 0.0 and out.error == "RuntimeError: sandbox died"
    assert out.turns == 2 and len(out.rollout.token_ids) == 5


def test_an_episode_that_outgrows_the_context_ends_without_the_reply():
    # Prompt 3 + turn 4 tokens; a 30-token reply would leave no room in a 36-token context.
    engine = StandInEngine([4], max_model_len=36)
    out = run(engine, Scripted([reply(30)]), max_response_tokens=100)
    assert out.end_reason == "context" and out.rollout.finish_reason == "length"
    assert out.rollout.token_ids.tolist() == [100] * 4 and out.rollout.policy_mask.all()
    assert out.rollout.routing.shape == (7, L) and out.rollout.routing[-1, 0] == NO_ROUTE


def test_response_budget_and_a_truncated_turn():
    # The reply would reach the response budget: the episode ends before it.
    out = run(StandInEngine([6]), Scripted([reply(5)]), max_response_tokens=10)
    assert out.end_reason == "response_budget" and len(out.rollout.token_ids) == 6
    # A policy message cut at the budget ends the episode without asking the environment.
    episode = Scripted([reply(1)])
    out = run(StandInEngine([50]), episode, max_response_tokens=6, max_tokens=50)
    assert out.end_reason == "truncated" and episode.seen == [] and len(out.rollout.token_ids) == 6


def test_a_turn_needs_a_reward_to_end_and_the_runner_at_least_one_turn():
    with pytest.raises(ValueError, match="needs a reward"):
        Turn(done=True)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        Turn(reward=1.5)
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeRunner(StandInEngine([1]), render).start(Scripted([]), [1], SamplingConfig(max_tokens=4), max_turns=0,
                                                        max_response_tokens=8)
    with pytest.raises(ValueError, match="no room"):
        EpisodeRunner(StandInEngine([1], max_model_len=3), render).start(
            Scripted([]), [1, 2, 3], SamplingConfig(max_tokens=4), max_turns=1, max_response_tokens=8)


def test_a_slow_environment_step_does_not_hold_back_other_episodes():
    """Episode A's environment blocks until released; episode B's turns go on through the engine meanwhile."""
    import threading

    release = threading.Event()

    class Blocking(Scripted):
        def step(self, text):
            assert release.wait(10)
            return super().step(text)

    engine = StandInEngine([2, 2, 2, 2])
    runner = EpisodeRunner(engine, render)
    slow, fast = Blocking([reply(1), Turn(done=True, reward=1.0)]), Scripted([reply(1), Turn(done=True, reward=0.5)])
    runner.start(slow, [1], SamplingConfig(max_tokens=4), max_turns=3, max_response_tokens=20, key="slow")
    runner.start(fast, [2], SamplingConfig(max_tokens=4), max_turns=3, max_response_tokens=20, key="fast")
    ended = []
    while not ended:  # B: turn 0, its reply, turn 1, done; A still waits for its environment
        for sample in engine.step():
            runner.on_sample(sample)
        ended += runner.poll(timeout=0.1)
    assert [e.key for e in ended] == ["fast"] and runner.stepping == 1 and len(runner) == 1
    release.set()
    while len(runner):
        for sample in engine.step():
            runner.on_sample(sample)
        ended += runner.poll(timeout=None)
    runner.close()
    assert [(e.key, e.reward, e.turns) for e in ended] == [("fast", 0.5, 2), ("slow", 1.0, 2)]
