"""The ZAYA1 router: down-projection, EDA across layers, RMSNorm, 3-layer GELU MLP, E+1 classes.

Per layer (T tokens, D hidden, R router latent, E experts; class E is the "skip" expert):
  r = W_down x + b                        [T, R]  (compute dtype)
  r = r + gamma * r_prev                  EDA from layer 1 on (r_prev: previous layer's post-EDA r)
  logits = out(gelu(fc2(gelu(fc1(RMSNorm(r))))))      [T, E + 1]
  probs = softmax(logits)                 fp32 (ROUTER_SOFTMAX)
  native = argmax(probs.detach() + balancing_biases)  biases steer the choice, never the gate weight
  chosen = recorded id under router replay (unless the record is NO_ROUTE), else native
  gate = probs[chosen]                    unbiased, not renormalised; gradients reach the router here

Everything from RMSNorm to the gate is one op, zrl.moepp.kernels.router.route (a fused Triton kernel
on CUDA, its PyTorch reference elsewhere, see zrl/moepp/kernels); RouterMLP keeps the parameters
(checkpoint keys `router_mlp.*`) and its forward gives the logits alone (reference math). The
down-projection and EDA stay here: a GEMM and an axpy.

`balancing_biases` is an fp32 buffer (checkpoint key `mlp.gate.balancing_biases`) that stays fp32
when the module is cast to bf16; it is updated outside autograd by routing.BiasBalancer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from zrl.modeling.blocks import RMSNorm, linear
from zrl.moepp.config import MoEPPConfig
from zrl.moepp.kernels.router import route, router_logits

__all__ = ["RouterMLP", "RouterOutput", "ZayaRouter", "initial_balancing_biases"]


class RouterOutput(NamedTuple):
    """A NamedTuple so that pytree-walking wrappers (checkpoint, FSDP2 hooks) see its tensors."""

    gate: torch.Tensor  # [T] fp32, probs[chosen]
    chosen: torch.Tensor  # [T] int64 in [0, E], the expert used (E = skip)
    native: torch.Tensor  # [T] int64 in [0, E], the biased argmax of this router
    state: torch.Tensor  # [T, R] post-EDA latent, the next layer's r_prev


class RouterMLP(nn.Module):
    """RMSNorm -> fc1 -> GELU -> fc2 -> GELU -> out_proj (no bias): [T, R] -> logits [T, E + 1]."""

    def __init__(self, router_hidden_size: int, num_classes: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(router_hidden_size, eps)
        self.fc1 = nn.Linear(router_hidden_size, router_hidden_size)
        self.fc2 = nn.Linear(router_hidden_size, router_hidden_size)
        self.out_proj = nn.Linear(router_hidden_size, num_classes, bias=False)

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return router_logits(r, *self._weights(), self.norm.eps)

    def _weights(self) -> tuple[torch.Tensor, ...]:
        """(norm weight, fc1 weight, fc1 bias, fc2 weight, fc2 bias, out weight), `route`'s order."""
        return (self.norm.weight, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                self.out_proj.weight)


class ZayaRouter(nn.Module):
    def __init__(self, config: MoEPPConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.down_proj = nn.Linear(config.hidden_size, config.router_hidden_size)
        # Layer 0 has no previous router state, hence no EDA coefficient (as in the checkpoint format).
        self.router_states_scale = (nn.Parameter(torch.ones(config.router_hidden_size))
                                    if layer_idx > 0 else None)
        self.router_mlp = RouterMLP(config.router_hidden_size, config.num_router_classes, config.rms_norm_eps)
        self.register_buffer("balancing_biases", initial_balancing_biases(config.num_router_classes))

    def forward(self, x: torch.Tensor, prev_state: torch.Tensor | None,
                replay: torch.Tensor | None = None) -> RouterOutput:
        """x [T, D] (normed); prev_state [T, R] or None; replay [T] int64 recorded ids or None."""
        r = linear(x, self.down_proj)  # [T, R]
        if self.router_states_scale is not None:
            if prev_state is None:
                raise ValueError("layers after the first need the previous layer's router state (EDA)")
            r = r + prev_state.to(r.dtype) * self.router_states_scale.to(r.dtype)
        # RMSNorm -> MLP -> softmax -> biased argmax -> replay -> gate, fused (router_mlp's forward is
        # not called: hooks on it do not fire; its parameters are read directly).
        gate, chosen, native = route(r, *self.router_mlp._weights(), self.balancing_biases, replay,
                                     self.router_mlp.norm.eps)  # [T] each
        return RouterOutput(gate=gate, chosen=chosen, native=native, state=r)

    def reset_parameters(self) -> None:
        if self.router_states_scale is not None:
            nn.init.ones_(self.router_states_scale)
        self.balancing_biases.copy_(initial_balancing_biases(self.balancing_biases.numel()))

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # `.to(bfloat16)` / `.half()` must not round the balancing biases: their updates are ~1e-3 on
        # values near 1, below bf16 resolution. Keep the fp32 values, follow only the device change.
        exact = self.balancing_biases
        super()._apply(fn, recurse)
        if self.balancing_biases.dtype != torch.float32 and exact.dtype == torch.float32:
            self.balancing_biases = exact.to(device=self.balancing_biases.device)
        return self


def initial_balancing_biases(num_classes: int) -> torch.Tensor:
    """0 for the real experts, -1 for the skip class (the last)."""
    biases = torch.zeros(num_classes, dtype=torch.float32)
    biases[-1] = -1.0
    return biases
