"""Rollouts -> packed microbatches: token alignment, per-token fields, routing rows, plan shares, dummies."""

import numpy as np
import pytest
import torch

from zrl.trainer.batch import SFTExample, dummy_microbatch, pack_rollouts, pack_sft
from zrl.trainer.packing import input_length, plan_rank
from zrl.types import Rollout

CPU = torch.device("cpu")
L = 2


def rollout(prompt, tokens, logprobs, routing=None, segments=((0, 5),)):
    return Rollout(prompt_ids=np.array(prompt, dtype=np.int32), token_ids=np.array(tokens, dtype=np.int32),
                   logprobs=np.array(logprobs, dtype=np.float32), routing=routing, version_segments=segments,
                   finish_reason="stop")


def test_input_length():
    assert input_length(3, 2) == 4  # the last sampled token is never an input
    assert input_length(1, 1) == 1
    assert input_length(3, 0) == 0  # no loss token: not packed
    with pytest.raises(ValueError, match="at least one prompt token"):
        input_length(0, 4)


def test_pack_two_rollouts_by_hand():
    routing_a = np.arange(10, dtype=np.uint8).reshape(5, L)  # [Tp + Tr, L] = [5, 2]
    a = rollout([5, 6, 7], [8, 9], [-0.5, -1.5], routing=routing_a, segments=((0, 4), (1, 5)))
    b = rollout([11], [12, 13, 14], [-0.1, -0.2, -0.3])  # no routing record
    mb = pack_rollouts([b, a], np.array([2.0, -1.0]), [1, 0], num_layers=L, replay=True, device=CPU)
    # a first (plan order), then b
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 11, 12, 13]
    assert mb.targets.tolist() == [6, 7, 8, 9, 12, 13, 14]
    assert mb.cu_seqlens == (0, 4, 7)
    assert mb.loss_mask.tolist() == [False, False, True, True, True, True, True]
    assert mb.seq_idx.tolist() == [1, 1, 1, 1, 0, 0, 0]
    assert mb.behaviour_logprobs.tolist() == pytest.approx([0, 0, -0.5, -1.5, -0.1, -0.2, -0.3])
    assert mb.advantages.tolist() == [0, 0, -1, -1, 2, 2, 2]
    assert mb.versions.tolist() == [-1, -1, 4, 5, 5, 5, 5]
    assert mb.routing.dtype == torch.uint8
    assert mb.routing[:4].tolist() == routing_a[:4].tolist()  # the last row (token 9) is not an input
    assert (mb.routing[4:] == 255).all()  # no record: route natively
    assert mb.num_sequences == 2 and mb.num_tokens == 7 and not mb.is_dummy


def test_pack_without_replay_and_errors():
    a = rollout([5, 6], [7], [-1.0], routing=np.zeros((3, L), dtype=np.uint8))
    assert pack_rollouts([a], np.array([1.0]), [0], num_layers=L, replay=False, device=CPU).routing is None
    wrong = rollout([5, 6], [7], [-1.0], routing=np.zeros((3, L + 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="MoE layers"):
        pack_rollouts([wrong], np.array([1.0]), [0], num_layers=L, replay=True, device=CPU)
    empty = rollout([5, 6], [], [])
    with pytest.raises(ValueError, match="empty response"):
        pack_rollouts([empty], np.array([1.0]), [0], num_layers=L, replay=True, device=CPU)


def test_empty_index_list_is_the_dummy():
    mb = pack_rollouts([], np.array([]), [], num_layers=L, replay=True, device=CPU)
    assert mb.is_dummy and mb.num_tokens == 1 and mb.targets.tolist() == [-1] and not mb.loss_mask.any()
    assert mb.routing.tolist() == [[255, 255]]
    assert dummy_microbatch(CPU).routing is None


def test_plan_rank_skips_empty_responses_and_covers_the_rest():
    lengths = [4, 0, 9, 3, 0, 7, 1]
    shares = [plan_rank(lengths, r, 2, token_budget=10) for r in range(2)]
    assert len(shares[0].microbatches) == len(shares[1].microbatches)
    packed = sorted(i for s in shares for mb in s.microbatches for i in mb)
    assert packed == [0, 2, 3, 5, 6]  # batch indices; 1 and 4 have no loss token
    for s in shares:
        for mb in s.microbatches:
            assert sum(lengths[i] for i in mb) <= 10
    assert shares[0].plan == shares[1].plan  # the same plan on every rank
    with pytest.raises(ValueError, match=r"budget 8: \[\(2, 9\)\]"):  # batch index 2, not a subset index
        plan_rank(lengths, 0, 2, token_budget=8)


def test_pack_sft():
    ex = [SFTExample(np.array([1, 2]), np.array([3, 4, 5])), SFTExample(np.array([6]), np.array([7]))]
    mb = pack_sft(ex, [1, 0], device=CPU)
    assert mb.input_ids.tolist() == [6, 1, 2, 3, 4]
    assert mb.targets.tolist() == [7, 2, 3, 4, 5]
    assert mb.loss_mask.tolist() == [True, False, True, True, True]
    assert mb.cu_seqlens == (0, 1, 5) and mb.routing is None
    assert pack_sft(ex, [], device=CPU).is_dummy


def test_environment_tokens_are_context_not_loss_targets():
    """A multi-turn response: tokens an environment wrote between the policy's turns (policy_mask False)
    are inputs with their routing rows (replayed like every other token) but no loss position, behaviour
    logprob, advantage or version."""
    routing = np.arange(14, dtype=np.uint8).reshape(7, L)  # [Tp + Tr, L]
    policy = np.array([True, False, False, True, True])
    r = Rollout(prompt_ids=np.array([5, 6], np.int32), token_ids=np.array([7, 8, 9, 10, 11], np.int32),
                logprobs=np.array([-0.5, 9.0, 9.0, -1.5, -2.5], np.float32), routing=routing,
                version_segments=((0, 3), (1, 1), (3, 4)), finish_reason="stop", policy_mask=policy)
    assert r.num_policy_tokens == 3 and r.min_version == 3  # version 1 marks only environment tokens
    mb = pack_rollouts([r], np.array([2.0]), [0], num_layers=L, replay=True, device=CPU)
    assert mb.targets.tolist() == [6, 7, 8, 9, 10, 11]
    assert mb.loss_mask.tolist() == [False, True, False, False, True, True]
    assert mb.behaviour_logprobs.tolist() == pytest.approx([0, -0.5, 0, 0, -1.5, -2.5])
    assert mb.advantages.tolist() == [0, 2, 0, 0, 2, 2]
    assert mb.versions.tolist() == [-1, 3, -1, -1, 4, 4]
    assert mb.routing.tolist() == routing[:6].tolist()  # every input token, the environment's included
    with pytest.raises(ValueError, match=r"policy_mask must be a \[5\] bool array"):
        Rollout(prompt_ids=r.prompt_ids, token_ids=r.token_ids, logprobs=r.logprobs, routing=None,
                version_segments=((0, 1),), finish_reason="stop", policy_mask=np.ones(4, bool))
