"""The model contract: what the trainer, export, weight sync, rollout worker, preflight, planner and
serving need to know about a model architecture, in one small class per architecture.

An architecture's package (zrl/moepp, zrl/qwen3_moe) holds its model code and one `ModelFamily`
subclass (`<package>/family.py`); zrl/models/registry.py maps a checkpoint's config.json
`model_type` to it. Callers never import an architecture's package directly: they resolve a family
(`family_of_checkpoint(path)`, `family_of(model)`) and go through it.

What a family's model must offer besides the methods below (the trainer calls these on the model):
  model.config                         its parsed config, with a `model_type` class attribute
  model.layers                         the decoder layers (the default FSDP2 units)
  model.token_logprobs(input_ids, targets, cu_seqlens=, routing_replay=, with_entropy=, chunk_tokens=,
                       sampling=)      -> zrl.moepp.TokenLogprobs: [T] log-probs under the engine's
                                          sampling distribution, `.routing` a zrl.moepp.RoutingInfo
                                          whose `expert_counts` is [L, shape.count_classes]
  model.set_activation_checkpointing(layers, context_fn=)

Invariants: importing this module, resolving a family, parsing a config and reading its shape import
no torch (preflight checks a config without it); methods that need torch (the FLOP model counts the
parameters of a model built on the meta device) import it themselves.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from torch import nn

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

    @abc.abstractmethod
    def flop_model(self, config: Any) -> FlopModel:
        ...

    # ------------------------------------------------------------------ trainer

    @abc.abstractmethod
    def build(self, config: Any) -> nn.Module:
        """A new model on the current default device (the trainer builds on meta, shards, then loads)."""

    @abc.abstractmethod
    def load_state_dict(self, path: str | Path, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The full state dict (the model's own names) of HF checkpoint directory `path`, checked
        against its config."""

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """Modules to `fully_shard` one by one before the root (the root keeps what is left)."""
        return list(model.layers)

    def optimizer_param_groups(self, model: nn.Module) -> dict[str, dict[str, nn.Parameter]]:
        """{"muon": {name: param}, "adamw": {name: param}}: every Linear weight and expert tensor of the
        decoder layers to Muon, the rest to AdamW (zrl.moepp.params)."""
        from zrl.moepp.params import optimizer_param_groups

        return optimizer_param_groups(model)

    def bias_balancer(self, model: nn.Module, *, lr: float):
        """The router-bias controller (zrl.moepp.BiasBalancer) of a model with balancing biases; a
        family without them raises (a recipe asked `algorithm.router_bias_update` of it)."""
        raise ValueError(f"algorithm.router_bias_update: {self.model_type} models have no router balancing biases")

    @abc.abstractmethod
    def routing_metrics(self, expert_counts: torch.Tensor) -> dict[str, float]:
        """`routing/*` metrics of [L, C] expert counts summed over the global batch."""

    # ------------------------------------------------------------------ export and weight sync

    @abc.abstractmethod
    def hf_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A model tensor (its state-dict name, full) as the HF checkpoint key(s) the engine loads,
        on the tensor's device, without copying where a view will do."""

    @abc.abstractmethod
    def save_hf_checkpoint(self, state: dict[str, torch.Tensor], path: str | Path, *, config: Any,
                           dtype: torch.dtype | None) -> None:
        """Write config.json + safetensors of a full state dict (the model's names) that transformers loads."""
