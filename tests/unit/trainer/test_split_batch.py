"""The buffer's split of a released batch into per-rank shares: each rank gets only its own rollouts."""

import numpy as np
import pytest

from zrl.models import ModelShape
from zrl.trainer.packing import plan_ranks, split_batch
from zrl.trainer.synthetic import synthetic_train_batch

SHAPE = ModelShape(vocab_size=64, num_layers=2, num_experts=4, experts_per_token=1, skip_class=True)


@pytest.fixture
def batch():
    return synthetic_train_batch(vocab_size=64, shape=SHAPE, num_groups=5, group_size=4,
                                 trainer_step=3, seed=1, empty_responses=2)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shares_cover_every_packed_rollout_once(batch, world_size):
    shares = split_batch(batch, world_size, token_budget=64)
    rollouts = batch.rollouts()
    packed = [i for i, r in enumerate(rollouts) if len(r.token_ids) > 0]
    got = [id(r) for share in shares for r in share.rollouts]
    assert sorted(got) == sorted(id(rollouts[i]) for i in packed)  # empty responses are on no rank
    advantages = {id(r): a for r, a in zip(rollouts, batch.advantages())}
    for rank, share in enumerate(shares):
        assert share.rank == rank and share.trainer_step == 3
        assert (share.num_sequences, share.num_response_tokens) == (batch.num_sequences, batch.num_response_tokens)
        assert share.max_staleness == batch.max_staleness
        np.testing.assert_array_equal(share.advantages, [advantages[id(r)] for r in share.rollouts])
        flat = sorted(i for mb in share.microbatches for i in mb)
        assert flat == list(range(len(share.rollouts)))  # microbatches index the share's own rollouts
    assert len({len(share.microbatches) for share in shares}) == 1  # same microbatch count on every rank


def test_shares_follow_the_packing_plan(batch):
    lengths = [len(r.prompt_ids) + len(r.token_ids) - 1 if len(r.token_ids) else 0 for r in batch.rollouts()]
    plans = plan_ranks(lengths, 2, token_budget=64)
    rollouts = batch.rollouts()
    for share, plan in zip(split_batch(batch, 2, token_budget=64), plans):
        expected = [[id(rollouts[i]) for i in mb] for mb in plan.microbatches]
        assert [[id(share.rollouts[k]) for k in mb] for mb in share.microbatches] == expected
        assert share.num_bytes == sum(r.prompt_ids.nbytes + r.token_ids.nbytes + r.logprobs.nbytes
                                      + (0 if r.routing is None else r.routing.nbytes) for r in share.rollouts)
