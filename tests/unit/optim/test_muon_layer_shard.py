"""Layer-shard plan: torch.chunk row ranges, LPT owner assignment, and the two all_to_all messages
emulated in-process for 2–4 ranks (uneven shards, ranks holding no rows)."""

import pytest
import torch

from zrl.optim.layer_shard import LayerShardPlan, assign_owners, row_ranges, shard_layout
from zrl.optim.newton_schulz import ns_flops


@pytest.mark.parametrize("rows, world, expected", [
    (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),  # ceil(5/4) = 2: the last rank holds nothing
    (3, 2, [(0, 2), (2, 3)]),
    (1, 2, [(0, 1), (1, 1)]),
    (0, 2, [(0, 0), (0, 0)]),
    (8, 2, [(0, 4), (4, 8)]),
])
def test_row_ranges_hand_cases(rows, world, expected):
    assert row_ranges(rows, world) == expected


def test_row_ranges_follow_torch_chunk():
    for rows in range(0, 12):
        for world in range(1, 6):
            sizes = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
            sizes += [0] * (world - len(sizes))
            assert [end - start for start, end in row_ranges(rows, world)] == sizes, (rows, world)


def test_assign_owners_longest_first_to_least_loaded():
    # 10 → r0, 7 → r1, 5 → r1 (7 < 10), 3 → r0 (10 < 12): loads 13 / 12
    assert assign_owners([10, 7, 5, 3], 2, [0, 0]) == [0, 1, 1, 0]
    # initial loads from local experts: 10 → r1, 7 → r0 (8 < 10), 5 → r1 (10 < 15), 3 → r0 (tie, lower rank)
    assert assign_owners([10, 7, 5, 3], 2, [8, 0]) == [1, 0, 1, 0]
    # equal costs: item order breaks ties, round-robin over ranks
    assert assign_owners([4] * 6, 3, [0, 0, 0]) == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="initial loads"):
        assign_owners([1], 2, [0])


def test_plan_loads_are_balanced():
    shapes = [(8, 8)] * 6 + [(16, 8)] * 3
    plan = LayerShardPlan(shapes, world_size=3, rank=0, initial_loads=[0, 0, 0], steps=5)
    assert sum(plan.loads) == sum(ns_flops(s) for s in shapes)
    assert plan.loads == [plan.loads[0]] * 3  # 3 tall + 6 square matrices split evenly


def _emulate_all_to_all(sends, send_splits):
    """recv[d] = concatenation over sources s of the segment s addressed to d."""
    world = len(sends)
    segments = [list(torch.split(sends[s], send_splits[s])) for s in range(world)]
    return [torch.cat([segments[s][d] for s in range(world)]) for d in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_round_trip_through_owners(world):
    shapes = [(7, 5), (3, 4), (16, 6), (1, 9), (10, 10), (5, 12)]
    torch.manual_seed(world)
    fulls = [torch.randn(s).bfloat16() for s in shapes]
    plans = [LayerShardPlan(shapes, world, r, initial_loads=[0] * world, steps=5) for r in range(world)]
    assert all(p.owners == plans[0].owners for p in plans)  # derived from shapes alone

    shards = [[full[slice(*row_ranges(full.shape[0], world)[r])] for full in fulls] for r in range(world)]
    sends = [plans[r].pack_forward(shards[r], torch.bfloat16, torch.device("cpu")) for r in range(world)]
    fwd = [plans[r].forward_splits() for r in range(world)]
    for s in range(world):  # what s sends to d is what d expects from s
        for d in range(world):
            assert fwd[s][0][d] == fwd[d][1][s]
    recvs = _emulate_all_to_all(sends, [f[0] for f in fwd])
    owned_seen = []
    for r in range(world):
        owned = plans[r].unpack_forward(recvs[r])
        for i, full in zip(plans[r].owned, owned):
            assert torch.equal(full, fulls[i])
        owned_seen += plans[r].owned
    assert sorted(owned_seen) == list(range(len(shapes)))  # each matrix has exactly one owner

    # backward: owners return "updates" (2·G + i) and a skip flag for odd items
    sends = [plans[r].pack_backward([2 * fulls[i].float() + i for i in plans[r].owned],
                                    [i % 2 == 1 for i in plans[r].owned], torch.bfloat16, torch.device("cpu"))
             for r in range(world)]
    bwd = [plans[r].backward_splits() for r in range(world)]
    recvs = _emulate_all_to_all(sends, [b[0] for b in bwd])
    for r in range(world):
        for i, (rows, skipped) in enumerate(plans[r].unpack_backward(recvs[r])):
            start, end = row_ranges(shapes[i][0], world)[r]
            assert torch.equal(rows, (2 * fulls[i].float() + i).bfloat16()[start:end])
            assert skipped == (i % 2 == 1)


def test_unpack_rejects_a_wrong_message_size():
    plan = LayerShardPlan([(2, 2)], 1, 0, [0], steps=5)
    with pytest.raises(RuntimeError, match="forward message"):
        plan.unpack_forward(torch.zeros(5))


def test_plain_tensor_has_no_shard_layout():
    assert shard_layout(torch.zeros(3, 3)) is None
