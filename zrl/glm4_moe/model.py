"""The GLM-4.5 causal language model for the trainer (single device; parallelism applied from outside).

A lean port of transformers' `Glm4MoeForCausalLM` (models/glm4_moe/modeling_glm4_moe.py):
  x = embed(ids)                                                     fp32 residual stream
  per layer:  x = x + o_proj(attn(RoPE_p(N_q(W_q h + b_q)), RoPE_p(N_k(W_k h + b_k)), W_v h + b_v)),
                  h = RMSNorm_in(x); N_q/N_k per-head RMSNorms when `use_qk_norm`, else identity;
                  biases when `attention_bias`; RoPE_p rotates the first `rotary_dim` channels of a head
              x = x + MLP(RMSNorm_post(x))   MLP = a dense SwiGLU MLP on the first `first_k_dense_replace`
                                             layers, the sparse MoE block on the others
  logits = RMSNorm_final(x) @ W_head^T                               fp32 LM head
Sparse MoE block (DeepSeek-V3 routing): s = sigmoid(W_gate x) (fp32). The experts are chosen on
s + e_score_correction_bias (the bias steers the choice only): each of `n_group` groups scores the sum of
its two best, the best `topk_group` groups stay, and the top-k experts among them are chosen (under
router replay: the recorded ones). Weights = s at those experts (never the bias), divided by their sum
when `norm_topk_prob`, times `routed_scaling_factor`; output = sum over the k of weight * SwiGLU_e(x)
plus the shared experts' SwiGLU MLP of x. Under replay the weights are the model's own scores at the
replayed experts, so the router still gets gradients.

Inputs, outputs and the trainer-facing surface are zrl.modeling's (`PackedCausalLM` around this model's
`hidden_states`); outputs equal running every document alone. Routing records: zrl.modeling.routing
(`TopKLayout`, no skip class; dense layers' columns NO_ROUTE). Precision: zrl.modeling's FP32 op set
(residual stream, every RMSNorm, q/k and their RoPE, router logits, scores and weights, LM head and
log-probs in fp32; projections, attention and experts in the weights' dtype). The correction bias is
an fp32 buffer that `.to(bfloat16)` does not round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from zrl.glm4_moe.config import Glm4MoEConfig
from zrl.modeling.attention import causal_attention
from zrl.modeling.blocks import PreNormDecoderLayer, RMSNorm, linear, linears
from zrl.modeling.causal_lm import PackedCausalLM
from zrl.modeling.experts import SwiGLUExperts
from zrl.modeling.packing import PackedLayout, build_layout
from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.modeling.rope import apply_partial_rope, rope_cos_sin
from zrl.modeling.routing import RoutingInfo, TopKLayout, collect_topk_routing, validate_topk_replay
from zrl.types import NO_ROUTE

Rope = tuple[torch.Tensor, torch.Tensor]


class TopKRouting(NamedTuple):
    """One sparse layer's routing (a NamedTuple so checkpoint/FSDP2 pytree walks see its tensors)."""

    weights: torch.Tensor  # [T, k] fp32, the experts' mixing weights (scaled)
    chosen: torch.Tensor  # [T, k] int64 in [0, E), the experts used (replayed where recorded)
    native: torch.Tensor  # [T, k] int64, the router's own grouped top-k


def topk_layout(config: Glm4MoEConfig) -> TopKLayout:
    return TopKLayout(num_layers=config.num_hidden_layers, moe_layers=config.moe_layers,
                      num_experts=config.n_routed_experts, experts_per_token=config.num_experts_per_tok)


class Attention(nn.Module):
    """GQA attention, optional per-head q/k RMSNorm, partial RoPE, q/k/v biases (o_proj has none)."""

    def __init__(self, config: Glm4MoEConfig) -> None:
        super().__init__()
        hq, hk, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_q_heads, self.num_kv_heads, self.head_dim = hq, hk, d
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, hk * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, hk * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.use_qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.use_qk_norm else None

    def forward(self, x: torch.Tensor, layout: PackedLayout, rope: Rope) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D] in the compute dtype."""
        t = x.shape[0]
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj))  # one GEMM
        q = q.view(t, self.num_q_heads, self.head_dim)  # [T, Hq, d]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hk, d]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # fp32
        q = apply_partial_rope(to_op_dtype(q, Fp32Op.QK_NORM), *rope)  # fp32
        k = apply_partial_rope(to_op_dtype(k, Fp32Op.QK_NORM), *rope)
        dtype = self.o_proj.weight.dtype
        out = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), layout)  # [T, Hq, d]
        return linear(out.reshape(t, -1), self.o_proj)


class SwiGLUMLP(nn.Module):
    """SwiGLU MLP: the dense layers' `mlp` and the sparse layers' `shared_experts` (keys gate/up/down_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.gate_proj.weight.dtype)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Linear):
    """Sigmoid scores over E experts (`weight` [E, D]) and the grouped top-k on them plus the fp32
    `e_score_correction_bias` [E] buffer (checkpoint keys `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`).
    A Linear without bias, so the router's matrix is Muon's like every router's (zrl.modeling.params)."""

    def __init__(self, config: Glm4MoEConfig) -> None:
        super().__init__(config.hidden_size, config.n_routed_experts, bias=False)
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> TopKRouting:
        """x [T, D] (normed), replay [T, k] int64 (rows all NO_ROUTE = no record) or None."""
        logits = to_op_dtype(x, Fp32Op.ROUTER_SOFTMAX) @ to_op_dtype(self.weight, Fp32Op.ROUTER_SOFTMAX).t()
        scores = logits.float().sigmoid()  # [T, E] fp32
        native = self.grouped_topk(scores.detach() + self.e_score_correction_bias.float())  # [T, k]
        chosen = native
        if replay is not None:
            chosen = torch.where((replay != NO_ROUTE).all(dim=-1, keepdim=True), replay, native)
        weights = scores.gather(1, chosen)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' guard
        return TopKRouting(weights=weights * self.routed_scaling_factor, chosen=chosen, native=native)

    def grouped_topk(self, choice: torch.Tensor) -> torch.Tensor:
        """[T, E] selection scores -> [T, k] ids: the top-k among the `topk_group` groups whose two best
        scores sum highest (transformers' and vLLM's rule; one group = plain top-k)."""
        t, e = choice.shape
        grouped = choice.view(t, self.n_group, e // self.n_group)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        kept = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        masked = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, e)
        return masked.topk(self.top_k, dim=-1, sorted=False).indices

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)
        if "e_score_correction_bias" in self._buffers:  # nn.Linear's constructor calls this before it exists
            self.e_score_correction_bias.zero_()

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # `.to(bfloat16)` must not round the correction bias: its updates (1e-3) are below bf16's
        # resolution at the values it reaches. Keep the fp32 values, follow only the device change.
        exact = self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self.e_score_correction_bias.dtype != torch.float32 and exact.dtype == torch.float32:
            self.e_score_correction_bias = exact.to(device=self.e_score_correction_bias.device)
        return self


class MoEBlock(nn.Module):
    """Router (`gate`), E SwiGLU experts (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]:
    transformers' in-memory layout; the HF names map the per-expert files) and the shared experts."""

    def __init__(self, config: Glm4MoEConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = Router(config)
        self.experts = SwiGLUExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (SwiGLUMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, TopKRouting]:
        """x [T, D] (normed) -> MoE output [T, D] fp32 and the routing used."""
        routing = self.gate(x, replay)
        t, k = routing.chosen.shape
        # each token once per chosen expert ([T k] rows), through the top-1 experts op, summed in fp32
        rows = x.to(self.experts.gate_up_proj.dtype).repeat_interleave(k, dim=0)  # [T k, D]
        y = self.experts(rows, routing.chosen.reshape(-1), routing.weights.reshape(-1))  # [T k, D] fp32
        out = y.view(t, k, -1).sum(dim=1)
        if self.shared_experts is not None:
            out = out + to_op_dtype(self.shared_experts(x), Fp32Op.RESIDUAL)
        return out, routing


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Glm4MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(config) if self.is_moe else SwiGLUMLP(config.hidden_size, config.intermediate_size)


class Glm4MoEForCausalLM(PackedCausalLM):
    def __init__(self, config: Glm4MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self._checkpointed: frozenset[int] = frozenset()
        self._checkpoint_context_fn: Callable = noop_context_fn
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """transformers' initial values: N(0, std) matrices, embeddings, experts and routers, zero biases
        (the correction bias included), unit norms."""
        for module in self.modules():
            if isinstance(module, (SwiGLUExperts, Router)):
                module.reset_parameters(std)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        if self.embed_tokens.padding_idx is not None:
            self.embed_tokens.weight[self.embed_tokens.padding_idx].zero_()

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
        routing_replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingInfo]:
        """Final-normed hidden states [T, D] fp32 (T = all tokens, [B, S] inputs flattened) + routing.

        input_ids [T] or [B, S]; cu_seqlens [N + 1] document boundaries; position_ids like input_ids;
        routing_replay [T, L * k] (or [B, S, L * k]) recorded expert ids (zrl.modeling.routing).
        """
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be [T] or [B, S], got shape {tuple(input_ids.shape)}")
        ids = input_ids.reshape(-1)  # [T]
        num_tokens = ids.shape[0]
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        layout = build_layout(num_tokens, device=ids.device, cu_seqlens=cu_seqlens, position_ids=position_ids,
                              row_length=input_ids.shape[1] if input_ids.dim() == 2 else None)
        routing_layout = topk_layout(self.config)
        replay = None if routing_replay is None else validate_topk_replay(routing_replay, num_tokens, routing_layout)
        rope = rope_cos_sin(layout.positions, self.config.rotary_dim, self.config.rope_theta)  # [T, r / 2] each
        x = to_op_dtype(self.embed_tokens(ids), Fp32Op.RESIDUAL)  # [T, D]
        native, chosen = [], []
        for layer_idx, layer in enumerate(self.layers):
            layer_replay = replay[:, layer_idx] if replay is not None and layer.is_moe else None  # [T, k]
            if layer_idx in self._checkpointed and torch.is_grad_enabled():
                x, routing = _checkpointed_layer(layer, x, layout, rope, layer_replay, self._checkpoint_context_fn)
            else:
                x, routing = layer(x, layout, rope, layer_replay)
            if routing is not None:
                native.append(routing.native)
                chosen.append(routing.chosen)
        return self.norm(x), collect_topk_routing(native, chosen, replay, routing_layout)


def _checkpointed_layer(layer: DecoderLayer, x: torch.Tensor, layout: PackedLayout, rope: Rope,
                        replay: torch.Tensor | None, context_fn: Callable) -> tuple[torch.Tensor, TopKRouting | None]:
    """`layer` under non-reentrant checkpointing, its experts pinned for the recomputation in backward
    (the ids of the forward pass are replayed, so a rounding step in the router cannot reroute)."""
    pinned: dict[str, torch.Tensor] = {}
    if layer.is_moe and replay is None and context_fn is not noop_context_fn:
        # All-NO_ROUTE routes natively but takes the replay branch in both passes, so both dispatch the
        # same ops in the same order, which selective checkpointing (context_fn) requires.
        replay = torch.full((x.shape[0], layer.mlp.top_k), NO_ROUTE, dtype=torch.int64, device=x.device)

    def run(x_in: torch.Tensor) -> tuple[torch.Tensor, TopKRouting | None]:
        out, routing = layer(x_in, layout, rope, pinned.get("chosen", replay))
        if routing is not None:
            pinned.setdefault("chosen", routing.chosen.detach())
        return out, routing

    return checkpoint(run, x, use_reentrant=False, context_fn=context_fn)
