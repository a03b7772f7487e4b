"""The ZAYA1 MoE++ causal language model (single device; parallelism is applied from outside).

  x = (embed(ids) + input_hidden_states_bias) * input_hidden_states_scale        fp32 residual stream
  per layer:  x = ResScale_attn(CCA(RMSNorm_in(x)), x)
              x = ResScale_mlp(MoE(RMSNorm_post(x), r_prev), x)      r_prev: previous router's latent
  logits = RMSNorm_final(x) @ E^T                                    fp32 LM head, tied embedding E

Inputs are one packed stream [T] with document boundaries (`cu_seqlens`, or position ids that
restart at 0) or the ordinary [B, S] form (each row a document). Outputs equal running every document
alone. `layers` is a ModuleList of decoder layers so the trainer can wrap each with FSDP2; the model
holds no distributed code. Under FSDP2 mixed precision use `cast_forward_inputs=False` on the layers:
the residual stream entering each layer must stay fp32.

Activation checkpointing (`set_activation_checkpointing`) recomputes a layer in backward with the
expert choices of its forward pass pinned (the replayed ids, or the native ids it chose), so a
recomputation can never route differently from the pass whose activations it replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from zrl.modeling.blocks import RMSNorm
from zrl.modeling.causal_lm import PackedCausalLM
from zrl.modeling.experts import SwiGLUExperts
from zrl.modeling.packing import PackedLayout, build_layout
from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.modeling.rope import rope_cos_sin
from zrl.modeling.routing import RoutingInfo
from zrl.moepp.blocks import ResidualScaling
from zrl.moepp.cca import CCAttention, QKNorm
from zrl.moepp.config import MoEPPConfig
from zrl.moepp.router import RouterOutput, ZayaRouter
from zrl.moepp.routing import collect_routing, validate_replay
from zrl.types import NO_ROUTE


class MoEBlock(nn.Module):
    """Router (`gate`) + experts; the checkpoint keys are `mlp.gate.*` and `mlp.experts.*`."""

    def __init__(self, config: MoEPPConfig, layer_idx: int) -> None:
        super().__init__()
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = SwiGLUExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, x: torch.Tensor, prev_state: torch.Tensor | None,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, RouterOutput]:
        """x [T, D] (normed) -> MoE output [T, D] fp32 and the routing decision."""
        routing = self.gate(x, prev_state, replay)
        return self.experts(x, routing.chosen, routing.gate), routing


class DecoderLayer(nn.Module):
    """One ZAYA1 layer: CCA attention block then MoE block, each with residual scaling."""

    def __init__(self, config: MoEPPConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CCAttention(config)
        self.post_attention_residual_scale = ResidualScaling(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(config, layer_idx)
        self.post_mlp_residual_scale = ResidualScaling(config.hidden_size)

    def forward(self, x: torch.Tensor, router_state: torch.Tensor | None, layout: PackedLayout,
                rope: tuple[torch.Tensor, torch.Tensor], replay: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, RouterOutput]:
        """x [T, D] fp32 -> x [T, D] fp32 and this layer's routing (its `state` feeds the next router)."""
        # the norm written in the projections' dtype: what they would cast it to (no cast pass, half the bytes)
        h = self.self_attn(self.input_layernorm(x, self.self_attn.input_dtype), layout, rope)
        # residual scaling + post_attention_layernorm fused (one pass over [T, D]; kernels/residual_norm)
        x, normed = self.post_attention_residual_scale.add_and_norm(h, x, self.post_attention_layernorm)
        h, routing = self.mlp(normed, router_state, replay)
        return self.post_mlp_residual_scale(h, x), routing


class MoEPPForCausalLM(PackedCausalLM):
    def __init__(self, config: MoEPPConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.input_hidden_states_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.zeros(config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self._checkpointed: frozenset[int] = frozenset()
        self._checkpoint_context_fn: Callable = noop_context_fn
        self.reset_parameters()

    # ------------------------------------------------------------------ set-up

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """The reference's initial values: N(0, std) matrices and experts, zero linear biases, default
        conv init, unit norms and scales, zero key temperatures, balancing biases 0 (skip class -1)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, SwiGLUExperts):
                module.reset_parameters(std)
            elif isinstance(module, (nn.Conv1d, RMSNorm, ResidualScaling, QKNorm, ZayaRouter)):
                module.reset_parameters()
        if self.embed_tokens.padding_idx is not None:
            self.embed_tokens.weight[self.embed_tokens.padding_idx].zero_()
        nn.init.ones_(self.input_hidden_states_scale)
        nn.init.zeros_(self.input_hidden_states_bias)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
        routing_replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingInfo]:
        """Final-normed hidden states [T, D] fp32 (T = all tokens, [B, S] inputs flattened) + routing.

        input_ids: [T] packed stream or [B, S]. cu_seqlens: [N + 1] document boundaries of the
        flattened stream, as Python ints (no host synchronisation) or a tensor (read to the host once).
        position_ids: same shape as input_ids; boundaries are derived from their restarts when
        cu_seqlens is absent. routing_replay: [T, L] (or [B, S, L]) recorded expert ids, 255 = no
        record; its ids are asserted on the device, without a host read (routing.validate_replay).
        """
        if input_ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be [T] or [B, S], got shape {tuple(input_ids.shape)}")
        ids = input_ids.reshape(-1)  # [T]
        num_tokens = ids.shape[0]
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids shape {tuple(position_ids.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        layout = build_layout(
            num_tokens, device=ids.device,
            cu_seqlens=cu_seqlens, position_ids=position_ids,
            row_length=input_ids.shape[1] if input_ids.dim() == 2 else None)
        replay = (None if routing_replay is None else
                  validate_replay(routing_replay, num_tokens, len(self.layers), self.config.num_experts))
        rope = rope_cos_sin(layout.positions, self.config.rotary_dim, self.config.rope_theta)

        emb = to_op_dtype(self.embed_tokens(ids), Fp32Op.RESIDUAL)  # [T, D]
        x = ((emb + to_op_dtype(self.input_hidden_states_bias, Fp32Op.RESIDUAL))
             * to_op_dtype(self.input_hidden_states_scale, Fp32Op.RESIDUAL))
        router_state = None
        outputs: list[RouterOutput] = []
        for layer_idx, layer in enumerate(self.layers):
            layer_replay = None if replay is None else replay[:, layer_idx]
            if layer_idx in self._checkpointed and torch.is_grad_enabled():
                x, routing = _checkpointed_layer(layer, x, router_state, layout, rope, layer_replay,
                                                 self._checkpoint_context_fn)
            else:
                x, routing = layer(x, router_state, layout, rope, layer_replay)
            router_state = routing.state
            outputs.append(routing)
        return self.norm(x), collect_routing(outputs, replay, self.config.num_router_classes)


def _checkpointed_layer(layer: DecoderLayer, x: torch.Tensor, router_state: torch.Tensor | None,
                        layout: PackedLayout, rope: tuple[torch.Tensor, torch.Tensor],
                        replay: torch.Tensor | None, context_fn: Callable) -> tuple[torch.Tensor, RouterOutput]:
    """Run `layer` under non-reentrant checkpointing with its expert choices pinned for recomputation.

    The first (forward) call stores the ids it used; the recomputation in backward replays exactly
    those, so the recomputed activations belong to the same experts even if the router's scores move
    by a rounding step (different kernels, changed balancing biases).
    """
    pinned: dict[str, torch.Tensor] = {}
    if replay is None and context_fn is not noop_context_fn:
        # An all-NO_ROUTE record routes natively; with it both passes take the replay branch and so
        # dispatch the same ops in the same order, which selective checkpointing (context_fn) requires.
        replay = torch.full((x.shape[0],), NO_ROUTE, dtype=torch.int64, device=x.device)

    def run(x_in: torch.Tensor, state_in: torch.Tensor | None) -> tuple[torch.Tensor, RouterOutput]:
        out, routing = layer(x_in, state_in, layout, rope, pinned.get("chosen", replay))
        pinned.setdefault("chosen", routing.chosen.detach())
        return out, routing

    return checkpoint(run, x, router_state, use_reentrant=False, context_fn=context_fn)
