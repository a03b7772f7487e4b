"""Scoring tokens under the weights that sampled them, whatever the weight-sync cadence.

`mismatch/onpolicy_*` compares the engine's behaviour logprobs with the trainer's over tokens scored by
the trainer under the weights that sampled them: there any difference is engine/trainer mismatch alone
(a tensor missed at weight sync, a kernel bug), not policy change. The loss pass scores every token
under the weights being trained (version v), and version v reaches the rollout engines only at the
sync after step v - 1: under asynchrony the batch of step v was sampled almost entirely before that, so
the loss pass alone rarely finds such tokens.

So each trainer rank keeps `SyncedShards`: a host copy of its own parameter shards (and of the buffers
a weight sync sends, `zrl.trainer.export.weight_tensors`) holding the newest synced version u OLDER
than the one being trained (u < v). Every RL step, before its training microbatches, scores up to
`TrainerSettings.onpolicy_mismatch_tokens` of its share's tokens sampled by u (`onpolicy_sample`: one
packed microbatch of response prefixes, router replay as in training) under that copy; the tokens of v
itself, if any, stay with the loss pass. The two sets are disjoint and feed the same statistics.

Lifecycle, one host buffer: a weight sync of version v (TrainerRank.sync_weights / export_state, on
every rank) notes v (`synced`); the next RL step (the trainer still holds v) first scores version u
under the copy, then the copy becomes v (the restore after scoring leaves the current weights in the
buffer, so refreshing costs nothing extra). At step v' the copy therefore holds the newest synced
version below v', with any sync cadence. Why not the newest synced version itself: with a sync after
every step that is the version being trained, whose tokens the loss pass already scores; the one
before it costs the same single buffer. Tokens older than u are not scored.

Invariants:
- Training is unchanged: weights only move by copies (swap in = exchange each shard with the buffer;
  restore = exchange back, or copy the buffer back when it refreshes), so the weights after the
  scoring are the current ones bit for bit, before any training microbatch runs.
- Collective: the scoring forward all-gathers every rank's shards, so every rank swaps and runs it, or
  none does. Whether it runs depends only on the copy's version and the batch's trainer step and max
  staleness (the same on every rank); a rank whose share holds no such token runs the 1-token dummy.
- FSDP2 keeps the root module's gathered parameters after a forward (they are freed in backward);
  after the no-grad scoring forward `reset_iter_state` reshards every module and clears the recorded
  forward order, so the training forward gathers the restored shards (TrainerWorker._score_onpolicy).

Cost (per rank): host memory = 4 bytes x the rank's share of the fp32 parameters (plus the small
fp32 balancing-bias buffers), i.e. the model's fp32 size / FSDP shard size (an 8e9-parameter model on
8 ranks: 4 GB); pinned on CUDA, where the device holds one parameter shard's temporary at a time. Time
per step: 4 shard-sized copies between host and device (3 on a step that refreshes the copy; 1 when
the batch cannot hold the copy's tokens and the copy only refreshes), asynchronous on CUDA, then one
no-grad forward of at most `onpolicy_mismatch_tokens` response tokens with their prompts, within the
microbatch token budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zrl.trainer.export import weight_tensors
from zrl.trainer.packing import input_length
from zrl.types import Rollout


def _local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """This rank's part of everything a weight sync sends that training changes: local shards of the trained
    parameters (views of FSDP2's sharded storage, written in place) and the replicated buffers. A frozen
    parameter (the base under LoRA, zrl.modeling.lora) is the same in every version: it is not copied."""
    return [t.to_local() if isinstance(t, DTensor) else t for _, t, is_param in weight_tensors(model)
            if t.requires_grad or not is_param]


class SyncedShards:
    """This rank's copy of the weights of one synced policy version, in host memory (see module docstring)."""

    def __init__(self) -> None:
        self.version: int | None = None  # the version the copy holds; None: no copy
        self.pending: int | None = None  # a version synced since, which the next RL step copies
        self._held: list[torch.Tensor] = []  # [per weight tensor] shaped like the local shard

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._held)

    def synced(self, version: int) -> None:
        """The rollout engines now hold `version` (the trainer's current weights)."""
        self.pending = version

    def drop(self) -> None:
        """Forget the copy and free its memory (a new stage's engines or a loaded checkpoint)."""
        self.version, self.pending, self._held = None, None, []

    def scored_version(self, trainer_step: int, max_staleness: int) -> int | None:
        """The version whose tokens the step of `trainer_step` scores under the copy; None when the batch
        (tokens of versions trainer_step - max_staleness .. trainer_step) can hold none."""
        if self.version is None or not trainer_step - max_staleness <= self.version < trainer_step:
            return None
        return self.version

    def refreshes(self, trainer_step: int) -> bool:
        """Whether this step's current weights become the copy (a sync of them happened since the last step)."""
        return self.pending == trainer_step

    @torch.no_grad()
    def refresh(self, model: nn.Module, version: int) -> None:
        """Copy the current weights (`version`) into the buffer, allocating it the first time."""
        local = _local_tensors(model)
        if not self._held:
            pin = local[0].device.type == "cuda"  # pinned: asynchronous copies, no staging buffer
            self._held = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in local]
        for held, current in zip(self._held, local, strict=True):
            held.copy_(current, non_blocking=True)  # stream-ordered before any later update of `current`
        self.version, self.pending = version, None

    @contextlib.contextmanager
    def swapped_in(self, model: nn.Module, current_version: int) -> Iterator[None]:
        """Inside: the model's local weights are the copy's version. On leaving (also on an error) the
        current weights are back, bit for bit; when they were synced since (`refreshes`) they stay in
        the buffer as the new copy."""
        self._exchange(model)  # the model holds `version`, the buffer the current weights
        try:
            yield
        finally:
            if self.refreshes(current_version):
                self._copy_back(model)
                self.version, self.pending = current_version, None
            else:
                self._exchange(model)  # an exchange is its own inverse

    @torch.no_grad()
    def _exchange(self, model: nn.Module) -> None:
        for held, local in zip(self._held, _local_tensors(model), strict=True):
            current = local.clone()  # one shard-sized temporary at a time
            local.copy_(held, non_blocking=True)
            held.copy_(current, non_blocking=True)

    @torch.no_grad()
    def _copy_back(self, model: nn.Module) -> None:
        for held, local in zip(self._held, _local_tensors(model), strict=True):
            local.copy_(held, non_blocking=True)


def response_prefix(rollout: Rollout, num_tokens: int) -> Rollout:
    """The rollout cut after its first `num_tokens` response tokens. Causal: every kept token's trainer
    logprob is the one it has in the whole rollout."""
    if num_tokens == len(rollout.token_ids):
        return rollout
    return dataclasses.replace(
        rollout, token_ids=rollout.token_ids[:num_tokens], logprobs=rollout.logprobs[:num_tokens],
        routing=None if rollout.routing is None else rollout.routing[:len(rollout.prompt_ids) + num_tokens],
        version_segments=tuple((s, v) for s, v in rollout.version_segments if s < num_tokens),
        policy_mask=None if rollout.policy_mask is None else rollout.policy_mask[:num_tokens], text="")


def onpolicy_sample(rollouts: Sequence[Rollout], version: int, *, max_scored_tokens: int, max_input_tokens: int,
                    seed: Sequence[int]) -> list[Rollout]:
    """Response prefixes of `rollouts` holding at most `max_scored_tokens` policy tokens sampled by
    `version` in all, whose packed length stays within `max_input_tokens` (the first one is always
    taken: any single rollout fits a microbatch). Rollouts are visited in an order drawn from `seed`,
    so the sample spreads over the share's groups instead of taking its first ones."""
    order = np.random.default_rng(list(seed)).permutation(len(rollouts))
    chosen, scored, packed = [], 0, 0
    for i in order:
        r = rollouts[i]
        hits = r.token_versions() == version  # [Tr]
        if r.policy_mask is not None:
            hits &= r.policy_mask
        counts = np.cumsum(hits)  # [Tr] such tokens up to and including each position
        if not len(counts) or counts[-1] == 0:
            continue
        take = min(max_scored_tokens - scored, int(counts[-1]))
        keep = int(np.searchsorted(counts, take)) + 1  # the prefix ending at the take-th such token
        length = input_length(len(r.prompt_ids), keep)
        if chosen and packed + length > max_input_tokens:
            continue  # a shorter rollout may still fit
        chosen.append(response_prefix(r, keep))
        scored += take
        packed += length
        if scored == max_scored_tokens:
            break
    return chosen
