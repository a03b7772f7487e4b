"""MoE++ routing records (top-1 with a skip class) and the bias-balancing controller.

Shapes (docs/shapes.md): T tokens, L MoE layers, E experts; a record is [T, L] (k = 1), expert ids are
in [0, E] with E the skip class; `zrl.types.NO_ROUTE` (255) in a replay record means "no record, route
natively". The record type and the statistics are zrl.modeling.routing's.

Everything here returns tensors without synchronising with the host, and counts rather than
fractions where a caller may want to all-reduce across ranks before dividing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zrl.modeling.routing import BIAS_BALANCER_LR, RoutingInfo
from zrl.moepp.router import RouterOutput
from zrl.types import NO_ROUTE


def collect_routing(outputs: Sequence[RouterOutput], replay: torch.Tensor | None, num_classes: int) -> RoutingInfo:
    """Stack per-layer router outputs; `replay` is the [T, L] int64 record used (or None)."""
    native = torch.stack([o.native for o in outputs], dim=1)  # [T, L]
    chosen = torch.stack([o.chosen for o in outputs], dim=1)  # [T, L]
    # [L, E + 1] by scatter_add: on CUDA, bincount reads the largest id back to size its output
    counts = torch.zeros(chosen.shape[1], num_classes, dtype=torch.int64, device=chosen.device)
    counts.scatter_add_(1, chosen.t(), torch.ones_like(chosen.t()))
    disagree = recorded = missing = None
    if replay is not None:
        has_record = replay != NO_ROUTE  # [T, L]
        recorded = has_record.sum(dim=0)
        missing = (~has_record).sum(dim=0)
        disagree = (has_record & (native != replay)).sum(dim=0)
    return RoutingInfo(native_ids=native.to(torch.uint8), chosen_ids=chosen.to(torch.uint8),
                       expert_counts=counts, replay_disagree=disagree, replay_recorded=recorded,
                       replay_missing=missing)


def validate_replay(replay: torch.Tensor, num_tokens: int, num_layers: int, num_experts: int) -> torch.Tensor:
    """Check a [T, L] record (any integer dtype) and return it as int64. Ids must be in [0, E] or 255."""
    if replay.dtype.is_floating_point or replay.dtype == torch.bool:
        raise ValueError(f"routing_replay must hold integer expert ids, got dtype {replay.dtype}")
    replay = replay.reshape(-1, replay.shape[-1]) if replay.dim() == 3 else replay
    if tuple(replay.shape) != (num_tokens, num_layers):
        raise ValueError(f"routing_replay must be [T, L] = [{num_tokens}, {num_layers}], got {tuple(replay.shape)}")
    replay = replay.to(torch.int64)
    bad = ((replay < 0) | (replay > num_experts)) & (replay != NO_ROUTE)
    message = (f"routing_replay ids must be in [0, {num_experts}] (skip = {num_experts}) or "
               f"NO_ROUTE = {NO_ROUTE}")
    # Asserted on the device, not read back: a host read here would stall every forward until the GPU
    # drains. On the CPU it raises at once; on CUDA a bad id fails a device-side assertion at the next
    # synchronisation (the trainer checks the ids on the host when it packs them, batch.pack_rollouts).
    try:
        torch._assert_async(~bad.any(), message)
    except RuntimeError as error:
        raise ValueError(f"{message}; found {replay[bad][0].item()}") from error
    return replay


def balancing_error(expert_counts: torch.Tensor) -> torch.Tensor:
    """ZAYA1-8B report eq. 5: grad b_{l,e} = p_{l,e} - 1/E, as an [L, E + 1] fp32 tensor.

    p_{l,e} is expert e's share of the tokens layer l routed to real experts (the empirical routing
    distribution over the E experts, compared with the uniform one). The skip class is not balanced:
    its column is 0, so its bias keeps its value. A layer that routed no token to any expert gets
    -1/E everywhere, which lifts all expert biases equally against the skip class.
    """
    counts = expert_counts.to(torch.float64)
    routed = counts[:, :-1]  # [L, E]
    p = routed / routed.sum(dim=1, keepdim=True).clamp_min(1.0)
    error = torch.zeros_like(counts)
    error[:, :-1] = p - 1.0 / routed.shape[1]
    return error.float()


class BiasBalancer:
    """The PID-like balancing-bias controller: AdamW on the router biases, fed the balancing error.

    Build it after the model has its final device and dtype (it holds the bias tensors). Call
    `step(counts)` with [L, E + 1] expert counts of the global batch (all-reduce them first when
    data-parallel, so every rank applies the same update). Whether to run it during RL is a recipe
    choice (`algorithm.router_bias_update`, default off: the report does not say, and router replay
    pins the choices anyway; docs/algorithms.md §6).
    """

    def __init__(self, biases: Sequence[torch.Tensor], *, lr: float = BIAS_BALANCER_LR,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        self.biases = list(biases)
        for b in self.biases:
            if b.dtype != torch.float32:
                raise ValueError(f"balancing biases must be fp32, got {b.dtype}")
        self.optimizer = torch.optim.AdamW(self.biases, lr=lr, betas=betas, eps=eps, weight_decay=0.0)

    @classmethod
    def for_model(cls, model: torch.nn.Module, **kwargs) -> BiasBalancer:
        return cls([layer.mlp.gate.balancing_biases for layer in model.layers], **kwargs)

    @torch.no_grad()
    def step(self, expert_counts: torch.Tensor) -> torch.Tensor:
        """One controller update; returns the [L, E + 1] error that was applied."""
        if expert_counts.shape[0] != len(self.biases):
            raise ValueError(f"expert_counts has {expert_counts.shape[0]} layers, the model {len(self.biases)}")
        error = balancing_error(expert_counts)
        for bias, err in zip(self.biases, error.to(self.biases[0].device)):
            bias.grad = err.clone()
        self.optimizer.step()
        for bias in self.biases:
            bias.grad = None
        return error
