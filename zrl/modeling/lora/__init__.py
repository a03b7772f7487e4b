"""Low-rank adapters (LoRA) on every registered family's model: the recipe's `model.lora`.

What the adapters are (layers.py, experts.py): beside a frozen weight W [out, in], an A [r, in] and a
B [out, r] in fp32, the output W x + (alpha / r) B A dropout(x); B starts at 0, so an adapted model
starts as its base, bitwise. The routed experts get one such pair per expert and projection (gate/up
fused as the base stores them), or one A per projection shared by the experts. Where adapters go is
the family's declaration (`ModelFamily.lora_modules`, zrl/models/family.py) of its attention
projections, experts, dense MLPs and router; the recipe turns kinds on and off (`LoRATargets`).

Functions: `apply_lora` (apply.py: adapt a built model in place, freeze the base in its dtype),
`merged_tensors` / `merge_weight` (merge.py: W + scale B A tensor by tensor, a checkpoint laid out as
the base's), `save_peft_adapter` / `load_peft_adapter` (peft_format.py: a PEFT adapter directory).

Router replay is unchanged: the router still picks (or replays) the experts, and the chosen experts
compute with their adapters (experts.py), in the trainer exactly as in a merged model.

Why router adapters are off by default (`LoRATargets.router`). With replay, the trainer uses the experts
the engine recorded and weights them with its own router's probabilities, so engine and trainer agree
only while both routers are the same function. An adapter on the router changes the trainer's router
every step; an adapter-only sync cannot carry it to vLLM, whose MoE runner calls the gate module it
was built with (vllm 0.32 fused_moe/runner/moe_runner.py holds `self.gate`, while its LoRA loader
replaces the module on the parent, lora/utils.py `replace_submodule`: read, not run). The engine would
keep routing and weighting with the base router while the trainer's weights drift: a growing
engine/trainer mismatch that replay cannot remove. Routers are also small and the most sensitive part
of an MoE to RL updates (full fine-tuning here updates them with the recipe's Muon step). A recipe can
still turn them on for families whose router input is an ordinary Linear (Qwen3-MoE's gate, MoE++'s
router down-projection); GLM-4.5's router reads its weight itself (fp32 grouped top-k) and takes none.

Importing this package imports torch (zrl.modeling itself does not).
"""

from zrl.modeling.lora.apply import (adapted_modules, adapter_parameters, apply_lora, initial_adapter_state,
                                     is_adapter, reset_adapters, target_patterns)
from zrl.modeling.lora.layers import LoRALinear, LoRASwiGLUExperts
from zrl.modeling.lora.merge import merge_weight, merged_state_dict, merged_tensors
from zrl.modeling.lora.peft_format import (load_peft_adapter, peft_adapter, read_peft_config, save_peft_adapter,
                                           write_peft_adapter)

__all__ = ["LoRALinear", "LoRASwiGLUExperts", "adapted_modules", "adapter_parameters", "apply_lora",
           "initial_adapter_state", "is_adapter", "load_peft_adapter", "merge_weight", "merged_state_dict",
           "merged_tensors", "peft_adapter", "read_peft_config", "reset_adapters", "save_peft_adapter",
           "target_patterns", "write_peft_adapter"]
