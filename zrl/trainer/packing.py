"""Token-budget packing of variable-length sequences into microbatches, balanced across ranks.

Plan (pure, deterministic; after Megatron-Core MoE §10.3 on balancing RL batches, docs/algorithms.md sources):
1. Assign sequences to data-parallel ranks, longest first, each to the rank with the lowest load, where
   load blends tokens and attention cost (sum of len^2) normalised by their batch totals: tokens decide
   MLP/expert time, len^2 decides attention time.
2. On each rank, first-fit-decreasing into microbatches of at most `token_budget` tokens. No padding:
   a microbatch is one flat token stream with document boundaries.
3. Every rank runs the same number of microbatches (FSDP2 collectives run per microbatch): ranks with
   fewer are topped up by splitting their largest multi-sequence microbatches, then with empty
   microbatches, which the trainer runs as zero-token steps.
Invariants: every sequence index appears exactly once; no microbatch exceeds the budget; a sequence
longer than the budget is an error (a document is never split).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zrl.types import RankShare, TrainBatch


@dataclass(frozen=True)
class PackingPlan:
    microbatches: list[list[list[int]]]  # [rank][microbatch] -> sequence indices, in packing order
    lengths: list[int]
    token_budget: int

    @property
    def world_size(self) -> int:
        return len(self.microbatches)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0]) if self.microbatches else 0

    def rank_tokens(self) -> list[int]:
        return [sum(self.lengths[i] for mb in rank for i in mb) for rank in self.microbatches]

    def rank_attention_cost(self) -> list[int]:
        return [sum(self.lengths[i] ** 2 for mb in rank for i in mb) for rank in self.microbatches]

    def stats(self) -> dict[str, float]:
        """Packing efficiency (tokens / budget slots used) vs padding every sequence to the longest."""
        tokens = sum(self.lengths)
        slots = self.world_size * self.num_microbatches * self.token_budget
        padded = len(self.lengths) * max(self.lengths, default=0)
        per_rank = self.rank_tokens()
        return {
            "packing/efficiency": tokens / slots if slots else 0.0,
            "packing/padded_efficiency": tokens / padded if padded else 0.0,
            "packing/microbatches": float(self.num_microbatches),
            "packing/rank_token_imbalance": max(per_rank) / (sum(per_rank) / len(per_rank)) if tokens else 1.0,
        }


def plan_microbatches(lengths: list[int], world_size: int, token_budget: int) -> PackingPlan:
    if world_size < 1 or token_budget < 1:
        raise ValueError(f"world_size ({world_size}) and token_budget ({token_budget}) must be >= 1")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        raise ValueError(f"sequences longer than the token budget {token_budget}: {too_long[:5]} "
                         "(raise trainer token_budget to at least max_prompt_tokens + max_response_tokens)")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence needs at least one token")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks = _assign_ranks(lengths, order, world_size)
    microbatches = [_first_fit_decreasing(lengths, rank, token_budget) for rank in ranks]
    target = max((len(mbs) for mbs in microbatches), default=0)
    for mbs in microbatches:
        _top_up(mbs, lengths, target)
    return PackingPlan(microbatches=microbatches, lengths=list(lengths), token_budget=token_budget)


def _assign_ranks(lengths: list[int], order: list[int], world_size: int) -> list[list[int]]:
    total_tokens = max(sum(lengths), 1)
    total_attention = max(sum(n * n for n in lengths), 1)
    tokens = [0] * world_size
    attention = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        n = lengths[i]
        # Load after adding i; ties go to the lowest rank so the plan is deterministic.
        best = min(range(world_size), key=lambda r: (
            (tokens[r] + n) / total_tokens + (attention[r] + n * n) / total_attention, r))
        ranks[best].append(i)
        tokens[best] += n
        attention[best] += n * n
    return ranks


def _first_fit_decreasing(lengths: list[int], indices: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in indices:  # already longest first
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def _top_up(microbatches: list[list[int]], lengths: list[int], target: int) -> None:
    while len(microbatches) < target:
        splittable = [mb for mb in microbatches if len(mb) > 1]
        if not splittable:
            microbatches.append([])
            continue
        largest = max(splittable, key=lambda mb: sum(lengths[i] for i in mb))
        half = _split_point(largest, lengths)
        microbatches.append(largest[half:])
        del largest[half:]


def _split_point(mb: list[int], lengths: list[int]) -> int:
    """Index that splits `mb` into two parts of the most even token counts."""
    total, running, best, best_gap = sum(lengths[i] for i in mb), 0, 1, None
    for k in range(1, len(mb)):
        running += lengths[mb[k - 1]]
        gap = abs(total - 2 * running)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    return best


def input_length(prompt_len: int, response_len: int) -> int:
    """Tokens a sequence occupies in a microbatch (0 when it has no loss token)."""
    if prompt_len < 1:
        raise ValueError("every sequence needs at least one prompt token (the first response token is "
                         "predicted from it)")
    return prompt_len + response_len - 1 if response_len > 0 else 0


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a plan: microbatches as lists of batch indices (empty = no sequence)."""

    microbatches: list[list[int]]
    plan: PackingPlan
    lengths: list[int]  # [N_seq] input tokens per sequence (0 = not packed)


def plan_ranks(lengths: Sequence[int], world_size: int, token_budget: int) -> list[RankPlan]:
    """Pack the sequences with a non-zero length; every rank's microbatches as batch indices."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > token_budget]
    if too_long:  # reported here with batch indices (the plan sees only the packed subset)
        raise ValueError(f"sequences (batch index, input tokens) longer than the token budget {token_budget}: "
                         f"{too_long[:5]}; raise the trainer token_budget to at least max_prompt_tokens + "
                         "max_response_tokens")
    packed = [i for i, n in enumerate(lengths) if n > 0]
    plan = plan_microbatches([lengths[i] for i in packed], world_size, token_budget)
    return [RankPlan(microbatches=[[packed[j] for j in mb] for mb in rank], plan=plan, lengths=list(lengths))
            for rank in plan.microbatches]


def plan_rank(lengths: Sequence[int], rank: int, world_size: int, token_budget: int) -> RankPlan:
    """`rank`'s part of `plan_ranks` (every rank computes the same plan from the same lengths)."""
    return plan_ranks(lengths, world_size, token_budget)[rank]


def split_batch(batch: TrainBatch, world_size: int, token_budget: int) -> list[RankShare]:
    """One `RankShare` per trainer rank: the rollouts the plan packs on that rank, with global counts.

    Rollouts with an empty response are on no rank (they have no loss token) but count in N_seq.
    """
    rollouts, advantages = batch.rollouts(), batch.advantages()
    lengths = [input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts]
    shares = []
    for rank, part in enumerate(plan_ranks(lengths, world_size, token_budget)):
        order = [i for mb in part.microbatches for i in mb]
        local = {i: k for k, i in enumerate(order)}
        shares.append(RankShare(
            trainer_step=batch.trainer_step, rank=rank, rollouts=tuple(rollouts[i] for i in order),
            advantages=advantages[order],
            microbatches=tuple(tuple(local[i] for i in mb) for mb in part.microbatches),
            num_sequences=batch.num_sequences, num_response_tokens=batch.num_response_tokens,
            max_staleness=batch.max_staleness, mean_staleness=float(np.mean(batch.staleness)),
            advantage_abs_mean=float(np.mean(np.abs(advantages))), packing_stats=part.plan.stats()))
    return shares
