"""Routing records of a forward pass and routing statistics, for any k, with or without a skip class.

Shapes (docs/shapes.md): T tokens, L decoder layers, k experts per token, E experts, C count classes
(E, plus one when the family has a skip class: id E means "no expert"). A routing record is [T, L * k]
uint8, layer-major (layer l owns columns l*k .. l*k + k - 1); `zrl.types.NO_ROUTE` (255) in a replay
record means "no record, route natively". Each family fills `RoutingInfo` from its routers (its own
collect/validate functions, which know its k and its skip class).

Everything here returns tensors without synchronising with the host, and counts rather than
fractions where a caller may want to all-reduce across ranks before dividing.
"""

from __future__ import annotations

import dataclasses
import math

import torch

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
