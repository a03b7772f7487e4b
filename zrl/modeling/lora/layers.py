"""The adapted modules: a Linear and the SwiGLU experts with low-rank adapters beside their frozen weights.

`LoRALinear` takes over an `nn.Linear`'s own `weight` and `bias` (the same Parameter objects, under the
same names, so the base's state-dict names, checkpoint keys and FSDP2 units do not change) and adds
`lora_A` [r, in] and `lora_B` [out, r]:
  y = W x + b + scale * B A dropout(x)        scale = alpha / r
`LoRASwiGLUExperts` does the same for the fused experts (`gate_up_proj` [E, 2F, D], `down_proj`
[E, D, F]) with `gate_up_proj_lora_A` [Ea, r, D], `gate_up_proj_lora_B` [E, 2F, r], `down_proj_lora_A`
[Ea, r, F], `down_proj_lora_B` [E, D, r]: Ea = E (an A per expert) or 1 (one A shared by all experts).
The adapted experts op is experts.py's.

The base part of each forward is the base module's own op on the same operands, and the adapter's
term is added to its output: with B = 0 the outputs are bitwise the base's. The adapters compute in
their own dtype (fp32 masters; under FSDP2 mixed precision the gathered copy is in `param_dtype`), and
their term is cast to the base output's dtype before the sum.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zrl.modeling.experts import SwiGLUExperts
from zrl.modeling.lora.experts import ExpertAdapters, lora_experts

ADAPTER_DTYPE = torch.float32


def lora_delta(x: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, dropout: float,
               training: bool) -> torch.Tensor:
    """scale * B A dropout(x): x [N, in] -> [N, out] in the adapters' dtype."""
    x = F.dropout(x.to(lora_A.dtype), dropout, training) if dropout else x.to(lora_A.dtype)
    return F.linear(F.linear(x, lora_A), lora_B) * scale


def initial_lora_A(shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    """PEFT's default for A: kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)) per matrix
    ([..., r, in]: each expert's matrix alike), drawn on the CPU in fp32 from `generator` (the same values
    on every rank and device)."""
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.rand(shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound


class LoRALinear(nn.Linear):
    """An `nn.Linear` (its weight and bias kept, frozen by the caller) plus `lora_A`, `lora_B`."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, dtype=ADAPTER_DTYPE, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=ADAPTER_DTYPE, device=device))
        self.rank, self.scale, self.dropout = rank, alpha / rank, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)  # nn.Linear's own op
        return out + lora_delta(x, self.lora_A, self.lora_B, self.scale, self.dropout, self.training).to(out.dtype)

    def initial_lora_state(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A as PEFT initialises it, B = 0 (the adapted layer starts as the base); CPU fp32."""
        return {"lora_A": initial_lora_A(self.lora_A.shape, generator),
                "lora_B": torch.zeros(self.lora_B.shape, dtype=torch.float32)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale}, dropout={self.dropout}"


class LoRASwiGLUExperts(SwiGLUExperts):
    """`SwiGLUExperts` (its two tensors kept) plus adapters on both projections of every expert."""

    def __init__(self, base: SwiGLUExperts, *, rank: int, alpha: float, dropout: float, shared_a: bool) -> None:
        nn.Module.__init__(self)  # not SwiGLUExperts': it would allocate new expert tensors
        self.num_experts = base.num_experts
        self.gate_up_proj = base.gate_up_proj
        self.down_proj = base.down_proj
        e, two_f, d = base.gate_up_proj.shape
        f = base.down_proj.shape[2]
        ea = 1 if shared_a else e
        device = base.gate_up_proj.device

        def new(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=ADAPTER_DTYPE, device=device))

        self.gate_up_proj_lora_A = new(ea, rank, d)
        self.gate_up_proj_lora_B = new(e, two_f, rank)
        self.down_proj_lora_A = new(ea, rank, f)
        self.down_proj_lora_B = new(e, d, rank)
        self.rank, self.scale, self.dropout, self.shared_a = rank, alpha / rank, dropout, shared_a

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, D] (compute dtype), expert_ids [T] in [0, E], gate [T] fp32 -> [T, D] fp32."""
        adapters = ExpertAdapters(self.gate_up_proj_lora_A, self.gate_up_proj_lora_B, self.down_proj_lora_A,
                                  self.down_proj_lora_B, self.scale, self.dropout if self.training else 0.0)
        return lora_experts(x, expert_ids, gate, self.gate_up_proj, self.down_proj, adapters)

    def initial_lora_state(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Each A as PEFT initialises a matrix, each B = 0; CPU fp32."""
        return {"gate_up_proj_lora_A": initial_lora_A(self.gate_up_proj_lora_A.shape, generator),
                "down_proj_lora_A": initial_lora_A(self.down_proj_lora_A.shape, generator),
                "gate_up_proj_lora_B": torch.zeros(self.gate_up_proj_lora_B.shape, dtype=torch.float32),
                "down_proj_lora_B": torch.zeros(self.down_proj_lora_B.shape, dtype=torch.float32)}

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, rank={self.rank}, scale={self.scale}, dropout={self.dropout}, "
                f"shared_a={self.shared_a}")
