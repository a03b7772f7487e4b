"""The correction bias of GLM-4.5's routers during RL: DeepSeek-V3's auxiliary-loss-free update.

Each sparse layer's router chooses its experts on sigmoid score + `e_score_correction_bias` (model.py).
Pre-training moved the bias so that experts are evenly loaded; during RL it is frozen by default (router
replay pins the engine's choices anyway, and the engine must choose with the same bias the trainer
has). With `algorithm.router_bias_update` the trainer runs DeepSeek-V3's rule after each step
(DeepSeek-V3 technical report §2.1.2):
    b_e += u * sign(mean load - load_e)        per sparse layer, per expert
on the expert counts of the whole global batch, u the update speed (the report's 0.001). The biases
are fp32 buffers (never the gradient's business) and reach the rollout engine with the weights.

`SignBiasUpdate` is the family's `BiasController`: an SGD optimizer at lr = u over the biases, whose
"gradient" is sign(load_e - mean load), so the trainer checkpoints it like MoE++'s balancer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def load_sign(expert_counts: torch.Tensor) -> torch.Tensor:
    """[L, E] counts -> [L, E] fp32 sign(load_e - mean load) per layer (0 for a layer that routed nothing)."""
    counts = expert_counts.to(torch.float64)
    return torch.sign(counts - counts.mean(dim=1, keepdim=True)).float()


class SignBiasUpdate:
    """DeepSeek-V3's correction-bias update on the sparse layers' routers (module docstring).

    Build it after the model has its final device (it holds the bias tensors); call `step(counts)` with
    the [L, E] expert counts of the global batch (all-reduced first when data-parallel, so every rank
    applies the same update; dense layers' rows are not read).
    """

    def __init__(self, biases: Sequence[torch.Tensor], moe_layers: Sequence[int], *, update_speed: float) -> None:
        self.biases = list(biases)
        self.moe_layers = list(moe_layers)
        if len(self.biases) != len(self.moe_layers):
            raise ValueError(f"{len(self.biases)} biases for {len(self.moe_layers)} sparse layers")
        for b in self.biases:
            if b.dtype != torch.float32:
                raise ValueError(f"correction biases must be fp32, got {b.dtype}")
        self.optimizer = torch.optim.SGD(self.biases, lr=update_speed, momentum=0.0, weight_decay=0.0)

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, update_speed: float) -> SignBiasUpdate:
        sparse = [layer for layer in model.layers if layer.is_moe]
        return cls([layer.mlp.gate.e_score_correction_bias for layer in sparse],
                   [layer.layer_idx for layer in sparse], update_speed=update_speed)

    @torch.no_grad()
    def step(self, expert_counts: torch.Tensor) -> torch.Tensor:
        """One update; returns the [Lm, E] sign it applied (b -= u * sign)."""
        sign = load_sign(expert_counts[self.moe_layers])
        for bias, s in zip(self.biases, sign.to(self.biases[0].device)):
            bias.grad = s.clone()
        self.optimizer.step()
        for bias in self.biases:
            bias.grad = None
        return sign
