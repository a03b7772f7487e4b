"""vLLM general plugin: registers the ZAYA1 (`zaya`) model with vLLM in every process that loads it.

vLLM runs the functions of the `vllm.general_plugins` entry-point group in each of its processes
(engine core, workers, Ray actors); `register` is that function (see serving/ENTRY_POINTS.txt).
transformers >= 5.19 already knows `ZayaConfig` (model_type "zaya"), so only the model class and a
config hook are registered. The hook turns prefix caching off for ZAYA: the CCA state is per request,
not per cached block (serving/cca_state.py), so a cached prefix could not restore it.

Invariant: calling `register` again is harmless; importing this module imports no torch.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ARCHITECTURE = "ZayaForCausalLM"
MODEL_CLASS = "serving.zaya_vllm:ZayaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if not _is_ours():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    MODELS_CONFIG_MAP[ARCHITECTURE] = _zaya_config_hook()


def _is_ours() -> bool:
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    registered = ModelRegistry.models.get(ARCHITECTURE)
    return (isinstance(registered, _LazyRegisteredModel)
            and f"{registered.module_name}:{registered.class_name}" == MODEL_CLASS)


def _zaya_config_hook():
    from vllm.model_executor.models.config import VerifyAndUpdateConfig

    class ZayaVllmConfig(VerifyAndUpdateConfig):
        @classmethod
        def verify_and_update_config(cls, vllm_config) -> None:
            if vllm_config.cache_config.enable_prefix_caching:
                logger.info("ZAYA: disabling prefix caching (the CCA state is per request, not per block)")
                vllm_config.cache_config.enable_prefix_caching = False

    return ZayaVllmConfig
