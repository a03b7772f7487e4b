"""Property tests of the buffer's admission/eviction/release rules over random interleavings of admit,
trainer-step advance and take_batch, and of the pacing rule in a simulated asynchronous pipeline.

Staleness is always re-derived from the released rollouts' recorded per-token versions, never from
the buffer's own bookkeeping."""

import random

import pytest
from buffer_helpers import (
    assert_conservation,
    make_buffer,
    make_group,
    make_rollout,
    rollout_staleness_from_versions,
)
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def configs(draw):
    sync = draw(st.integers(1, 3))
    ready = draw(st.integers(1, 3))
    return dict(batch=draw(st.integers(1, 3)), sync=sync, staleness=draw(st.integers(sync - 1, sync + 2)),
                ready=ready, capacity=draw(st.integers(ready, ready + 2)),
                dynamic_sampling=draw(st.booleans()))


op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 5), st.booleans(), st.lists(st.integers(0, 1), min_size=2,
                                                                             max_size=3)),
    st.tuples(st.just("step"), st.integers(1, 2)),
    st.tuples(st.just("take")),
)


def random_group(gid, rewards, step, lag, mixed, rng):
    """A group whose oldest token is `lag` versions behind `step`; `mixed` rollouts span a sync."""
    base = max(0, step - lag)
    rollouts = []
    for i in range(len(rewards)):
        n = rng.randrange(0, 6)
        segments = ((0, base), (2, min(step, base + 1))) if mixed and base < step else ((0, base),)
        rollouts.append(make_rollout(length=n, segments=segments, seed=rng.randrange(1 << 30)))
    return make_group(gid, rewards, rollouts=rollouts)


@settings(max_examples=60, deadline=None)
@given(cfg=configs(), ops=st.lists(op, max_size=60), seed=st.integers(0, 2**16))
def test_random_interleavings_keep_every_invariant(cfg, ops, seed):
    rng = random.Random(seed)
    buf = make_buffer(**cfg)
    bound, batch_size = cfg["staleness"], cfg["batch"]
    step, last_release, released_ids, next_id, released_rollouts = 0, None, set(), 0, 0
    for action in ops:
        if action[0] == "admit":
            _, lag, mixed, rewards = action
            group = random_group(f"g{next_id}", rewards, step, lag, mixed, rng)
            next_id += 1
            before = {g.group_id: g.min_version for g in buf.buffered()}
            res = buf.admit(group)
            after = {g.group_id: g.min_version for g in buf.buffered()}
            before[group.group_id] = group.min_version
            if res.status != "dropped_zero_signal":
                removed = set(before) - set(after)
                stale = {gid for gid in removed if step - before[gid] > bound}
                assert len(stale) == res.evicted_stale
                by_capacity = removed - stale
                assert len(by_capacity) == res.evicted_capacity
                if by_capacity and after:  # oldest first: nothing evicted is younger than a survivor
                    assert max(before[g] for g in by_capacity) <= min(after.values())
            assert all(step - v <= bound for v in after.values())
        elif action[0] == "step":
            step += action[1]
            buf.set_trainer_step(step)
            assert all(step - g.min_version <= bound for g in buf.buffered())
        else:
            if last_release == step:
                with pytest.raises(ValueError, match="already released"):
                    buf.take_batch(step)
                continue
            buf.set_trainer_step(step)
            snapshot = buf.buffered()
            versions = [g.min_version for g in snapshot]
            assert versions == sorted(versions)
            batch = buf.take_batch(step)
            if len(snapshot) < cfg["ready"] * batch_size:
                assert batch is None
                continue
            assert batch is not None and batch.trainer_step == step
            assert [g.group_id for g in batch.groups] == [g.group_id for g in snapshot[:batch_size]]
            last_release = step
            ids = [g.group_id for g in batch.groups]
            assert released_ids.isdisjoint(ids) and len(set(ids)) == len(ids)
            released_ids.update(ids)
            recomputed = [rollout_staleness_from_versions(step, r) for r in batch.rollouts()]
            assert all(0 <= s <= bound for s in recomputed)
            assert batch.staleness.tolist() == recomputed
            assert batch.num_sequences == sum(g.size for g in batch.groups)
            released_rollouts += batch.num_sequences
        assert_conservation(buf)
    m = buf.metrics()
    assert sum(m[f"staleness/cumulative_{s}"] for s in range(bound + 1)) == released_rollouts
    assert m["buffer/released"] == len(released_ids)


@st.composite
def paced_configs(draw):
    """Configurations where min_ready_batches <= max_staleness_steps - sync_every_steps + 2."""
    sync = draw(st.integers(1, 3))
    staleness = draw(st.integers(sync - 1, sync + 2))
    ready = draw(st.integers(1, staleness - sync + 2))
    return dict(batch=draw(st.integers(1, 3)), sync=sync, staleness=staleness, ready=ready,
                capacity=draw(st.integers(ready, ready + 2)), dynamic_sampling=True)


@settings(max_examples=60, deadline=None)
@given(cfg=paced_configs(), seed=st.integers(0, 2**16), max_delay=st.integers(0, 4),
       train_ticks=st.integers(1, 3), greedy=st.booleans(), in_order=st.booleans())
def test_workers_following_the_credit(cfg, seed, max_delay, train_ticks, greedy, in_order):
    """A simulated pipeline: workers start the whole credit (`greedy`) or a random part of it, at the
    synced version; groups finish after a random delay, in the order they were started (`in_order`) or
    not, and some carry no signal (dropped); the trainer pulls when ready, trains for `train_ticks`
    ticks, and the weights sync as soon as every `sync`-th step is done.

    Always: released staleness within the bound (from the recorded versions), no capacity eviction,
    the trainer never stalls. In-order completion: no group is ever wasted as stale either. Out of
    order, a group started at version w may finish after the last pull that w allows (the trainer does
    not wait for it): the buffer evicts it, which is the hard bound doing its job."""
    rng = random.Random(seed)
    buf = make_buffer(**cfg)
    steps_wanted, step, generating_version, busy_until, training = 8, 0, 0, 0, False
    in_flight: list[tuple[int, int, int]] = []  # (finish tick, group number, version)
    next_id, last_finish = 0, 0
    for tick in range(400):
        credit = buf.admission_credit(len(in_flight), generating_version)
        for _ in range(credit if greedy else rng.randint(0, credit)):
            finish = tick + rng.randint(0, max_delay)
            if in_order:
                finish = last_finish = max(finish, last_finish)
            in_flight.append((finish, next_id, generating_version))
            next_id += 1
        done = sorted(f for f in in_flight if f[0] <= tick)
        if not in_order:
            rng.shuffle(done)
        for f in done:
            in_flight.remove(f)
            rewards = [1, 0] if rng.random() < 0.8 else [0, 0]
            buf.admit(make_group(f"g{f[1]}", rewards, version=f[2]))
        if training and tick >= busy_until:
            training = False
            step += 1
            buf.set_trainer_step(step)  # the optimizer step is done: the trainer holds version `step`
            if step % cfg["sync"] == 0:
                generating_version = step
        if not training and buf.ready():
            batch = buf.take_batch(step)
            assert all(rollout_staleness_from_versions(step, r) <= cfg["staleness"] for r in batch.rollouts())
            busy_until, training = tick + train_ticks, True
        assert_conservation(buf)
        if step == steps_wanted:
            break
    c = buf.counts()
    assert step == steps_wanted, f"trainer stalled at step {step}: {c}"  # liveness
    assert c["evicted_capacity"] == 0, c
    if in_order:
        assert c["evicted_stale"] == 0, c
