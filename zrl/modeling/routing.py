"""Routing records of a forward pass and routing statistics, for any k, with or without a skip class.

Shapes (docs/shapes.md): T tokens, L decoder layers, k experts per token, E experts, C count classes
(E, plus one when the family has a skip class: id E means "no expert"). A routing record is [T, L * k]
uint8, layer-major (layer l owns columns l*k .. l*k + k - 1); `zrl.types.NO_ROUTE` (255) in a replay
record means "no record, route natively". Each family fills `RoutingInfo` from its routers (its own
collect/validate functions, which know its k and its skip class); a top-k family without a skip class
uses `validate_topk_replay` and `collect_topk_routing` with its `TopKLayout`.

Everything here returns tensors without synchronising with the host, and counts rather than
fractions where a caller may want to all-reduce across ranks before dividing.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from zrl.types import NO_ROUTE

BIAS_BALANCER_LR = 1e-3  # AdamW lr of router balancing biases (a controller gain; the ZAYA1 report gives none)


@dataclasses.dataclass(frozen=True)
class RoutingInfo:
    """What the routers did in one forward pass."""

    native_ids: torch.Tensor  # [T, L * k] uint8, each router's own choice
    chosen_ids: torch.Tensor  # [T, L * k] uint8, the experts used (replayed where recorded)
    expert_counts: torch.Tensor  # [L, C] int64 tokens per chosen class (a skip class last)
    replay_disagree: torch.Tensor | None  # [L] int64 recorded ids the router's own choice does not hold
    replay_recorded: torch.Tensor | None  # [L] int64 recorded ids (not NO_ROUTE)
    replay_missing: torch.Tensor | None  # [L] int64 NO_ROUTE (token, layer) entries (routed natively)

    @property
    def replay_mismatch_fraction(self) -> torch.Tensor | None:
        """Fraction of recorded ids where native routing disagrees: [] fp32."""
        if self.replay_disagree is None:
            return None
        return self.replay_disagree.sum().float() / self.replay_recorded.sum().clamp_min(1).float()


@dataclasses.dataclass(frozen=True)
class RoutingStats:
    load: torch.Tensor  # [L, E] fraction of routed (non-skip) token slots per expert
    skip_fraction: torch.Tensor | None  # [L] fraction of all tokens sent to the skip class; None without one
    load_entropy: torch.Tensor  # [L] H(load) / ln E, 1 = perfectly balanced, 0 = one expert


def routing_stats(expert_counts: torch.Tensor, *, skip_class: bool) -> RoutingStats:
    """Per-layer load statistics from [L, C] counts (possibly summed over ranks and steps); with a skip
    class its column is the last one and the load is over the E real experts."""
    counts = expert_counts.to(torch.float64)
    routed = counts[:, :-1] if skip_class else counts  # [L, E]
    num_experts = routed.shape[1]
    load = routed / routed.sum(dim=1, keepdim=True).clamp_min(1.0)
    entropy = -torch.special.xlogy(load, load).sum(dim=1)  # 0 log 0 = 0
    normaliser = math.log(num_experts) if num_experts > 1 else 1.0
    return RoutingStats(
        load=load.float(),
        skip_fraction=(counts[:, -1] / counts.sum(dim=1).clamp_min(1.0)).float() if skip_class else None,
        load_entropy=(entropy / normaliser).float(),
    )


@dataclasses.dataclass(frozen=True)
class TopKLayout:
    """The routing layout of a top-k family without a skip class: a record is [T, L * k], layer-major;
    only the sparse layers `moe_layers` route (dense layers' columns are ignored on input, NO_ROUTE on
    output, their rows of `expert_counts` 0). Replay entries: a (token, layer) is k distinct ids in
    [0, E), in any order, or all NO_ROUTE (no record: route natively)."""

    num_layers: int  # L, dense layers included
    moe_layers: tuple[int, ...]
    num_experts: int  # E
    experts_per_token: int  # k


def validate_topk_replay(replay: torch.Tensor, num_tokens: int, layout: TopKLayout) -> torch.Tensor:
    """Check a [T, L * k] (or [B, S, L * k]) record and return it as [T, L, k] int64.

    Raises ValueError on a wrong dtype or shape; on the CPU also on an id outside [0, E), a partially
    recorded (token, layer) entry or a repeated expert (asserted on the device on CUDA, no host read).
    """
    if replay.dtype.is_floating_point or replay.dtype == torch.bool:
        raise ValueError(f"routing_replay must hold integer expert ids, got dtype {replay.dtype}")
    num_layers, k = layout.num_layers, layout.experts_per_token
    replay = replay.reshape(-1, replay.shape[-1]) if replay.dim() == 3 else replay
    if tuple(replay.shape) != (num_tokens, num_layers * k):
        raise ValueError(f"routing_replay must be [T, L * k] = [{num_tokens}, {num_layers * k}], got "
                         f"{tuple(replay.shape)}")
    replay = replay.to(torch.int64).view(num_tokens, num_layers, k)
    moe = replay[:, list(layout.moe_layers)]  # [T, Lm, k] (dense layers' columns are not read)
    recorded = moe != NO_ROUTE
    ordered = moe.sort(dim=-1).values
    checks = (
        (((moe < 0) | (moe >= layout.num_experts)) & recorded,
         f"routing_replay ids must be in [0, {layout.num_experts}) or NO_ROUTE = {NO_ROUTE}"),
        (recorded.any(dim=-1) & ~recorded.all(dim=-1),
         f"routing_replay entries of a (token, layer) must be all recorded or all NO_ROUTE = {NO_ROUTE}"),
        ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != NO_ROUTE),
         "routing_replay names an expert twice for one (token, layer)"),
    )
    for bad, message in checks:
        try:
            torch._assert_async(~bad.any(), message)
        except RuntimeError as error:
            raise ValueError(message) from error
    return replay


def collect_topk_routing(native: list[torch.Tensor], chosen: list[torch.Tensor], replay: torch.Tensor | None,
                         layout: TopKLayout) -> RoutingInfo:
    """native/chosen: one [T, k] int64 per MoE layer (in `layout.moe_layers` order); replay [T, L, k] or None."""
    moe_layers = list(layout.moe_layers)
    native_t = torch.stack(native, dim=1)  # [T, Lm, k]
    chosen_t = torch.stack(chosen, dim=1)
    num_tokens, k = native_t.shape[0], layout.experts_per_token
    shape = (num_tokens, layout.num_layers, k)
    native_full = native_t.new_full(shape, NO_ROUTE)
    chosen_full = chosen_t.new_full(shape, NO_ROUTE)
    native_full[:, moe_layers] = native_t
    chosen_full[:, moe_layers] = chosen_t
    # [L, E] by scatter_add (bincount would read the largest id back to size its output)
    counts = torch.zeros(layout.num_layers, layout.num_experts, dtype=torch.int64, device=native_t.device)
    per_layer = chosen_t.permute(1, 0, 2).reshape(len(moe_layers), -1)  # [Lm, T k]
    counts[moe_layers] = counts[moe_layers].scatter_add(1, per_layer, torch.ones_like(per_layer))
    disagree = recorded = missing = None
    if replay is not None:
        zeros = torch.zeros(layout.num_layers, dtype=torch.int64, device=native_t.device)
        rec = replay[:, moe_layers] != NO_ROUTE  # [T, Lm, k]
        has_record = rec.all(dim=-1)  # [T, Lm]
        # a recorded id the router's own top-k does not contain
        foreign = rec & ~(replay[:, moe_layers, :, None] == native_t[:, :, None, :]).any(dim=-1)
        recorded, missing, disagree = zeros.clone(), zeros.clone(), zeros.clone()
        recorded[moe_layers] = rec.sum(dim=(0, 2))
        missing[moe_layers] = (~has_record).sum(dim=0)
        disagree[moe_layers] = foreign.sum(dim=(0, 2))
    return RoutingInfo(native_ids=native_full.reshape(num_tokens, -1).to(torch.uint8),
                       chosen_ids=chosen_full.reshape(num_tokens, -1).to(torch.uint8),
                       expert_counts=counts, replay_disagree=disagree, replay_recorded=recorded,
                       replay_missing=missing)
