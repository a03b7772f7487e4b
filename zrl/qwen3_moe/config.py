"""Qwen3-MoE model configuration: parsing and validation of Hugging Face `qwen3_moe` config.json files.

Responsibility: turn the `config.json` of a `model_type: qwen3_moe` checkpoint into a frozen
`Qwen3MoEConfig` holding exactly the numbers the model code uses. What this implementation does not
run (sliding-window attention, non-default RoPE, dropout, activations other than SiLU, a shared
expert, more than 255 experts) is rejected with a `ConfigError` naming the key, so a checkpoint never
loads into a silently different model. Both spellings transformers writes are read: `num_experts` or
`num_local_experts`, `rope_parameters` (transformers >= 5) or a top-level `rope_theta` (older files).

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


MODEL_TYPE = "qwen3_moe"
# Routing records hold expert ids 0..E-1 as uint8 with NO_ROUTE (255) meaning "no record" (no skip class).
MAX_EXPERTS = NO_ROUTE

# Keys without architectural meaning for a training forward pass, kept verbatim.
_IGNORED_KEYS = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "use_cache", "output_router_logits", "initializer_range", "max_position_embeddings", "max_window_layers",
    "_name_or_path", "return_dict", "output_hidden_states", "output_attentions", "tokenizer_class",
    "keys_to_ignore_at_inference", "router_aux_loss_coef", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward",
})


@dataclasses.dataclass(frozen=True)
class Qwen3MoEConfig:
    """The numbers that define a Qwen3-MoE model (names follow the HF `qwen3_moe` config).

    Decoder layer i is sparse (router + E SwiGLU experts, top-k) unless i is in `mlp_only_layers` or
    (i + 1) is not a multiple of `decoder_sparse_step`; then it is a dense SwiGLU MLP of width
    `intermediate_size`.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int = 0  # dense layers only; 0 when every layer is sparse
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    pad_token_id: int | None = None
    passthrough: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    model_type: ClassVar[str] = MODEL_TYPE  # the registry key (zrl.models)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "moe_intermediate_size", "num_experts",
                     "num_experts_per_tok", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (rotate-half RoPE), got {self.head_dim}")
        if self.num_experts > MAX_EXPERTS:
            raise ConfigError(f"num_experts must be <= {MAX_EXPERTS} (uint8 expert ids with {NO_ROUTE} = "
                              f"NO_ROUTE), got {self.num_experts}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                              f"({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {bad} outside [0, {self.num_hidden_layers})")
        if not self.moe_layers:
            raise ConfigError("no sparse layer: mlp_only_layers / decoder_sparse_step leave every layer dense")
        if len(self.moe_layers) < self.num_hidden_layers and self.intermediate_size < 1:
            raise ConfigError("intermediate_size must be a positive integer when some layers are dense "
                              f"(mlp_only_layers / decoder_sparse_step), got {self.intermediate_size!r}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(f"pad_token_id {self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' rule (Qwen3MoeDecoderLayer): sparse unless listed or off the sparse step."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def routing_width(self) -> int:
        """Columns of a routing record: L * k, layer-major (layer l owns columns l*k .. l*k + k - 1).

        Every decoder layer has k columns, dense ones included (always NO_ROUTE there), so a column's
        layer is the decoder layer index, as in vLLM's routed-experts capture."""
        return self.num_hidden_layers * self.num_experts_per_tok

    # ---------------------------------------------------------------- Hugging Face interchange

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, strict: bool = True) -> Qwen3MoEConfig:
        """Parse a qwen3_moe config.json dict. `strict=False` logs and ignores unknown keys instead of raising."""
        cfg = dict(raw)
        model_type = cfg.pop("model_type", None)
        if model_type != MODEL_TYPE:
            raise ConfigError(f"model_type must be {MODEL_TYPE!r}, got {model_type!r}")
        pop_supported(cfg, "hidden_act", "silu", "SwiGLU experts use SiLU")
        pop_supported(cfg, "attention_dropout", 0.0, "no attention dropout in training or rollout")
        pop_supported(cfg, "use_sliding_window", False, "sliding-window attention is not implemented")
        pop_supported(cfg, "shared_expert_intermediate_size", 0, "a shared expert is not implemented")
        cfg.pop("sliding_window", None)  # meaningful only with use_sliding_window (rejected above)
        for key in ("rope_scaling", "quantization_config"):
            if cfg.pop(key, None) is not None:
                raise ConfigError(f"{key} is not supported")
        fields = dict(
            vocab_size=pop_required(cfg, "vocab_size"),
            hidden_size=pop_required(cfg, "hidden_size"),
            num_hidden_layers=pop_required(cfg, "num_hidden_layers"),
            num_attention_heads=pop_required(cfg, "num_attention_heads"),
            num_key_value_heads=pop_required(cfg, "num_key_value_heads"),
            moe_intermediate_size=pop_required(cfg, "moe_intermediate_size"),
            num_experts=pop_expert_count(cfg, "num_experts"),
            num_experts_per_tok=pop_required(cfg, "num_experts_per_tok"),
            rope_theta=_parse_rope(cfg),
            mlp_only_layers=tuple(cfg.pop("mlp_only_layers", None) or ()),
        )
        fields["head_dim"] = cfg.pop("head_dim", None) or fields["hidden_size"] // fields["num_attention_heads"]
        for key in ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "rms_norm_eps",
                    "tie_word_embeddings", "attention_bias", "pad_token_id"):
            if key in cfg:
                fields[key] = cfg.pop(key)
        return cls(**fields, passthrough=leftover_keys(cfg, _IGNORED_KEYS, strict, MODEL_TYPE))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers' `Qwen3MoeConfig` (and vLLM) load into the same architecture."""
        out: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"]}
        out.update(self.passthrough)
        out.update(
            model_type=MODEL_TYPE, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
            rms_norm_eps=self.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
            attention_dropout=0.0, hidden_act="silu", use_sliding_window=False, pad_token_id=self.pad_token_id,
        )
        return out

    @classmethod
    def from_pretrained_dir(cls, path: str | Path, *, strict: bool = True) -> Qwen3MoEConfig:
        with open(Path(path) / "config.json", encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), strict=strict)

    def save_json(self, path: str | Path) -> None:
        with open(Path(path) / "config.json", "w", encoding="utf-8") as f:
            json.dump(self.to_hf_dict(), f, indent=2, sort_keys=True)




def _parse_rope(cfg: dict[str, Any]) -> float:
    """rope_theta of default RoPE: from `rope_parameters` (transformers >= 5) or the legacy top-level key."""
    params = dict(cfg.pop("rope_parameters", None) or {})
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
    legacy = cfg.pop("rope_theta", None)
    theta = params.pop("rope_theta", legacy if legacy is not None else 10_000.0)
    if params:
        raise ConfigError(f"rope_parameters keys {sorted(params)} are not supported")
    return float(theta)
