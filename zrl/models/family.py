"""The model contract: what the trainer, export, weight sync, rollout worker, preflight, planner and
serving need to know about a model architecture, in one small class per architecture.

An architecture's package (zrl/moepp, zrl/qwen3_moe) holds its model code and one `ModelFamily`
subclass (`<package>/family.py`) that declares its Hugging Face names once (`hf_names`, from which
loading, export, weight sync and the engine's key list derive) and its tiny CPU checkpoint
(`tiny_config`, `new_tiny_model`: what `zrl init-tiny-model --arch` and `model.tiny_arch` build);
zrl/models/registry.py maps a checkpoint's config.json `model_type` to it. What families share lives
in zrl/modeling. Callers never import an architecture's package directly: they resolve a family
(`family_of_checkpoint(path)`, `family_of(model)`, `get_family(model_type)`) and go through it.

What a family's model must offer besides the methods below (the trainer calls these on the model):
  model.config                         its parsed config, with a `model_type` class attribute
  model.layers                         the decoder layers (the default FSDP2 units)
  model.token_logprobs(input_ids, targets, cu_seqlens=, routing_replay=, with_entropy=, chunk_tokens=,
                       sampling=)      -> zrl.modeling.causal_lm.TokenLogprobs: [T] log-probs under the
                                          engine's sampling distribution, `.routing` a
                                          zrl.modeling.routing.RoutingInfo whose `expert_counts` is
                                          [L, shape.count_classes]
  model.set_activation_checkpointing(layers, context_fn=)

Invariants: importing this module, resolving a family, parsing a config and reading its shape import
no torch (preflight checks a config without it); methods that need torch (the FLOP model counts the
parameters of a model built on the meta device) import it themselves.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from zrl.modeling.hf_names import HFNames

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

# How the rollout engine reports the experts each token was routed to (serving dispatches on it):
# the model's own forward returns them (zrl's out-of-tree vLLM model, serving/zaya_vllm.py), or a
# capture function is bound on every MoE layer's router of vLLM's built-in model
# (`BaseRouter.set_capture_fn`, called with the [T, k] top-k ids).
ROUTING_CAPTURE_MODEL_FORWARD = "model_forward"
ROUTING_CAPTURE_ROUTER_HOOK = "router_capture_fn"
ROUTING_CAPTURE_KINDS = (ROUTING_CAPTURE_MODEL_FORWARD, ROUTING_CAPTURE_ROUTER_HOOK)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers of a config that code outside the model package needs (routing layout, vocabulary)."""

    vocab_size: int
    num_layers: int  # L decoder layers; a routing record has k columns per layer, layer-major
    num_experts: int  # E routed experts
    experts_per_token: int  # k
    skip_class: bool  # a routing id E means "skip" (MoE++): ids are 0..E, else 0..E-1

    @property
    def routing_width(self) -> int:
        """Columns of a routing record [T, L * k]."""
        return self.num_layers * self.experts_per_token

    @property
    def count_classes(self) -> int:
        """Columns of the per-layer expert counts [L, C]: E, plus the skip class when there is one."""
        return self.num_experts + int(self.skip_class)


@dataclasses.dataclass(frozen=True)
class LoRAModules:
    """Where low-rank adapters go in a family's model (zrl.modeling.lora), by kind: patterns over the
    model's module names, `*` standing for one name part (a layer index). `attention`, `dense_mlp` and
    `router` name `nn.Linear` modules whose own forward computes the output (a subclass with its own
    forward cannot be wrapped), `experts` names `zrl.modeling.experts.SwiGLUExperts`. An empty `router`
    says the family's router has no such module (a recipe asking for router adapters is refused)."""

    attention: tuple[str, ...]
    experts: tuple[str, ...]
    dense_mlp: tuple[str, ...] = ()
    router: tuple[str, ...] = ()


class BiasController(Protocol):
    """What `ModelFamily.bias_balancer` returns: an optimizer on the router biases, stepped with the
    global batch's [L, C] expert counts (the trainer checkpoints `optimizer` and reads `biases`' device)."""

    biases: list[torch.Tensor]
    optimizer: torch.optim.Optimizer

    def step(self, expert_counts: torch.Tensor) -> torch.Tensor:
        """One update; returns the error it applied."""


@dataclasses.dataclass(frozen=True)
class FlopModel:
    """What the planner's trainer model needs: FLOPs per token = 6 * active_params (dense forward and
    backward of the weights a token uses, embedding lookup and LM head excluded, as in published
    "active parameter" counts) plus the causal attention term 6 * num_layers * attention_dim * T."""

    total_params: int  # every parameter once
    active_params: int  # non-embedding parameters a token uses (top-k of E experts)
    num_layers: int
    attention_dim: int  # query heads x head dim


class ModelFamily(abc.ABC):
    """One architecture. Subclasses set the class attributes and implement the abstract methods; the
    others have defaults that fit a model whose decoder layers are `model.layers`."""

    model_type: ClassVar[str]  # config.json's model_type, the registry key
    vllm_architecture: ClassVar[str]  # config.json's architectures[0]: the vLLM model class that serves it
    routing_capture: ClassVar[str]  # one of ROUTING_CAPTURE_KINDS
    hf_names: ClassVar[HFNames]  # how its parameters are keyed in HF checkpoints
    # The tiny CPU checkpoint's HF config fields (the vocabulary and special token ids are the tiny
    # tokenizer's, zrl.assets); preflight reads its max_position_embeddings before the model exists.
    tiny_config: ClassVar[Mapping[str, Any]]
    lora_modules: ClassVar[LoRAModules]  # where `model.lora` puts adapters (zrl.modeling.lora)

    # ------------------------------------------------------------------ config (no torch)

    @abc.abstractmethod
    def parse_config(self, raw: dict[str, Any], *, strict: bool = True) -> Any:
        """The package's config from a config.json dict; raises ValueError (ConfigError) naming the key."""

    def read_config(self, path: str | Path, *, strict: bool = True) -> Any:
        """The config of checkpoint directory `path`."""
        return self.parse_config(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")), strict=strict)

    @abc.abstractmethod
    def shape(self, config: Any) -> ModelShape:
        ...

    def flop_model(self, config: Any) -> FlopModel:
        """Parameter counts of the model itself (built on meta), its layers and attention width
        (num_attention_heads x head_dim: a family whose config names them otherwise overrides this)."""
        import torch

        from zrl.modeling.params import count_parameters

        shape = self.shape(config)
        with torch.device("meta"):
            counts = count_parameters(self.build(config), experts_per_token=shape.experts_per_token)
        return FlopModel(total_params=counts.total, active_params=counts.active_non_embedding,
                         num_layers=shape.num_layers, attention_dim=config.num_attention_heads * config.head_dim)

    # ------------------------------------------------------------------ trainer

    @abc.abstractmethod
    def build(self, config: Any) -> nn.Module:
        """A new model on the current default device (the trainer builds on meta, shards, then loads)."""

    def load_model(self, path: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                   strict_config: bool = True) -> nn.Module:
        """The model of HF checkpoint directory `path` with every tensor loaded, checked against its config."""
        import torch

        from zrl.modeling.hf_io import load_into

        config = self.read_config(path, strict=strict_config)
        with torch.device("meta"):
            model = self.build(config)
        return load_into(model, path, self.hf_names, dtype=dtype, device=device)

    def load_state_dict(self, path: str | Path, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full state dict (the model's own names) of HF checkpoint directory `path`."""
        return self.load_model(path, dtype=dtype).state_dict()

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules to `fully_shard` one by one before the root (the root keeps what is left)."""
        return list(model.layers)

    def optimizer_param_groups(self, model: nn.Module) -> dict[str, dict[str, nn.Parameter]]:
        """{"muon": {name: param}, "adamw": {name: param}}: every Linear weight and expert tensor of the
        decoder layers to Muon, the rest to AdamW (zrl.modeling.params)."""
        from zrl.modeling.params import optimizer_param_groups

        return optimizer_param_groups(model)

    def bias_balancer(self, model: nn.Module, *, lr: float) -> BiasController:
        """The router-bias controller (`step(expert_counts)`) of a model with balancing biases; a
        family without them raises (a recipe asked `algorithm.router_bias_update` of it)."""
        raise ValueError(f"algorithm.router_bias_update: {self.model_type} models have no router balancing biases")

    @abc.abstractmethod
    def routing_metrics(self, expert_counts: torch.Tensor) -> dict[str, float]:
        """`routing/*` metrics of [L, C] expert counts summed over the global batch."""

    # ------------------------------------------------------------------ export and weight sync

    def hf_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A model tensor (its state-dict name, full) as the HF checkpoint key(s) the engine loads,
        on the tensor's device, without copying where a view will do."""
        return self.hf_names.hf_tensors(name, tensor)

    def hf_checkpoint_keys(self, config: Any) -> frozenset[str]:
        """The HF keys of a complete checkpoint of `config` (what a full weight update holds)."""
        import torch

        from zrl.modeling.hf_io import hf_checkpoint_keys

        with torch.device("meta"):
            return hf_checkpoint_keys(self.build(config), self.hf_names)

    def save_hf_checkpoint(self, state: dict[str, torch.Tensor], path: str | Path, *, config: Any,
                           dtype: torch.dtype | None, max_shard_bytes: int | None = None) -> None:
        """Write config.json + safetensors of a full state dict (the model's names) that transformers loads."""
        from zrl.modeling.hf_io import save_hf_checkpoint

        save_hf_checkpoint(state, path, self.hf_names, config=config, dtype=dtype, max_shard_bytes=max_shard_bytes)

    # ------------------------------------------------------------------ tiny CPU checkpoint

    @abc.abstractmethod
    def new_tiny_model(self, hf_config: dict[str, Any]) -> PreTrainedModel:
        """transformers' own model of this architecture for the HF config fields `hf_config`, initialised
        from torch's global generator (the caller seeds it)."""

    def build_tiny(self, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
        """Write the tiny tokenizer and a seeded tiny checkpoint of this family into `out_dir`; returns the
        path. `overrides` change fields of `tiny_config` (e.g. num_hidden_layers=4)."""
        from zrl.assets import write_tiny_checkpoint

        return write_tiny_checkpoint(out_dir, self.new_tiny_model, {**self.tiny_config, **overrides},
                                     seed=seed, overrides=overrides)
