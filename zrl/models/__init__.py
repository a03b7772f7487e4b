"""The model contract (`ModelFamily`) and its registry keyed by config.json's model_type.

See zrl/models/family.py for the contract and docs/design.md "Model contract" for who calls it.
Importing this package imports no torch.
"""

from zrl.models.family import (ROUTING_CAPTURE_KINDS, ROUTING_CAPTURE_MODEL_FORWARD, ROUTING_CAPTURE_ROUTER_HOOK,
                               FlopModel, LoRAModules, ModelFamily, ModelShape)
from zrl.models.registry import family_of, family_of_checkpoint, get_family, model_type_of, register, registered_types

__all__ = ["FlopModel", "LoRAModules", "ModelFamily", "ModelShape", "ROUTING_CAPTURE_KINDS", "ROUTING_CAPTURE_MODEL_FORWARD",
           "ROUTING_CAPTURE_ROUTER_HOOK", "family_of", "family_of_checkpoint", "get_family", "model_type_of",
           "register", "registered_types"]
