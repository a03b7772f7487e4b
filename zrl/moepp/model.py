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

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from zrl.moepp.attention import CCAttention, QKNorm, rope_cos_sin
from zrl.moepp.blocks import ResidualScaling, RMSNorm
from zrl.moepp.config import MoEPPConfig
from zrl.moepp.experts import MoEBlock, SwiGLUExperts
from zrl.moepp.logprobs import SamplingDistribution, chunked_token_logprobs
from zrl.moepp.packing import PackedLayout, build_layout
from zrl.moepp.precision import Fp32Op, to_op_dtype
from zrl.moepp.router import RouterOutput, ZayaRouter
from zrl.moepp.routing import RoutingInfo, collect_routing, validate_replay
from zrl.types import NO_ROUTE


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
        h = self.self_attn(self.input_layernorm(x), layout, rope)
        # residual scaling + post_attention_layernorm fused (one pass over [T, D]; kernels/residual_norm)
        x, normed = self.post_attention_residual_scale.add_and_norm(h, x, self.post_attention_layernorm)
        h, routing = self.mlp(normed, router_state, replay)
        return self.post_mlp_residual_scale(h, x), routing


@dataclasses.dataclass(frozen=True)
class CausalLMOutput:
    logits: torch.Tensor  # [T, V] or [B, S, V] fp32
    routing: RoutingInfo


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    logprobs: torch.Tensor  # [T] or [B, S] fp32
    entropy: torch.Tensor | None  # same shape as logprobs
    routing: RoutingInfo


class PackedCausalLM(nn.Module):
    """What every model of the trainer shares around its `hidden_states` (the architecture's own part):
    per-layer activation checkpointing, the LM head's weight, full logits for tests, and per-token
    log-probs through the chunked fp32 LM head. A subclass sets `layers`, `embed_tokens`, `lm_head` (None
    when tied) and `_checkpoint_context_fn`/`_checkpointed`, and defines `hidden_states(input_ids, *,
    cu_seqlens, position_ids, routing_replay) -> ([T, D] fp32, RoutingInfo)`."""

    def set_activation_checkpointing(self, layers: bool | Iterable[int], *,
                                     context_fn: Callable | None = None) -> None:
        """Checkpoint (non-reentrant) all layers (True), none (False), or the given layer indices.

        `context_fn`: torch.utils.checkpoint's, e.g. a selective policy (zrl.trainer.activations); None = full.
        """
        self._checkpoint_context_fn = context_fn or noop_context_fn
        if isinstance(layers, bool):
            self._checkpointed = frozenset(range(len(self.layers))) if layers else frozenset()
        else:
            chosen = frozenset(int(i) for i in layers)
            if not chosen <= set(range(len(self.layers))):
                raise ValueError(f"layer indices {sorted(chosen)} outside [0, {len(self.layers)})")
            self._checkpointed = chosen

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D]: the embedding matrix when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ------------------------------------------------------------------ forward passes

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
        routing_replay: torch.Tensor | None = None,
        with_entropy: bool = False,
        chunk_tokens: int | None = None,
        sampling: SamplingDistribution | None = None,
    ) -> CausalLMOutput | TokenLogprobs:
        """Without `targets`: full fp32 logits ([T, V] or [B, S, V]), for tests and small inputs.
        With `targets`: per-token log-probabilities, as `token_logprobs` returns them.

        `model(ids, targets=...)` runs FSDP2's root hooks like any forward call; `token_logprobs` is a
        separate method (register it with `register_fsdp_forward_method` under an FSDP2 root).
        """
        if targets is not None:
            return self.token_logprobs(input_ids, targets, cu_seqlens=cu_seqlens, position_ids=position_ids,
                                       routing_replay=routing_replay, with_entropy=with_entropy,
                                       chunk_tokens=chunk_tokens, sampling=sampling)
        hidden, routing = self.hidden_states(input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids,
                                             routing_replay=routing_replay)
        logits = hidden @ to_op_dtype(self.lm_head_weight, Fp32Op.LM_HEAD).t()  # [T, V]
        return CausalLMOutput(logits=_shaped(logits, (*input_ids.shape, -1)), routing=routing)

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
        routing_replay: torch.Tensor | None = None,
        with_entropy: bool = False,
        chunk_tokens: int | None = None,
        sampling: SamplingDistribution | None = None,
    ) -> TokenLogprobs:
        """log p(targets[t] | tokens <= t of its document), shaped like input_ids, fp32, differentiable.

        targets: same shape as input_ids (usually the next token; < 0 where there is none).
        The [T, V] logits are never materialised (chunked fp32 LM head, see logprobs.py). Entropy of
        each token's distribution when `with_entropy`. `sampling`: the distribution is the rollout
        engine's (temperature, top-k, top-p, min-p; see logprobs.py) instead of the plain softmax.
        """
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}")
        hidden, routing = self.hidden_states(input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids,
                                             routing_replay=routing_replay)
        logprobs, entropy = chunked_token_logprobs(hidden, self.lm_head_weight, targets.reshape(-1),
                                                   chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                                   sampling=sampling)
        return TokenLogprobs(logprobs=_shaped(logprobs, input_ids.shape),
                             entropy=None if entropy is None else _shaped(entropy, input_ids.shape),
                             routing=routing)


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


def _shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` in the input's layout; a copy rather than a view when reshaped (FSDP2 warns on returned views)."""
    return t if t.dim() == len(shape) else t.reshape(shape).clone()


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
