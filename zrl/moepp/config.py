"""MoE++ (ZAYA1) model configuration: parsing and validation of Hugging Face `zaya` config.json files.

Responsibility: turn the `config.json` of a `model_type: zaya` checkpoint into a frozen `MoEPPConfig`
that holds exactly the numbers the model code uses, and write one back that transformers'
`ZayaConfig` reads. Anything this implementation does not support (top-k other than 1, sliding-window
layers, non-default RoPE, dropout, an LM-head bias, activations other than SiLU...) is rejected with a
`ConfigError` naming the offending key, so a checkpoint never loads into a silently different model.

Invariants: importing this module imports neither torch nor transformers (the vLLM plugin and the
recipe validator reuse it); `from_hf_dict(to_hf_dict(c)) == c`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar

from zrl.modeling.config import ConfigError, leftover_keys, pop_required, pop_supported
from zrl.types import NO_ROUTE

MODEL_TYPE = "zaya"
SUPPORTED_LAYER_TYPE = "hybrid"
# Routing records store expert ids as uint8 with NO_ROUTE (255) meaning "no record": ids 0..E
# (E = skip) must stay below it, so E <= 254.
MAX_EXPERTS = NO_ROUTE - 1

# Keys of a zaya config.json that carry no architectural meaning for a training forward pass
# (generation defaults, provenance, HF runtime switches). They are kept and written back unchanged.
_IGNORED_KEYS = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "use_cache", "output_router_logits", "initializer_range", "max_position_embeddings",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "tokenizer_class",
    "keys_to_ignore_at_inference", "router_aux_loss_coef", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward",
})


@dataclasses.dataclass(frozen=True)
class MoEPPConfig:
    """The numbers that define a ZAYA1 MoE++ model (names follow the HF `zaya` config).

    Every layer is a CCA attention block followed by a top-1 MoE block with a skip class.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    router_hidden_size: int
    cca_time0: int = 2
    cca_time1: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 5_000_000.0
    partial_rotary_factor: float = 0.5
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    pad_token_id: int | None = 0
    # Keys from `_IGNORED_KEYS` read from a checkpoint, written back verbatim on save.
    passthrough: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    model_type: ClassVar[str] = MODEL_TYPE  # the registry key (zrl.models)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                     "router_hidden_size", "cca_time0", "cca_time1"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if (self.num_key_value_heads * self.head_dim) % 2:
            raise ConfigError("num_key_value_heads * head_dim must be even: half of the value channels come "
                              "from the current token and half from the previous one")
        if self.num_experts > MAX_EXPERTS:
            raise ConfigError(f"num_experts must be <= {MAX_EXPERTS} (uint8 expert ids with 255 = "
                              f"NO_ROUTE, no record), got {self.num_experts}")
        if not 0.0 <= self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even rotary "
                              f"dimension in [0, head_dim]; got {self.rotary_dim} of head_dim {self.head_dim}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates (the leading ones); the rest carry no position."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_router_classes(self) -> int:
        """E real experts plus the skip class (index E): the token gets zero MoE output."""
        return self.num_experts + 1

    @property
    def skip_expert_id(self) -> int:
        return self.num_experts

    # ---------------------------------------------------------------- Hugging Face interchange

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, strict: bool = True) -> MoEPPConfig:
        """Parse a zaya config.json dict. `strict=False` logs and ignores unknown keys instead of raising."""
        cfg = dict(raw)
        model_type = cfg.pop("model_type", None)
        if model_type != MODEL_TYPE:
            raise ConfigError(f"model_type must be {MODEL_TYPE!r}, got {model_type!r}")
        pop_supported(cfg, "num_experts_per_tok", 1, "top-1 routing only", allow_null=False)
        pop_supported(cfg, "hidden_act", "silu", "SwiGLU experts use SiLU", allow_null=False)
        pop_supported(cfg, "attention_dropout", 0.0, "no attention dropout in training or rollout", allow_null=False)
        pop_supported(cfg, "lm_head_bias", False, "the tied LM head has no bias", allow_null=False)
        pop_supported(cfg, "sliding_window", None, "sliding-window layers are not implemented", allow_null=False)
        pop_supported(cfg, "is_encoder_decoder", False, "a decoder-only model", allow_null=False)
        for key in ("rope_scaling", "quantization_config"):
            if cfg.pop(key, None) is not None:
                raise ConfigError(f"{key} is not supported")

        num_layers = pop_required(cfg, "num_hidden_layers")
        layer_types = cfg.pop("layer_types", None)
        if layer_types is not None:
            if len(layer_types) != num_layers:
                raise ConfigError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
            for i, layer_type in enumerate(layer_types):
                if layer_type != SUPPORTED_LAYER_TYPE:
                    raise ConfigError(f"layer_types[{i}]={layer_type!r} is not supported "
                                      f"(only {SUPPORTED_LAYER_TYPE!r})")
        rope_theta, partial_rotary_factor = _parse_rope(cfg)

        fields = dict(
            vocab_size=pop_required(cfg, "vocab_size"),
            hidden_size=pop_required(cfg, "hidden_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=pop_required(cfg, "num_attention_heads"),
            num_key_value_heads=pop_required(cfg, "num_key_value_heads"),
            moe_intermediate_size=pop_required(cfg, "moe_intermediate_size"),
            num_experts=pop_required(cfg, "num_experts"),
            router_hidden_size=pop_required(cfg, "router_hidden_size"),
            rope_theta=rope_theta,
            partial_rotary_factor=partial_rotary_factor,
        )
        fields["head_dim"] = cfg.pop("head_dim", None) or fields["hidden_size"] // fields["num_attention_heads"]
        for key in ("cca_time0", "cca_time1", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
                    "pad_token_id"):
            if key in cfg:
                fields[key] = cfg.pop(key)
        return cls(**fields, passthrough=leftover_keys(cfg, _IGNORED_KEYS, strict, MODEL_TYPE))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers' `ZayaConfig` loads into the same architecture."""
        out: dict[str, Any] = {"architectures": ["ZayaForCausalLM"]}
        out.update(self.passthrough)
        out.update(
            model_type=MODEL_TYPE,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_experts_per_tok=1,
            router_hidden_size=self.router_hidden_size,
            cca_time0=self.cca_time0,
            cca_time1=self.cca_time1,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            attention_dropout=0.0,
            lm_head_bias=False,
            hidden_act="silu",
            sliding_window=None,
            pad_token_id=self.pad_token_id,
            layer_types=[SUPPORTED_LAYER_TYPE] * self.num_hidden_layers,
            rope_parameters={SUPPORTED_LAYER_TYPE: {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            }},
        )
        return out

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, strict: bool = True) -> MoEPPConfig:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), strict=strict)

    def save_json(self, path: str | Path) -> None:
        with open(Path(path) / "config.json", "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=True)


def zaya1_8b_config() -> MoEPPConfig:
    """The ZAYA1-8B architecture (ZAYA1-8B report Table I; the HF `ZayaConfig` defaults)."""
    return MoEPPConfig(
        vocab_size=262_272, hidden_size=2048, num_hidden_layers=40, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, moe_intermediate_size=2048, num_experts=16,
        router_hidden_size=256, cca_time0=2, cca_time1=2, rms_norm_eps=1e-5, rope_theta=5_000_000.0,
        partial_rotary_factor=0.5, tie_word_embeddings=True, attention_bias=False, pad_token_id=0,
    )




def _parse_rope(cfg: dict[str, Any]) -> tuple[float, float]:
    """RoPE parameters of the `hybrid` layers: nested per layer type (HF >= 5) or flat (legacy keys)."""
    params = cfg.pop("rope_parameters", None) or {}
    if SUPPORTED_LAYER_TYPE in params:
        # The `hybrid_sliding` entry is a default HF writes even when no layer uses it; the layer-type
        # check already rejects configs that would.
        params = params[SUPPORTED_LAYER_TYPE]
    elif params and not {"rope_theta", "partial_rotary_factor", "rope_type"} >= set(params):
        nested = sorted(k for k in params if isinstance(params[k], dict))
        if nested:
            raise ConfigError(f"rope_parameters has no {SUPPORTED_LAYER_TYPE!r} entry (found {nested})")
        raise ConfigError(f"rope_parameters keys {sorted(params)} are not supported")
    params = dict(params)
    rope_type = params.pop("rope_type", cfg.pop("rope_type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    rope_theta = params.pop("rope_theta", cfg.pop("rope_theta", 5_000_000.0))
    partial = params.pop("partial_rotary_factor", cfg.pop("partial_rotary_factor", 0.5))
    if params:
        raise ConfigError(f"rope_parameters keys {sorted(params)} are not supported")
    cfg.pop("rope_theta", None)
    cfg.pop("partial_rotary_factor", None)
    return float(rope_theta), float(partial)
