"""vLLM general plugin: registers the ZAYA1 (`zaya`) model with vLLM in every process that loads it.

vLLM runs the functions of the `vllm.general_plugins` entry-point group in each of its processes
(engine core, workers, Ray actors); `register` is that function (see serving/ENTRY_POINTS.txt).
transformers >= 5.19 already knows `ZayaConfig` (model_type "zaya"), so only the model class is
registered. Prefix caching needs nothing here: vLLM puts a hybrid model's state cache in its "align" mode
when prefix caching is on, which is the mode the model accepts (serving/cca_state.py).

Invariant: calling `register` again is harmless; importing this module imports no torch.
"""

from __future__ import annotations

ARCHITECTURE = "ZayaForCausalLM"
MODEL_CLASS = "serving.zaya_vllm:ZayaForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if not _is_ours():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


def _is_ours() -> bool:
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    registered = ModelRegistry.models.get(ARCHITECTURE)
    return (isinstance(registered, _LazyRegisteredModel)
            and f"{registered.module_name}:{registered.class_name}" == MODEL_CLASS)
