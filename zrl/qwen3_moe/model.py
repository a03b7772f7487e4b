"""The Qwen3-MoE causal language model for the trainer (single device; parallelism applied from outside).

A lean port of transformers' `Qwen3MoeForCausalLM` (models/qwen3_moe/modeling_qwen3_moe.py):
  x = embed(ids)                                                     fp32 residual stream
  per layer:  x = x + o_proj(attn(RoPE(RMSNorm_q(W_q h)), RoPE(RMSNorm_k(W_k h)), W_v h)),  h = RMSNorm_in(x)
              x = x + MLP(RMSNorm_post(x))     MLP = sparse MoE block, or a dense SwiGLU MLP on the
                                               config's dense layers (mlp_only_layers / decoder_sparse_step)
  logits = RMSNorm_final(x) @ W_head^T                               fp32 LM head
Sparse MoE block: p = softmax(W_gate x) (fp32); the k experts are the top-k of p (or, under router
replay, the recorded ones); weights = p at those experts, divided by their sum when `norm_topk_prob`;
output = sum over the k of weight * SwiGLU_e(x). Under replay the weights are the model's own
probabilities at the replayed experts, so the router still gets gradients.

Inputs, outputs and the trainer-facing surface are zrl.modeling's (`PackedCausalLM` around this model's
`hidden_states`): one packed stream
[T] with `cu_seqlens` (or position ids restarting at 0) or [B, S] rows; `hidden_states`, `forward`
(logits, or log-probs with `targets`), `token_logprobs` (the chunked fp32 LM head of zrl.modeling.logprobs,
with the engine's SamplingDistribution), `lm_head_weight`, `layers` (the FSDP2 units),
`set_activation_checkpointing` (routing pinned on recompute). Outputs equal running every document
alone. Routing records and RoutingInfo shapes: routing.py. Precision: zrl.modeling's FP32 op set (residual
stream, every RMSNorm with the RoPE after the q/k norms, router softmax and weights, LM head and
log-probs in fp32; projections, attention and experts in the weights' dtype). Under FSDP2 mixed
precision use `cast_forward_inputs=False` on the layers so the residual stream stays fp32.

Shared pieces come from zrl.modeling: packing (document layout), attention (`causal_attention`: one varlen
FlashAttention launch on CUDA in bf16/fp16, exact per-document SDPA elsewhere), the SwiGLU experts op
(`SwiGLUExperts`, `torch._grouped_mm` on CUDA) and the RMSNorm/LM-head kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from zrl.modeling.attention import causal_attention
from zrl.modeling.blocks import PreNormDecoderLayer, RMSNorm, linear, linears
from zrl.modeling.causal_lm import PackedCausalLM
from zrl.modeling.experts import SwiGLUExperts
from zrl.modeling.packing import PackedLayout, build_layout
from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.modeling.rope import apply_partial_rope, rope_cos_sin
from zrl.modeling.routing import RoutingInfo
from zrl.qwen3_moe.config import Qwen3MoEConfig
from zrl.qwen3_moe.routing import collect_routing, validate_replay
from zrl.types import NO_ROUTE

Rope = tuple[torch.Tensor, torch.Tensor]


class TopKRouting(NamedTuple):
    """One sparse layer's routing (a NamedTuple so checkpoint/FSDP2 pytree walks see its tensors)."""

    weights: torch.Tensor  # [T, k] fp32, the experts' mixing weights
    chosen: torch.Tensor  # [T, k] int64 in [0, E), the experts used (replayed where recorded)
    native: torch.Tensor  # [T, k] int64, the router's own top-k (descending probability)


class Attention(nn.Module):
    """GQA self-attention with per-head RMSNorm on q and k before RoPE (checkpoint keys `self_attn.*`)."""

    def __init__(self, config: Qwen3MoEConfig) -> None:
        super().__init__()
        d, hq, hk = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_q_heads, self.num_kv_heads = d, hq, hk
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, hk * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, hk * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, layout: PackedLayout, rope: Rope) -> torch.Tensor:
        """x [T, D] (normed) -> [T, D] in the compute dtype."""
        t = x.shape[0]
        q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj))  # one GEMM
        q = self.q_norm(q.view(t, self.num_q_heads, self.head_dim))  # [T, Hq, d] fp32
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))  # [T, Hk, d] fp32
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_partial_rope(q, *rope), apply_partial_rope(k, *rope)  # full rotate-half RoPE, fp32
        dtype = self.o_proj.weight.dtype
        out = causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), layout)  # [T, Hq, d]
        return linear(out.reshape(t, -1), self.o_proj)


class DenseMLP(nn.Module):
    """SwiGLU MLP of the dense layers (checkpoint keys `mlp.gate_proj/up_proj/down_proj`)."""

    def __init__(self, config: Qwen3MoEConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.gate_proj.weight.dtype)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Softmax top-k router (`gate`, [E, D]) and E SwiGLU experts (`experts.gate_up_proj` [E, 2F, D],
    `experts.down_proj` [E, D, F]: transformers' in-memory layout; checkpoint.py maps the per-expert files)."""

    def __init__(self, config: Qwen3MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = SwiGLUExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def route(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> TopKRouting:
        """x [T, D] (normed), replay [T, k] int64 (rows all NO_ROUTE = no record) or None."""
        probs = torch.softmax(to_op_dtype(linear(x, self.gate), Fp32Op.ROUTER_SOFTMAX), dim=-1)  # [T, E] fp32
        native = probs.detach().topk(self.top_k, dim=-1).indices  # [T, k]
        chosen = native
        if replay is not None:
            chosen = torch.where((replay != NO_ROUTE).all(dim=-1, keepdim=True), replay, native)
        weights = probs.gather(1, chosen)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return TopKRouting(weights=weights, chosen=chosen, native=native)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, TopKRouting]:
        """x [T, D] (normed) -> MoE output [T, D] fp32 and the routing used."""
        routing = self.route(x, replay)
        t, k = routing.chosen.shape
        # each token once per chosen expert ([T k] rows), through the top-1 experts op, summed in fp32
        rows = x.to(self.experts.gate_up_proj.dtype).repeat_interleave(k, dim=0)  # [T k, D]
        y = self.experts(rows, routing.chosen.reshape(-1), routing.weights.reshape(-1))  # [T k, D] fp32
        return y.view(t, k, -1).sum(dim=1), routing


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Qwen3MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config) if self.is_moe else DenseMLP(config)


class Qwen3MoEForCausalLM(PackedCausalLM):
    def __init__(self, config: Qwen3MoEConfig) -> None:
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
        """transformers' initial values: N(0, std) matrices, embeddings and experts, unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (SwiGLUExperts, RMSNorm)):
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

        input_ids [T] or [B, S]; cu_seqlens [N + 1] document boundaries (ints: no host sync); position_ids
        like input_ids; routing_replay [T, L * k] (or [B, S, L * k]) recorded expert ids (routing.py).
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
        replay = None if routing_replay is None else validate_replay(routing_replay, num_tokens, self.config)
        rope = rope_cos_sin(layout.positions, self.config.head_dim, self.config.rope_theta)  # [T, d / 2] each
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
        return self.norm(x), collect_routing(native, chosen, replay, self.config)


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
