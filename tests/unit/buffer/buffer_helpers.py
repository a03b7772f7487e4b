"""Synthetic groups for the rollout-buffer tests: tiny numpy token arrays, explicit versions and rewards."""

import numpy as np

from zrl.buffer import RolloutBuffer
from zrl.config.schema import Algorithm, Asynchrony, Canaries, LengthReward, LZ77Canary, Sampling
from zrl.types import Message, Prompt, Rollout, RolloutGroup, Verification

VOCAB = 1 << 20  # random ids over 2^20 values compress to ratio ~1 at 3 bytes/token (never flagged)


def make_prompt(index=0, env="arith", source=None) -> Prompt:
    return Prompt(env=env, prompt_id=f"{env}-{index}", messages=(Message("user", "1+1?"),), answer="2",
                  data_source=source or env)


def random_tokens(n, seed) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def looping_tokens(n, period=5) -> np.ndarray:
    """A degenerate repetition loop: the LZ77 canary flags it (ratio <= 0.021 at C = 64, 3 B/token)."""
    return np.tile(np.arange(period, dtype=np.int32) + 1000, n // period + 1)[:n]


def make_rollout(tokens=None, *, length=8, version=0, segments=None, seed=0) -> Rollout:
    ids = random_tokens(length, seed) if tokens is None else np.asarray(tokens, dtype=np.int32)
    return Rollout(prompt_ids=np.arange(3, dtype=np.int32), token_ids=ids,
                   logprobs=np.full(len(ids), -1.0, np.float32), routing=None,
                   version_segments=segments or ((0, version),), finish_reason="stop")


def make_group(group_id, rewards, *, version=0, lengths=None, rollouts=None, errors=None, env="arith",
               source=None, seed=0) -> RolloutGroup:
    """One group with task rewards `rewards`; every rollout at `version` unless `rollouts` is given."""
    g = len(rewards)
    if rollouts is None:
        lengths = lengths or [8] * g
        rollouts = [make_rollout(length=n, version=version, seed=seed * 1000 + i) for i, n in enumerate(lengths)]
    errors = errors or [None] * g
    verifications = [Verification(reward=float(r), error=e) for r, e in zip(rewards, errors)]
    return RolloutGroup(str(group_id), make_prompt(env=env, source=source), rollouts, verifications)


def make_buffer(*, batch=2, group_size=4, sync=2, staleness=2, ready=2, capacity=4, advantage="maxrl",
                dynamic_sampling=True, length_reward=None, lz77=True, zero_reward=True,
                max_response_tokens=100, stage_steps=10, first_version=0, frontier=None) -> RolloutBuffer:
    asynchrony = Asynchrony(sync_every_steps=sync, max_staleness_steps=staleness, min_ready_batches=ready,
                            buffer_capacity_batches=capacity)
    algorithm = Algorithm(advantage=advantage, dynamic_sampling=dynamic_sampling,
                          length_reward=length_reward or LengthReward(enabled=False),
                          canaries=Canaries(lz77=LZ77Canary(enabled=lz77, zero_reward=zero_reward)))
    sampling = Sampling(prompts_per_batch=batch, group_size=group_size, max_response_tokens=max_response_tokens)
    return RolloutBuffer(asynchrony, algorithm, sampling, stage_steps=stage_steps, first_version=first_version,
                         frontier=frontier)


def assert_conservation(buf: RolloutBuffer) -> None:
    c = buf.counts()
    assert c["received"] == c["dropped_zero_signal"] + c["admitted"], c
    assert c["admitted"] == (c["released"] + c["evicted_capacity"] + c["evicted_stale"]
                             + c["discarded_on_resume"] + c["buffered"]), c
    assert c["buffered"] <= buf.queue.capacity_groups, c


def rollout_staleness_from_versions(step, rollout) -> int:
    """Staleness recomputed from the recorded per-token versions (the start version if no tokens)."""
    versions = rollout.token_versions()
    oldest = int(versions.min()) if versions.size else rollout.version_segments[0][1]
    return step - oldest
