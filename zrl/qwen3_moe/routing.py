"""Top-k routing records of the Qwen3-MoE model: replay validation and the per-forward RoutingInfo.

A routing record is `[T, L * k]` uint8, layer-major: decoder layer l owns columns l*k .. l*k + k - 1,
the k expert ids (any order) the engine routed the token to. `zrl.types.NO_ROUTE` (255) means "no
record": a (token, layer) entry is either fully recorded (k distinct ids in [0, E)) or fully NO_ROUTE,
which routes natively. Columns of dense layers carry nothing and are ignored on input, NO_ROUTE on output.

The forward returns `zrl.modeling.routing.RoutingInfo` with these shapes: `native_ids`/`chosen_ids` [T, L * k]
uint8 (the same layout as a record, so `chosen_ids` can be replayed), `expert_counts` [L, E] int64
(no skip class; dense layers' rows are 0), and, under replay, per layer: `replay_recorded` = recorded
expert ids, `replay_disagree` = recorded ids not among the router's own top-k, `replay_missing` =
NO_ROUTE (token, layer) entries. For k = 1 these are the MoE++ definitions.

Nothing here reads device values back to the host (asserts are `torch._assert_async`).
"""

from __future__ import annotations

import torch

from zrl.modeling.routing import RoutingInfo
from zrl.qwen3_moe.config import Qwen3MoEConfig
from zrl.types import NO_ROUTE


def validate_replay(replay: torch.Tensor, num_tokens: int, config: Qwen3MoEConfig) -> torch.Tensor:
    """Check a [T, L * k] (or [B, S, L * k]) record and return it as [T, L, k] int64.

    Raises ValueError on a wrong dtype or shape; on the CPU also on an id outside [0, E), a partially
    recorded (token, layer) entry or a repeated expert (asserted on the device on CUDA, no host read).
    """
    if replay.dtype.is_floating_point or replay.dtype == torch.bool:
        raise ValueError(f"routing_replay must hold integer expert ids, got dtype {replay.dtype}")
    num_layers, k = config.num_hidden_layers, config.num_experts_per_tok
    replay = replay.reshape(-1, replay.shape[-1]) if replay.dim() == 3 else replay
    if tuple(replay.shape) != (num_tokens, num_layers * k):
        raise ValueError(f"routing_replay must be [T, L * k] = [{num_tokens}, {num_layers * k}], got "
                         f"{tuple(replay.shape)}")
    replay = replay.to(torch.int64).view(num_tokens, num_layers, k)
    moe = replay[:, list(config.moe_layers)]  # [T, Lm, k] (dense layers' columns are not read)
    recorded = moe != NO_ROUTE
    ordered = moe.sort(dim=-1).values
    checks = (
        (((moe < 0) | (moe >= config.num_experts)) & recorded,
         f"routing_replay ids must be in [0, {config.num_experts}) or NO_ROUTE = {NO_ROUTE}"),
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


def collect_routing(native: list[torch.Tensor], chosen: list[torch.Tensor], replay: torch.Tensor | None,
                    config: Qwen3MoEConfig) -> RoutingInfo:
    """native/chosen: one [T, k] int64 per MoE layer (in `config.moe_layers` order); replay [T, L, k] or None."""
    moe_layers = list(config.moe_layers)
    native_t = torch.stack(native, dim=1)  # [T, Lm, k]
    chosen_t = torch.stack(chosen, dim=1)
    num_tokens, k = native_t.shape[0], config.num_experts_per_tok
    shape = (num_tokens, config.num_hidden_layers, k)
    native_full = native_t.new_full(shape, NO_ROUTE)
    chosen_full = chosen_t.new_full(shape, NO_ROUTE)
    native_full[:, moe_layers] = native_t
    chosen_full[:, moe_layers] = chosen_t
    # [L, E] by scatter_add (bincount would read the largest id back to size its output)
    counts = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.int64, device=native_t.device)
    per_layer = chosen_t.permute(1, 0, 2).reshape(len(moe_layers), -1)  # [Lm, T k]
    counts[moe_layers] = counts[moe_layers].scatter_add(1, per_layer, torch.ones_like(per_layer))
    disagree = recorded = missing = None
    if replay is not None:
        zeros = torch.zeros(config.num_hidden_layers, dtype=torch.int64, device=native_t.device)
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
