"""The ZAYA1 MoE++ model for vLLM (out-of-tree), numerically the model of zrl.moepp.

The math is zrl.moepp's (same FP32 op set, the same router, RMSNorm, residual scaling, QK-norm and
partial RoPE modules, reused from there); vLLM supplies the paged attention, the fused MoE experts,
the merged q/k/v projection and the scheduling. Per layer:
  h = CCA(RMSNorm_in(x))          q/k/v_cur/v_del in one GEMM; stateful convs + value shift (cca_state.py)
  x = ResScale_attn(h, x)         fp32 residual stream
  h = MoE(RMSNorm_post(x), r_prev)  zrl.moepp router (E + 1 classes, skip = E) + vLLM FusedMoE experts
  x = ResScale_mlp(h, x)
Logits: RMSNorm_final(x) @ E^T at fp32 accuracy (LM_HEAD). With 16-bit weights on CUDA: bf16 GEMMs
on exact bf16 parts of the fp32 hidden states (the trainer's LM head, zrl.modeling.kernels.lm_logprobs
library.py), no fp32 copy of the 262k x 2048 embedding; elsewhere an fp32 copy of it is kept and
refreshed by `refresh_derived_weights` after every (re)load.

Router capture: every forward stores the chosen expert of every MoE layer for every token of the
step in `last_routing` ([T, L] uint8, skip = E); the worker extension (worker_ext.py) maps the rows
to requests. Expert gating: FusedMoE receives a one-hot "logit" per token (weight 1 for the chosen
real expert, all zero for the skip class) and the fp32 gate probability multiplies its output here,
as zrl.moepp does (expert output in the compute dtype, times the fp32 gate, into the fp32 stream).

Limits (checked at start-up): tensor/pipeline parallel size 1, eager execution, no speculative decoding;
prefix caching only in vLLM's "align" state-cache mode with hits on whole KV blocks (cca_state.py).
Checkpoint keys are the Hugging Face `zaya` ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from serving.cca_state import CCAStateCache
from zrl.modeling.blocks import RMSNorm
from zrl.modeling.rope import apply_partial_rope, rope_cos_sin
from zrl.moepp.blocks import ResidualScaling
from zrl.moepp.cca import QKNorm
from zrl.moepp.config import MoEPPConfig
from zrl.modeling.kernels.lm_logprobs.library import SplitProducts
from zrl.modeling.precision import Fp32Op, fp32_without_tf32, to_op_dtype
from zrl.moepp.router import ZayaRouter

# HF names of the four projections fused into one GEMM, in output order.
_CCA_SHARDS = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")


def moepp_config(vllm_config: VllmConfig) -> MoEPPConfig:
    return MoEPPConfig.from_hf_dict(vllm_config.model_config.hf_config.to_dict(), strict=False)


def cca_state_sizes(config: MoEPPConfig) -> tuple[int, int, int]:
    """(history P, conv channels C, delayed value width Vd) of one CCA layer."""
    history = config.cca_time0 - 1 + config.cca_time1 - 1
    channels = (config.num_attention_heads + config.num_key_value_heads) * config.head_dim
    return history, channels, config.num_key_value_heads * config.head_dim // 2


def _precomputed_routing(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FusedMoE routing hook: `gating_output` [T, E] is one-hot on the chosen expert (zero row = skip).

    Returns weight 1 and the expert for a routed token, weight 0 (expert 0, contributes nothing) for
    a skipped one; the real gate probability is applied by the caller in fp32.
    """
    weights, ids = gating_output.max(dim=-1, keepdim=True)  # [T, 1] each
    return weights.float(), ids.to(torch.int32)


class ZayaCCAProjection(nn.Module):
    """q/k/v of CCA with per-request state. Parameter names follow `self_attn.qkv_proj.*` of the checkpoint."""

    def __init__(self, config: MoEPPConfig, prefix: str) -> None:
        super().__init__()
        d, hq, hk = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_q_heads, self.num_kv_heads = d, hq, hk
        self.sizes = [hq * d, hk * d, hk * d // 2, hk * d // 2]
        self.proj = MergedColumnParallelLinear(config.hidden_size, self.sizes, bias=config.attention_bias,
                                               prefix=f"{prefix}.proj")
        history, channels, value_dim = cca_state_sizes(config)
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, config.cca_time0, groups=channels)
        self.conv_qk_grouped = nn.Conv1d(channels, channels, config.cca_time1, groups=hq + hk)
        self.state = CCAStateCache(channels, history, value_dim, prefix=f"{prefix}.state")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, Hq, d] fp32, k [T, Hk, d] fp32, v [T, Hk, d] compute dtype."""
        n, d, hq, hk = x.shape[0], self.head_dim, self.num_q_heads, self.num_kv_heads
        projected, _ = self.proj(x.to(self.proj.params_dtype))
        q, k, v_current, v_delayed_all = projected.split(self.sizes, dim=-1)
        q = to_op_dtype(q, Fp32Op.QK_MEAN)  # [T, Hq d]
        k = to_op_dtype(k, Fp32Op.QK_MEAN)  # [T, Hk d]
        groups = hq // hk
        q_res = (q.view(n, hq, d) + k.view(n, hk, d).repeat_interleave(groups, dim=1)) * 0.5  # [T, Hq, d]
        k_res = q_res.view(n, hk, groups, d).mean(dim=2)  # [T, Hk, d]

        start_value = self._delayed_bias(v_delayed_all)
        conv, v_delayed = self.state(to_op_dtype(torch.cat([q, k], dim=-1), Fp32Op.CCA_STATE), v_delayed_all,
                                     self.conv_qk_depthwise, self.conv_qk_grouped, start_value)
        q_out = conv[:, : hq * d].view(n, hq, d) + q_res
        k_out = conv[:, hq * d:].view(n, hk, d) + k_res
        v = torch.cat([v_current, v_delayed.to(v_current.dtype)], dim=-1).view(n, hk, d)
        return q_out, k_out, v

    def _delayed_bias(self, like: torch.Tensor) -> torch.Tensor:
        """The delayed value at a request's first token: v_proj_delayed(0) = its bias (or zero). [Vd]"""
        bias = self.proj.bias
        if bias is None:
            return like.new_zeros(self.sizes[3])
        return bias[-self.sizes[3]:].to(like.dtype)


class ZayaAttention(nn.Module):
    def __init__(self, config: MoEPPConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = ZayaCCAProjection(config, prefix=f"{prefix}.qkv_proj")
        self.qk_norm = QKNorm(config)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        bias=config.attention_bias, prefix=f"{prefix}.o_proj")
        self.attn = Attention(config.num_attention_heads, d, d ** -0.5, num_kv_heads=config.num_key_value_heads,
                              cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, D] normed (fp32) -> [T, D] compute dtype."""
        q, k, v = self.qkv_proj(x)
        q, k = self.qk_norm(q, k)
        cos, sin = rope
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        dtype = v.dtype
        n = x.shape[0]
        out = self.attn(q.to(dtype).reshape(n, -1), k.to(dtype).reshape(n, -1), v.reshape(n, -1))
        return self.o_proj(out)[0]


class ZayaMoE(nn.Module):
    """zrl.moepp router (`mlp.gate.*`) + vLLM fused experts (`mlp.experts.*`)."""

    def __init__(self, config: MoEPPConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = ZayaRouter(config, layer_idx)
        self.experts = FusedMoEFactory(
            num_experts=config.num_experts, top_k=1, hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size, renormalize=False,
            custom_routing_function=_precomputed_routing, router_logits_dtype=torch.float32,
            prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor, prev_state: torch.Tensor | None, compute_dtype: torch.dtype):
        """x [T, D] normed fp32 -> MoE output [T, D] fp32 and the RouterOutput."""
        routing = self.gate(x, prev_state)
        one_hot = F.one_hot(routing.chosen, self.num_experts + 1)[:, : self.num_experts].float()  # [T, E]
        out = self.experts(x.to(compute_dtype), one_hot)  # [T, D]
        return to_op_dtype(out, Fp32Op.RESIDUAL) * routing.gate[:, None], routing


class ZayaDecoderLayer(nn.Module):
    def __init__(self, config: MoEPPConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ZayaAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.post_attention_residual_scale = ResidualScaling(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ZayaMoE(config, layer_idx, prefix=f"{prefix}.mlp")
        self.post_mlp_residual_scale = ResidualScaling(config.hidden_size)

    def forward(self, x, router_state, rope, compute_dtype):
        h = self.self_attn(self.input_layernorm(x), rope)
        x = self.post_attention_residual_scale(h, x)
        h, routing = self.mlp(self.post_attention_layernorm(x), router_state, compute_dtype)
        return self.post_mlp_residual_scale(h, x), routing


class ZayaModel(nn.Module):
    def __init__(self, config: MoEPPConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.input_hidden_states_scale = nn.Parameter(torch.ones(config.hidden_size))
        self.input_hidden_states_bias = nn.Parameter(torch.zeros(config.hidden_size))
        self.layers = nn.ModuleList(ZayaDecoderLayer(config, i, vllm_config, prefix=f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ZayaForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM entry class for `architectures: ["ZayaForCausalLM"]` checkpoints."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        _check_supported(vllm_config)
        fp32_without_tf32()  # the FP32 op set in fp32 here as in the trainer (zrl/modeling/precision.py)
        config = moepp_config(vllm_config)
        self.config = config
        self.compute_dtype = vllm_config.model_config.dtype
        self.model = ZayaModel(config, vllm_config, prefix=_join(prefix, "model"))
        self.lm_head_weight = (None if config.tie_word_embeddings
                               else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size)))
        self._lm_head_fp32: torch.Tensor | None = None
        # [T, L] uint8 chosen experts of the last forward (skip = E); read by the worker extension.
        self.last_routing: torch.Tensor | None = None

    # ---------------------------------------------------------------- vLLM hybrid-model interface

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        history, channels, value_dim = cca_state_sizes(moepp_config(vllm_config))
        return (history, channels), (value_dim,)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return torch.float32, torch.float32

    @classmethod
    def get_mamba_state_copy_func(cls):
        # Whole-slot copies: with prefix caching ("align" mode) vLLM copies the slot saved at the block a
        # request resumes from into the slot it runs in; a slot is the state after a token count, so whole.
        return get_temporal_copy_spec, get_temporal_copy_spec

    # ---------------------------------------------------------------- forward

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """-> final-normed hidden states [T, D] fp32."""
        model = self.model
        emb = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        x = ((to_op_dtype(emb, Fp32Op.RESIDUAL) + to_op_dtype(model.input_hidden_states_bias, Fp32Op.RESIDUAL))
             * to_op_dtype(model.input_hidden_states_scale, Fp32Op.RESIDUAL))  # [T, D]
        rope = rope_cos_sin(positions, self.config.rotary_dim, self.config.rope_theta)
        router_state = None
        chosen = []
        for layer in model.layers:
            x, routing = layer(x, router_state, rope, self.compute_dtype)
            router_state = routing.state
            chosen.append(routing.chosen)
        self.last_routing = torch.stack(chosen, dim=1).to(torch.uint8)  # [T, L]
        return model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, D] -> fp32 logits [T, V] (LM_HEAD at fp32 accuracy)."""
        hidden, weight = to_op_dtype(hidden_states, Fp32Op.LM_HEAD), self._lm_head_weight()
        if weight.dtype != torch.float32 and weight.is_cuda:
            return SplitProducts(hidden, weight).logits(slice(None))
        return F.linear(hidden, self._lm_head_weight_fp32())

    def _lm_head_weight(self) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight
        return weight[: self.config.vocab_size]

    def _lm_head_weight_fp32(self) -> torch.Tensor:
        weight = self._lm_head_weight()
        if weight.dtype == torch.float32:
            return weight
        if self._lm_head_fp32 is None:
            self.refresh_derived_weights()
        return self._lm_head_fp32

    @torch.no_grad()
    def refresh_derived_weights(self) -> None:
        """Rebuild tensors derived from the weights (the fp32 LM head copy off CUDA); call after every load."""
        weight = self._lm_head_weight()
        self._lm_head_fp32 = None if weight.dtype == torch.float32 or weight.is_cuda else weight.float()

    # ---------------------------------------------------------------- weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF `zaya` checkpoint tensors; returns the names of the parameters/buffers written."""
        params = dict(self.named_parameters())
        # Buffers (the fp32 balancing biases) load like parameters: vLLM's in-place reload tracks both.
        tensors = {**params, **dict(self.named_buffers())}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight":
                if self.lm_head_weight is None:
                    continue  # tied head: the embedding is the head
                getattr(self.lm_head_weight, "weight_loader", default_weight_loader)(self.lm_head_weight, tensor)
                loaded.add("lm_head_weight")
                continue
            target = _vllm_name(name)
            if ".mlp.experts." in target:
                loaded |= self._load_experts(target, tensor, params)
            elif ".self_attn.qkv_proj." in target and target.rsplit(".", 2)[-2] in _CCA_SHARDS:
                module, shard, kind = target.rsplit(".", 2)
                param_name = f"{module}.proj.{kind}"
                param = params[param_name]
                param.weight_loader(param, tensor, _CCA_SHARDS.index(shard))
                loaded.add(param_name)
            elif target in tensors:
                param = tensors[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(target)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no counterpart in the ZAYA vLLM model")
        self.refresh_derived_weights()
        return loaded

    def _load_experts(self, target: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> set[str]:
        """mlp.experts.gate_up_proj [E, 2F, D] -> w13 (gate = w1, up = w3); down_proj [E, D, F] -> w2."""
        layer_prefix, _, kind = target.rpartition(".")
        experts = [n for n in params if n.startswith(layer_prefix + ".")]
        if kind == "gate_up_proj":
            name = next(n for n in experts if n.endswith("w13_weight"))
            gate, up = tensor.chunk(2, dim=1)
            shards = (("w1", gate), ("w3", up))
        elif kind == "down_proj":
            name = next(n for n in experts if n.endswith("w2_weight"))
            shards = (("w2", tensor),)
        else:
            raise KeyError(f"unknown expert tensor {target!r}")
        param = params[name]
        for shard_id, full in shards:
            for expert_id in range(full.shape[0]):
                param.weight_loader(param, full[expert_id], name, shard_id=shard_id, expert_id=expert_id)
        return {name}


def _vllm_name(hf_name: str) -> str:
    """HF key -> this module's parameter name (identical except the fused CCA projection, see load_weights)."""
    if not hf_name.startswith("model."):
        raise KeyError(f"unexpected checkpoint key {hf_name!r} (zaya keys start with 'model.' or are lm_head.weight)")
    return hf_name


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_supported(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("the ZAYA vLLM model runs with tensor_parallel_size = pipeline_parallel_size = 1 "
                         "(the CCA convolutions and mean skip are not sharded)")
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching and cache.mamba_cache_mode != "align":
        raise ValueError(f"the ZAYA vLLM model caches prefixes only in mamba_cache_mode 'align' (its CCA state "
                         f"is saved at KV block boundaries), got {cache.mamba_cache_mode!r}")
    if cache.enable_mamba_shared_prefix_checkpoint:
        raise ValueError("the ZAYA vLLM model needs enable_mamba_shared_prefix_checkpoint=False: its CCA state "
                         "is saved only at KV block boundaries")
    # Not graph-safe yet: the CCA state layer reads the step's request layout as host values and gathers a
    # variable number of state rows. The way there is running it as a splitting op between piecewise graphs
    # with static state-index buffers (docs/design.md, "Rollout engine settings").
    if not vllm_config.model_config.enforce_eager:
        raise ValueError("the ZAYA vLLM model needs enforce_eager=True: its CCA state layer reads "
                         "per-step metadata that CUDA graphs / torch.compile would freeze")
