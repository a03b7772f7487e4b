"""The models the rollout engine serves, by config.json's `model_type`, and what differs between them.

Everything model-specific of serving is here: how a forward's routing is read (the capture class of the
kind the model contract's family names, `zrl.models.ModelFamily.routing_capture`), how
many columns a routing row has (the family's shape), which HF tensors make a complete weight update
(the family's declared HF names, `ModelFamily.hf_checkpoint_keys`), and what must be rebuilt after one. The engine (engine.py) and the worker extension (worker_ext.py) look a model up by
`served_model(model_type)` and are otherwise model-agnostic.

- `zaya` (ZAYA1 MoE++, serving/zaya_vllm.py, registered by plugin.py): top-1 with a skip class; the
  model stores the chosen expert per MoE layer in `last_routing` [T, L] (skip = E). Width L.
- `qwen3_moe`, `glm4_moe` (vLLM's built-in Qwen3MoeForCausalLM, Glm4MoeForCausalLM) and any family
  whose `routing_capture` is the router hook: top-k; each sparse layer's fused-MoE router
  (`BaseRouter`) calls a capture fn with its [T, k] logical expert ids before the EPLB mapping (the hook
  vLLM's own routed-experts capturer binds, fused_moe/routed_experts_capturer.py). Width L * k,
  layer-major: decoder layer l owns columns l*k .. l*k + k - 1 (zrl.qwen3_moe's record layout); dense
  layers' columns stay NO_ROUTE.
Shapes: T tokens of an engine step, L decoder layers, k experts per token, E experts.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch
from torch import nn

from zrl.models import ROUTING_CAPTURE_MODEL_FORWARD, ROUTING_CAPTURE_ROUTER_HOOK, ModelShape, get_family
from zrl.models.registry import registered_types
from zrl.types import NO_ROUTE


class ZayaCapture:
    """Reads the ZAYA model's own record of the last forward."""

    def __init__(self, model: nn.Module, max_tokens: int) -> None:
        self.model = model
        self.width = len(model.model.layers)

    def start(self) -> None:
        pass

    def rows(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, L] uint8 of the forward that just ran."""
        return self.model.last_routing[:num_tokens]


class RouterCapture:
    """Binds a capture fn on every fused-MoE router; a recorded forward fills one [T, L * k] buffer.

    Only forwards between `start()` and `rows()` are written (vLLM's dummy and profiling runs are not);
    every sparse layer overwrites its k columns of the step's rows, dense layers' columns keep NO_ROUTE.
    """

    def __init__(self, model: nn.Module, max_tokens: int) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        shape = served_shape(model)
        self.top_k = shape.experts_per_token
        if shape.num_experts > NO_ROUTE:
            raise ValueError(f"num_experts: routing records are uint8 with {NO_ROUTE} = no record, so at most "
                             f"{NO_ROUTE} experts, got {shape.num_experts}")
        self.width = shape.routing_width
        device = next(model.parameters()).device
        self.buffer = torch.full((max_tokens, self.width), NO_ROUTE, dtype=torch.uint8, device=device)  # [T, L*k]
        self._recording = False
        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("routing capture found no fused-MoE layer in the served model")
        for runner in runners:
            if runner.is_monolithic or not isinstance(runner.router, BaseRouter):
                # Monolithic kernels route inside the kernel; vLLM captures those through a sink of its
                # V2 runner's AuxOutput path, which this V1 capture does not use.
                raise ValueError(f"routing capture needs a modular fused-MoE kernel with a BaseRouter; layer "
                                 f"{runner.layer_id} has {type(runner.router).__name__} "
                                 f"(monolithic={runner.is_monolithic})")
            runner.router.set_capture_fn(self._writer(runner.layer_id))

    def _writer(self, layer_idx: int) -> Callable[[torch.Tensor], None]:
        columns = slice(layer_idx * self.top_k, (layer_idx + 1) * self.top_k)

        def capture(topk_ids: torch.Tensor) -> None:  # [T, k] logical expert ids
            if self._recording:
                self.buffer[: topk_ids.shape[0], columns] = topk_ids
        return capture

    def start(self) -> None:
        self._recording = True

    def rows(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, L * k] uint8 of the forward that just ran."""
        self._recording = False
        return self.buffer[:num_tokens]


def served_config(model: nn.Module):
    """The family's parsed config of a served model: zrl's own vLLM models hold it as `config`, vLLM's
    built-in ones the HF config, parsed here (keys the family does not read are ignored: vLLM adds its own)."""
    from transformers import PretrainedConfig

    config = model.config
    if not isinstance(config, PretrainedConfig):
        return config
    return get_family(config.model_type).parse_config(config.to_dict(), strict=False)


def served_shape(model: nn.Module) -> ModelShape:
    """Layers, experts and k of a served model, as its family reads them from the HF config."""
    return get_family(model.config.model_type).shape(served_config(model))


_CHECKPOINT_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_keys(model: nn.Module) -> frozenset[str]:
    """The HF keys a complete weight update of `model` holds (its family's declared names; computed once
    per model)."""
    if model not in _CHECKPOINT_KEYS:
        _CHECKPOINT_KEYS[model] = get_family(model.config.model_type).hf_checkpoint_keys(served_config(model))
    return _CHECKPOINT_KEYS[model]


def _zaya_after_load(model: nn.Module) -> None:
    model.refresh_derived_weights()  # the fp32 LM-head copy off CUDA


# How each kind of the model contract's `routing_capture` (zrl.models) is read from a served model.
CAPTURES = {ROUTING_CAPTURE_MODEL_FORWARD: ZayaCapture, ROUTING_CAPTURE_ROUTER_HOOK: RouterCapture}


@dataclasses.dataclass(frozen=True)
class ServedModel:
    model_type: str  # config.json's
    after_load: Callable[[nn.Module], None] = lambda model: None  # derived tensors to rebuild after a load

    @staticmethod
    def checkpoint_keys(model: nn.Module) -> frozenset[str]:
        """HF keys a complete weight update holds."""
        return checkpoint_keys(model)

    @property
    def capture(self) -> Callable[[nn.Module, int], ZayaCapture | RouterCapture]:
        """(model, max tokens of a step) -> the capture: the kind the architecture's model family names."""
        return CAPTURES[get_family(self.model_type).routing_capture]


# Families with something to rebuild after a weight update; every other registered family is served as is.
SERVED_MODELS: dict[str, ServedModel] = {
    "zaya": ServedModel("zaya", _zaya_after_load),
}


def served_model(model_type: str) -> ServedModel:
    """The serving entry of a registered family (zrl.models); any other model_type is refused."""
    if model_type not in registered_types():
        raise ValueError(f"model_type {model_type!r} is not served by the rollout engine; served: "
                         f"{registered_types()}")
    return SERVED_MODELS.get(model_type, ServedModel(model_type))
