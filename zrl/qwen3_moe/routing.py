"""Top-k routing records of the Qwen3-MoE model: replay validation and the per-forward RoutingInfo.

A routing record is `[T, L * k]` uint8, layer-major: decoder layer l owns columns l*k .. l*k + k - 1,
the k expert ids (any order) the engine routed the token to. `zrl.types.NO_ROUTE` (255) means "no
record": a (token, layer) entry is either fully recorded (k distinct ids in [0, E)) or fully NO_ROUTE,
which routes natively. Columns of dense layers carry nothing and are ignored on input, NO_ROUTE on output.

The forward returns `zrl.modeling.routing.RoutingInfo` with these shapes: `native_ids`/`chosen_ids` [T, L * k]
uint8 (the same layout as a record, so `chosen_ids` can be replayed), `expert_counts` [L, E] int64
(no skip class; dense layers' rows are 0), and, under replay, per layer: `replay_recorded` = recorded
expert ids, `replay_disagree` = recorded ids not among the router's own top-k, `replay_missing` =
NO_ROUTE (token, layer) entries. For k = 1 these are the MoE++ definitions. The checks and counts are
zrl.modeling.routing's for any top-k family (`TopKLayout`).

Nothing here reads device values back to the host (asserts are `torch._assert_async`).
"""

from __future__ import annotations

import torch

from zrl.modeling.routing import RoutingInfo, TopKLayout, collect_topk_routing, validate_topk_replay
from zrl.qwen3_moe.config import Qwen3MoEConfig


def topk_layout(config: Qwen3MoEConfig) -> TopKLayout:
    return TopKLayout(num_layers=config.num_hidden_layers, moe_layers=config.moe_layers,
                      num_experts=config.num_experts, experts_per_token=config.num_experts_per_tok)


def validate_replay(replay: torch.Tensor, num_tokens: int, config: Qwen3MoEConfig) -> torch.Tensor:
    """Check a [T, L * k] (or [B, S, L * k]) record and return it as [T, L, k] int64.

    Raises ValueError on a wrong dtype or shape; on the CPU also on an id outside [0, E), a partially
    recorded (token, layer) entry or a repeated expert (asserted on the device on CUDA, no host read).
    """
    return validate_topk_replay(replay, num_tokens, topk_layout(config))


def collect_routing(native: list[torch.Tensor], chosen: list[torch.Tensor], replay: torch.Tensor | None,
                    config: Qwen3MoEConfig) -> RoutingInfo:
    """native/chosen: one [T, k] int64 per MoE layer (in `config.moe_layers` order); replay [T, L, k] or None."""
    return collect_topk_routing(native, chosen, replay, topk_layout(config))
