"""What every causal LM of the trainer shares around its architecture's `hidden_states`.

`PackedCausalLM` gives a model per-layer activation checkpointing, its LM head's weight, full logits
(for tests and small inputs) and per-token log-probs through the chunked fp32 LM head
(logprobs.chunked_token_logprobs, under the rollout engine's sampling distribution). Inputs are one
packed stream [T] with document boundaries (`cu_seqlens`, or position ids restarting at 0) or [B, S]
rows; outputs come back in the input's layout. `TokenLogprobs` is what the trainer reads from every
family's model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import noop_context_fn

from zrl.modeling.kernels.lm_logprobs import TokenGrad
from zrl.modeling.logprobs import SamplingDistribution, chunked_head_loss, chunked_token_logprobs
from zrl.modeling.precision import Fp32Op, to_op_dtype
from zrl.modeling.routing import RoutingInfo


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


    def token_loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        token_grad: TokenGrad,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        position_ids: torch.Tensor | None = None,
        routing_replay: torch.Tensor | None = None,
        with_entropy: bool = False,
        chunk_tokens: int | None = None,
        sampling: SamplingDistribution | None = None,
    ) -> tuple[torch.Tensor, TokenLogprobs]:
        """(loss [], detached TokenLogprobs) of a token-separable loss: the LM head fused with it
        (logprobs.chunked_head_loss), so the head's gradients are formed in this forward.

        `token_grad(rows, logprob, entropy)` works on the flattened tokens ([T] or [B * S], rows a slice
        of them); see zrl.modeling.kernels.lm_logprobs.fused. Arguments otherwise as `token_logprobs`.
        """
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape {tuple(input_ids.shape)}")
        hidden, routing = self.hidden_states(input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids,
                                             routing_replay=routing_replay)
        loss, logprobs, entropy = chunked_head_loss(hidden, self.lm_head_weight, targets.reshape(-1), token_grad,
                                                    chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                                    sampling=sampling)
        return loss, TokenLogprobs(logprobs=_shaped(logprobs, input_ids.shape),
                                   entropy=None if entropy is None else _shaped(entropy, input_ids.shape),
                                   routing=routing)


def _shaped(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`t` in the input's layout; a copy rather than a view when reshaped (FSDP2 warns on returned views)."""
    return t if t.dim() == len(shape) else t.reshape(shape).clone()
