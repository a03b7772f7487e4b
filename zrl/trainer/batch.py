"""Rollouts (or SFT examples) -> flat packed microbatches for one rank, by the shared packing plan.

Layout of one sequence (prompt p_0..p_{Tp-1}, response y_0..y_{Tr-1}, full = p ++ y; docs/shapes.md):
  inputs  = full[:-1]        Tp + Tr - 1 tokens (the last sampled token predicts nothing)
  targets = full[1:]         the response token y_j is the target at input position Tp - 1 + j
  loss_mask, behaviour logprobs, advantages, versions: set at positions Tp - 1 .. Tp + Tr - 2 (the loss
  mask only where the target is a token the policy sampled: rollout.policy_mask)
  routing = rollout.routing[:Tp + Tr - 1]   ([Tp + Tr, L * k] recorded, k experts per token and layer,
                                            layer-major; its last row is never an input)
Sequences are laid end to end in plan order with `cu_seqlens` boundaries; no padding anywhere.
The boundaries stay on the host (Python ints, what the model's layout needs); the per-token tensors
are copied to the device asynchronously (`copy_to_device`), so building a microbatch never waits
for the GPU.

The packing plan (zrl.trainer.packing) decides which rank and microbatch every sequence goes to; an RL
rank receives only its own share of the batch (`RankShare`), an SFT rank plans from the same examples
as every other rank (deterministic) and builds only its own microbatches. A rollout with an empty response has no loss token: it is not
packed (it still counts in the global N_seq, which comes from the batch). A plan slot with no
sequence becomes `dummy_microbatch()`: one token with no loss, run only so that the rank joins the
FSDP2 collectives of that microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zrl.modeling.packing import copy_to_device
from zrl.trainer.packing import input_length
from zrl.types import NO_ROUTE, Rollout


@dataclass(frozen=True)
class SFTExample:
    """One supervised demonstration: the loss is on `token_ids` given `prompt_ids`, only where `loss_mask`
    is True when one is given (a multi-turn demonstration: the environment's replies are context)."""

    prompt_ids: np.ndarray  # [Tp] int, Tp >= 1
    token_ids: np.ndarray  # [Tr] int
    loss_mask: np.ndarray | None = None  # [Tr] bool, True where the token is trained; None: all of them

    def __post_init__(self):
        r = len(self.token_ids)
        if self.loss_mask is not None and (self.loss_mask.dtype != np.bool_ or self.loss_mask.shape != (r,)):
            raise ValueError(f"loss_mask must be a [{r}] bool array, got {self.loss_mask.dtype} {self.loss_mask.shape}")

    @property
    def num_trained_tokens(self) -> int:
        return len(self.token_ids) if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))


@dataclass(frozen=True)
class Microbatch:
    """One packed token stream (T tokens, N sequences) and its per-token training data."""

    input_ids: torch.Tensor  # [T] int64
    targets: torch.Tensor  # [T] int64, next token (-1 where none: the dummy's single token)
    cu_seqlens: tuple[int, ...]  # [N + 1] document boundaries, on the host (the model's layout needs them there)
    loss_mask: torch.Tensor  # [T] bool, True where the target is a response token
    seq_idx: torch.Tensor  # [T] int64, the sequence's index in the batch (group-major order)
    behaviour_logprobs: torch.Tensor  # [T] fp32, 0 off the mask
    advantages: torch.Tensor  # [T] fp32, 0 off the mask
    versions: torch.Tensor  # [T] int64 policy version that sampled the target, -1 off the mask
    routing: torch.Tensor | None  # [T, L * k] uint8 recorded expert ids (NO_ROUTE = no record), None = native
    num_sequences: int  # N (0 for the dummy)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_dummy(self) -> bool:
        return self.num_sequences == 0


def _sequence(prompt_ids: np.ndarray, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    full = np.concatenate([np.asarray(prompt_ids, dtype=np.int64), np.asarray(token_ids, dtype=np.int64)])
    return full[:-1], full[1:]


def _pack_tokens(pairs: Sequence[tuple[np.ndarray, np.ndarray]], indices: Sequence[int], empty_error: str):
    """Inputs, targets, loss mask and sequence index of the (prompt_ids, token_ids) pairs `indices`,
    each [T] concatenated, plus cu_seqlens bounds and each sequence's (prompt length, packed length)."""
    ids, tgts, mask, seq, bounds, layout = [], [], [], [], [0], []
    for i in indices:
        prompt_ids, token_ids = pairs[i]
        p, n = len(prompt_ids), len(token_ids)
        length = input_length(p, n)
        if length == 0:
            raise ValueError(empty_error.format(i=i))
        inputs, targets = _sequence(prompt_ids, token_ids)
        ids.append(inputs)
        tgts.append(targets)
        m = np.zeros(length, dtype=bool)
        m[p - 1:] = True  # the loss is on the response tokens, predicted from position p-1 on
        mask.append(m)
        seq.append(np.full(length, i, dtype=np.int64))
        bounds.append(bounds[-1] + length)
        layout.append((p, length))
    return [np.concatenate(x) for x in (ids, tgts, mask, seq)], bounds, layout


def _response_values(layout, values) -> np.ndarray:
    """[T] float32/int64: each sequence's per-response-token `values` at its loss positions, 0 elsewhere."""
    parts = []
    for (p, length), v in zip(layout, values):
        part = np.zeros(length, dtype=np.asarray(v).dtype if np.ndim(v) else np.float32)
        part[p - 1:] = v
        parts.append(part)
    return np.concatenate(parts)


def pack_rollouts(rollouts: Sequence[Rollout], advantages: np.ndarray, indices: Sequence[int], *,
                  num_layers: int, replay: bool, device: torch.device, num_experts: int | None = None,
                  experts_per_token: int = 1, skip_class: bool = True) -> Microbatch:
    """The microbatch of batch sequences `indices` (in that order). `advantages`: [N_seq] per rollout.

    Routing records are [T, L * k] (`num_layers` L, `experts_per_token` k; the model family's
    ModelShape). With `num_experts`, the recorded expert ids are checked here, on the host, where it
    costs nothing (ids in [0, E] with a skip class E, [0, E) without one, or NO_ROUTE); the model only
    asserts it on the device."""
    width = num_layers * experts_per_token
    if not indices:
        return dummy_microbatch(device, num_layers=width if replay else None)
    pairs = [(r.prompt_ids, r.token_ids) for r in rollouts]
    (ids, tgts, mask, seq), bounds, layout = _pack_tokens(pairs, indices, "sequence {i} has an empty response and cannot be packed")
    chosen = [rollouts[i] for i in indices]
    behaviour = _response_values(layout, [np.asarray(r.logprobs, dtype=np.float32) for r in chosen])
    adv = _response_values(layout, [np.float32(advantages[i]) for i in indices])
    versions = _response_values(layout, [r.token_versions() for r in chosen])
    policy = [r.policy_mask for r in chosen]
    if any(m is not None for m in policy):  # environment tokens between turns: context, never a target of the loss
        mask &= _response_values(layout, [np.ones(len(r.token_ids), bool) if m is None else m
                                          for r, m in zip(chosen, policy)])
    versions[~mask] = -1  # prompt positions carry no version
    behaviour[~mask] = 0.0
    adv[~mask] = 0.0

    def tensor(array, dtype):
        return copy_to_device(torch.from_numpy(array).to(dtype), device)

    routing = None
    if replay:
        rows = [_routing_rows(r, length, width, i, num_experts, skip_class)
                for r, (_, length), i in zip(chosen, layout, indices)]
        routing = tensor(np.concatenate(rows), torch.uint8)
    return Microbatch(
        input_ids=tensor(ids, torch.int64), targets=tensor(tgts, torch.int64),
        cu_seqlens=tuple(bounds), loss_mask=tensor(mask, torch.bool), seq_idx=tensor(seq, torch.int64),
        behaviour_logprobs=tensor(behaviour, torch.float32), advantages=tensor(adv, torch.float32),
        versions=tensor(versions, torch.int64), routing=routing, num_sequences=len(indices))


def _routing_rows(rollout: Rollout, length: int, width: int, index: int, num_experts: int | None,
                  skip_class: bool) -> np.ndarray:
    """[length, L * k] uint8 recorded ids of the input tokens; all 255 when the rollout has no record."""
    if rollout.routing is None:
        return np.full((length, width), NO_ROUTE, dtype=np.uint8)
    if rollout.routing.ndim != 2 or rollout.routing.shape[1] != width:
        raise ValueError(f"rollout {index}: routing has shape {rollout.routing.shape}, the model has "
                         f"{width} routing columns (MoE layers x experts per token)")
    rows = np.asarray(rollout.routing[:length])
    if num_experts is not None:
        top = num_experts if skip_class else num_experts - 1
        bad = ((rows < 0) | (rows > top)) & (rows != NO_ROUTE)
        if bad.any():
            skip = f" (skip = {num_experts})" if skip_class else ""
            raise ValueError(f"rollout {index}: recorded expert id {rows[bad][0]} is outside [0, {top}]{skip} "
                             f"and is not NO_ROUTE = {NO_ROUTE}")
    return rows.astype(np.uint8)


def pack_sft(examples: Sequence[SFTExample], indices: Sequence[int], *, device: torch.device) -> Microbatch:
    """The microbatch of SFT examples `indices`: native routing, advantage 1, no behaviour logprobs; a
    token off its example's `loss_mask` is an input, never a target of the loss."""
    if not indices:
        return dummy_microbatch(device)
    pairs = [(e.prompt_ids, e.token_ids) for e in examples]
    (ids, tgts, mask, seq), bounds, layout = _pack_tokens(pairs, indices, "SFT example {i} has no target tokens and cannot be packed")
    chosen = [examples[i] for i in indices]
    if any(e.loss_mask is not None for e in chosen):
        mask &= _response_values(layout, [np.ones(len(e.token_ids), bool) if e.loss_mask is None else e.loss_mask
                                          for e in chosen])
    total = bounds[-1]
    mask_t = copy_to_device(torch.from_numpy(mask), device)
    return Microbatch(
        input_ids=copy_to_device(torch.from_numpy(ids), device), targets=copy_to_device(torch.from_numpy(tgts), device),
        cu_seqlens=tuple(bounds), loss_mask=mask_t, seq_idx=copy_to_device(torch.from_numpy(seq), device),
        behaviour_logprobs=torch.zeros(total, device=device), advantages=mask_t.float(),
        versions=torch.full((total,), -1, dtype=torch.int64, device=device), routing=None,
        num_sequences=len(indices))


def dummy_microbatch(device: torch.device, num_layers: int | None = None) -> Microbatch:
    """One token, no target and no loss: a rank with nothing to compute still runs the collectives.
    `num_layers`: the routing record's width (L * k) when the step replays routing, else None."""
    one = torch.ones(1, dtype=torch.int64, device=device)
    return Microbatch(
        input_ids=torch.zeros(1, dtype=torch.int64, device=device), targets=-one,
        cu_seqlens=(0, 1),
        loss_mask=torch.zeros(1, dtype=torch.bool, device=device), seq_idx=-one,
        behaviour_logprobs=torch.zeros(1, device=device), advantages=torch.zeros(1, device=device),
        versions=-one,
        routing=(None if num_layers is None else
                 torch.full((1, num_layers), NO_ROUTE, dtype=torch.uint8, device=device)),
        num_sequences=0)
