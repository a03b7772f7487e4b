"""GLM-4.5 model configuration: parsing and validation of Hugging Face `glm4_moe` config.json files.

Responsibility: turn the `config.json` of a `model_type: glm4_moe` checkpoint into a frozen
`Glm4MoEConfig` holding exactly the numbers the model code uses. What this implementation does not run
(non-default RoPE, dropout, activations other than SiLU, quantized weights, more than 255 routed
experts, expert groups that do not split the experts evenly) is rejected with a `ConfigError` naming
the key, so a checkpoint never loads into a silently different model.

Ignored because it cannot change the forward pass: `num_nextn_predict_layers` (transformers 5 also
spells it `num_mtp_layers`), the multi-token-prediction modules stored after the last decoder layer.
They predict further tokens for speculative decoding from the decoder's output and feed nothing back
into it, so the model's logits are the same without them; their weights are skipped on load
(`HFNames.layers_beyond_config_unused`) and an export says it has none (`num_nextn_predict_layers: 0`).

Both spellings transformers writes are read: `partial_rotary_factor` and `rope_theta` at the top level
(transformers 4 files, the Hub's) or inside `rope_parameters` (transformers 5).

Invariants: importing this module imports neither torch nor transformers; `from_hf_dict(to_hf_dict(c)) == c`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar

from zrl.modeling.config import ConfigError, leftover_keys, pop_expert_count, pop_required, pop_supported
from zrl.types import NO_ROUTE

MODEL_TYPE = "glm4_moe"
# Routing records hold expert ids 0..E-1 as uint8 with NO_ROUTE (255) meaning "no record" (no skip class).
MAX_EXPERTS = NO_ROUTE

# Keys without architectural meaning for a training forward pass, kept verbatim.
_IGNORED_KEYS = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "use_cache", "output_router_logits", "initializer_range", "max_position_embeddings",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "tokenizer_class",
    "keys_to_ignore_at_inference", "router_aux_loss_coef", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward",
})
_MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


@dataclasses.dataclass(frozen=True)
class Glm4MoEConfig:
    """The numbers that define a GLM-4.5 model (names follow the HF `glm4_moe` config).

    Decoder layers 0 .. first_k_dense_replace - 1 are dense SwiGLU MLPs of width `intermediate_size`;
    the others are sparse: a sigmoid router over `n_routed_experts` SwiGLU experts of width
    `moe_intermediate_size` choosing `num_experts_per_tok` in `topk_group` of `n_group` expert groups,
    plus `n_shared_experts` always-on experts (one SwiGLU MLP of width n_shared * moe_intermediate_size).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    passthrough: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    model_type: ClassVar[str] = MODEL_TYPE  # the registry key (zrl.models)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "n_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.n_routed_experts > MAX_EXPERTS:
            raise ConfigError(f"n_routed_experts must be <= {MAX_EXPERTS} (uint8 expert ids with {NO_ROUTE} = "
                              f"NO_ROUTE), got {self.n_routed_experts}")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ConfigError(f"n_group ({self.n_group}) must split n_routed_experts ({self.n_routed_experts}) "
                              "into equal groups of at least 2 (a group's score is its top-2 sum)")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of "
                              f"topk_group ({self.topk_group}) groups")
        if self.first_k_dense_replace >= self.num_hidden_layers:
            raise ConfigError(f"first_k_dense_replace ({self.first_k_dense_replace}) leaves no sparse layer of "
                              f"{self.num_hidden_layers}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ConfigError(f"partial_rotary_factor ({self.partial_rotary_factor}) x head_dim ({self.head_dim}) "
                              f"must give an even number of rotated channels, got {self.rotary_dim}")
        for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be positive, got {value!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' and vLLM's rule: the first `first_k_dense_replace` layers are dense."""
        return layer_idx >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_hidden_layers))

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones); transformers' and vLLM's int()."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def routing_width(self) -> int:
        """Columns of a routing record: L * k, layer-major; dense layers' columns are always NO_ROUTE."""
        return self.num_hidden_layers * self.num_experts_per_tok

    # ---------------------------------------------------------------- Hugging Face interchange

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, strict: bool = True) -> Glm4MoEConfig:
        """Parse a glm4_moe config.json dict. `strict=False` logs and ignores unknown keys instead of raising."""
        cfg = dict(raw)
        model_type = cfg.pop("model_type", None)
        if model_type != MODEL_TYPE:
            raise ConfigError(f"model_type must be {MODEL_TYPE!r}, got {model_type!r}")
        pop_supported(cfg, "hidden_act", "silu", "SwiGLU experts use SiLU")
        pop_supported(cfg, "attention_dropout", 0.0, "no attention dropout in training or rollout")
        for key in ("rope_scaling", "quantization_config"):
            if cfg.pop(key, None) is not None:
                raise ConfigError(f"{key} is not supported")
        for key in _MTP_KEYS:  # ignored: the forward pass does not depend on them (module docstring)
            cfg.pop(key, None)
        fields = dict(
            vocab_size=pop_required(cfg, "vocab_size"),
            hidden_size=pop_required(cfg, "hidden_size"),
            intermediate_size=pop_required(cfg, "intermediate_size"),
            num_hidden_layers=pop_required(cfg, "num_hidden_layers"),
            num_attention_heads=pop_required(cfg, "num_attention_heads"),
            num_key_value_heads=pop_required(cfg, "num_key_value_heads"),
            moe_intermediate_size=pop_required(cfg, "moe_intermediate_size"),
            n_routed_experts=pop_expert_count(cfg, "n_routed_experts"),
            num_experts_per_tok=pop_required(cfg, "num_experts_per_tok"),
            **_parse_rope(cfg),
        )
        fields["head_dim"] = cfg.pop("head_dim", None) or fields["hidden_size"] // fields["num_attention_heads"]
        shared = cfg.pop("n_shared_experts", 1)
        fields["n_shared_experts"] = 0 if shared is None else shared
        for key in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
                    "use_qk_norm", "attention_bias", "rms_norm_eps", "tie_word_embeddings", "pad_token_id"):
            if key in cfg:
                fields[key] = cfg.pop(key)
        return cls(**fields, passthrough=leftover_keys(cfg, _IGNORED_KEYS, strict, MODEL_TYPE))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers' `Glm4MoeConfig` (and vLLM) load into the same architecture.

        It declares no multi-token-prediction layers: a checkpoint written from this model holds none."""
        out: dict[str, Any] = {"architectures": ["Glm4MoeForCausalLM"]}
        out.update(self.passthrough)
        out.update(
            model_type=MODEL_TYPE, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, moe_intermediate_size=self.moe_intermediate_size,
            n_routed_experts=self.n_routed_experts, num_experts_per_tok=self.num_experts_per_tok,
            n_shared_experts=self.n_shared_experts, n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor, norm_topk_prob=self.norm_topk_prob,
            first_k_dense_replace=self.first_k_dense_replace, use_qk_norm=self.use_qk_norm,
            attention_bias=self.attention_bias, rms_norm_eps=self.rms_norm_eps,
            partial_rotary_factor=self.partial_rotary_factor, rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
            tie_word_embeddings=self.tie_word_embeddings, attention_dropout=0.0, hidden_act="silu",
            num_nextn_predict_layers=0, pad_token_id=self.pad_token_id,
        )
        return out

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, strict: bool = True) -> Glm4MoEConfig:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), strict=strict)

    def save_json(self, path: str | Path) -> None:
        with open(Path(path) / "config.json", "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=True)




def _parse_rope(cfg: dict[str, Any]) -> dict[str, float]:
    """rope_theta and partial_rotary_factor of default RoPE, from `rope_parameters` or the top level (the
    two must agree where both are given); partial_rotary_factor defaults to 0.5 as in transformers and vLLM."""
    params = dict(cfg.pop("rope_parameters", None) or {})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    out = {}
    for key, default in (("rope_theta", 10_000.0), ("partial_rotary_factor", 0.5)):
        top, nested = cfg.pop(key, None), params.pop(key, None)
        if None not in (top, nested) and float(top) != float(nested):
            raise ConfigError(f"{key}={top} and rope_parameters.{key}={nested} disagree")
        value = nested if nested is not None else top
        out[key] = float(default if value is None else value)
    if params:
        raise ConfigError(f"rope_parameters keys {sorted(params)} are not supported")
    return out
