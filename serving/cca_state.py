"""Per-request CCA state inside vLLM: convolution history and delayed value in the Mamba state cache.

ZAYA1's CCA mixes neighbouring tokens in two places: two stacked causal convolutions over the
pre-convolution q/k channels (kernels k0, k1: history P = (k0 - 1) + (k1 - 1) tokens) and the value
half taken from the previous token. A decode step therefore needs, per request and per layer, a small
state besides the KV cache. It lives in vLLM's Mamba-style state cache (a `MambaSpec` layer, one slot
per running request, the SHORT_CONV metadata builder), so vLLM allocates, assigns and frees it.

Invariant — the slot of a request whose first n tokens have been computed holds
  conv  [P, C]  fp32: the pre-convolution q/k inputs of tokens n-P .. n-1 (zero rows before token 0)
  value [Vd]    fp32: v_proj_delayed(x_{n-1})
and is meaningful only when vLLM reports an initial state (n > 0). A step that computes tokens
n .. n+m-1 of the request reads that state, treats it as the tokens just before its chunk, and writes
back the last P inputs and the last delayed projection. vLLM reports no initial state exactly when a
request's computed count is 0 — a new request, or a preempted one recomputed from scratch — so
continuous batching, chunked prefill and preemption/recompute are exact. 
Prefix caching uses vLLM's "align" state-cache mode, with the layer unchanged: a request's state slots
are then block-indexed, a step that ends on a KV block boundary leaves the state of that boundary in the
block's slot, and before a step vLLM copies the whole slot saved at the block a request resumes from
(a prefix-cache hit, or the next block) into the slot the step writes. The invariant above therefore
holds with n = the cached token count. This is exact only where a state was saved, i.e. for hits on
whole KV blocks: hits inside a block (prefix_match_unit below the block size) and shared-prefix
checkpoints would need a state from the middle of a chunk, and are refused (zaya_vllm._check_supported,
worker_ext). Cached prompt positions are never computed by the requests that reuse them; their routing
rows come from the KV slots they were recorded in (routing_capture.py).

Shapes (docs/shapes.md): T tokens in the step, N requests, C = (Hq + Hk) d conv channels, P history,
Vd = Hk d / 2.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from zrl.modeling.precision import Fp32Op, to_op_dtype


def request_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token: its request index and its index within the request's chunk. Both [T] int64."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
    request = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                      output_size=num_tokens)  # [T]
    local = torch.arange(num_tokens, device=cu_seqlens.device) - cu_seqlens[:-1][request]  # [T]
    return request, local


def stateful_causal_convs(
    qk: torch.Tensor,
    history: torch.Tensor,
    cu_seqlens: torch.Tensor,
    depthwise: nn.Conv1d,
    grouped: nn.Conv1d,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both CCA convolutions for a batch of request chunks that continue from `history`.

    qk [T, C] pre-convolution inputs, requests back to back as given by cu_seqlens [N + 1];
    history [N, P, C], the P inputs before each chunk (zeros for a fresh request). Computes in qk's
    dtype (the caller passes fp32: CCA_STATE). Returns conv output [T, C] and the new history
    [N, P, C] (the last P inputs of each request, reaching into the old history when a chunk is
    shorter than P).
    """
    num_tokens, channels = qk.shape
    num_requests, hist, _ = history.shape
    k0, k1 = depthwise.kernel_size[0], grouped.kernel_size[0]
    if hist != k0 - 1 + k1 - 1:
        raise ValueError(f"history holds {hist} tokens, kernels {k0} and {k1} need {k0 - 1 + k1 - 1}")
    request, local = request_layout(cu_seqlens, num_tokens)
    # Window of P + 1 inputs ending at each token, read from [history rows; chunk rows].
    offsets = torch.arange(-hist, 1, device=qk.device)  # [P + 1]
    source = local[:, None] + offsets[None, :]  # [T, P + 1], < 0 means "from the history"
    index = torch.where(source >= 0,
                        num_requests * hist + cu_seqlens[:-1][request][:, None] + source,
                        request[:, None] * hist + hist + source)
    rows = torch.cat([history.reshape(num_requests * hist, channels), qk], dim=0)  # [N P + T, C]
    windows = rows[index]  # [T, P + 1, C]

    w_dw = depthwise.weight.to(qk.dtype)[:, 0, :]  # [C, k0]
    # Depthwise convolution (cross-correlation) evaluated at the last k1 window positions.
    dw = sum(windows[:, i: i + k1, :] * w_dw[:, i] for i in range(k0))  # [T, k1, C]
    if depthwise.bias is not None:
        dw = dw + depthwise.bias.to(qk.dtype)
    groups = grouped.groups
    per_group = channels // groups
    w_gr = grouped.weight.to(qk.dtype).view(groups, per_group, per_group, k1)  # [groups, out, in, k1]
    out = torch.einsum("tkgi,goik->tgo", dw.view(num_tokens, k1, groups, per_group), w_gr)
    out = out.reshape(num_tokens, channels)
    if grouped.bias is not None:
        out = out + grouped.bias.to(qk.dtype)
    last = cu_seqlens[1:] - 1  # [N] last token of each request
    return out, windows[last, 1:, :]


def stateful_value_shift(
    value: torch.Tensor, previous: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shift the delayed-value projections by one token within each request.

    value [T, Vd]: v_proj_delayed of every token; previous [N, Vd]: the projection of the token before
    each chunk. Returns the shifted values [T, Vd] and the new previous [N, Vd] (each chunk's last).
    """
    num_tokens = value.shape[0]
    num_requests = previous.shape[0]
    request, local = request_layout(cu_seqlens, num_tokens)
    index = torch.where(local == 0, request, num_requests + torch.arange(num_tokens, device=value.device) - 1)
    rows = torch.cat([previous.to(value.dtype), value], dim=0)  # [N + T, Vd]
    return rows[index], value[cu_seqlens[1:] - 1]


class CCAStateCache(MambaBase, nn.Module):
    """The state-cache layer of one CCA block: owns no weights, only the per-request state slots.

    `forward` runs the stateful convolutions and value shift for the step described by vLLM's
    forward context (decode requests first, then prefills, as vLLM's Mamba metadata orders them).
    """

    def __init__(self, conv_channels: int, history: int, value_dim: int, prefix: str) -> None:
        super().__init__()
        self.conv_channels = conv_channels
        self.history = history
        self.value_dim = value_dim
        self.prefix = prefix
        vllm_config = get_current_vllm_config()
        if vllm_config.num_speculative_tokens:
            raise ValueError("the ZAYA CCA state does not support speculative decoding")
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]), torch.tensor([]))

    def get_state_shape(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.history, self.conv_channels), (self.value_dim,)

    def get_state_dtype(self) -> tuple[torch.dtype, torch.dtype]:
        return torch.float32, torch.float32  # CCA_STATE is in the FP32 op set

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # The SHORT_CONV builder gives exactly what this layer reads: state slots, query offsets and
        # initial-state flags per request.
        return MambaAttentionBackendEnum.SHORT_CONV

    def forward(
        self,
        qk: torch.Tensor,
        delayed: torch.Tensor,
        depthwise: nn.Conv1d,
        grouped: nn.Conv1d,
        start_value: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, C] fp32 inputs, delayed [T, Vd] v_proj_delayed(x) -> conv out [T, C] fp32, shifted values [T, Vd].

        start_value [Vd] is the delayed value at a request's first token (v_proj_delayed of zeros).
        """
        qk = to_op_dtype(qk, Fp32Op.CCA_STATE)
        num_tokens = qk.shape[0]
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if metadata is None:
            # Profiling / dummy run: no requests, no state; one zero-history sequence of the right shape.
            cu = torch.tensor([0, num_tokens], device=qk.device)
            history = qk.new_zeros(1, self.history, self.conv_channels)
            out, _ = stateful_causal_convs(qk, history, cu, depthwise, grouped)
            shifted, _ = stateful_value_shift(delayed, start_value.expand(1, -1), cu)
            return out, shifted

        slots, cu, has_state, num_actual = _requests_of_step(metadata, qk.device)
        conv_state, value_state = self.kv_cache  # [slots, P, C], [slots, Vd]
        keep = has_state[:, None]
        history = torch.where(keep[:, :, None], conv_state[slots], 0.0)  # [N, P, C]
        previous = torch.where(keep, value_state[slots], to_op_dtype(start_value, Fp32Op.CCA_STATE))  # [N, Vd]

        out = qk.new_zeros(num_tokens, self.conv_channels)
        shifted = delayed.new_zeros(num_tokens, self.value_dim)
        out[:num_actual], new_history = stateful_causal_convs(qk[:num_actual], history, cu, depthwise, grouped)
        shifted[:num_actual], new_previous = stateful_value_shift(delayed[:num_actual], previous, cu)
        conv_state[slots] = new_history
        value_state[slots] = new_previous.to(value_state.dtype)
        return out, shifted


def _requests_of_step(metadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Unify vLLM's decode/prefill split: state slot [N], cu_seqlens [N + 1], has-state [N], token count.

    Decode requests come first with one token each and always carry state; prefill requests follow.
    """
    num_decodes, num_prefills = metadata.num_decodes, metadata.num_prefills
    slots, starts, has_state = [], [torch.zeros(1, dtype=torch.long, device=device)], []
    if num_decodes:
        slots.append(metadata.state_indices_tensor_d[:num_decodes, 0].long())
        starts.append(torch.arange(1, num_decodes + 1, device=device))
        has_state.append(torch.ones(num_decodes, dtype=torch.bool, device=device))
    if num_prefills:
        slots.append(metadata.state_indices_tensor_p[:num_prefills].long())
        starts.append(metadata.query_start_loc_p[1: num_prefills + 1].long() + metadata.num_decode_tokens)
        has_state.append(metadata.has_initial_states_p[:num_prefills])
    num_actual = metadata.num_decode_tokens + metadata.num_prefill_tokens
    return torch.cat(slots), torch.cat(starts), torch.cat(has_state), num_actual


__all__ = ["CCAStateCache", "request_layout", "stateful_causal_convs", "stateful_value_shift"]
