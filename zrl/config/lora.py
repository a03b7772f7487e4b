"""The recipe's `model.lora` block: low-rank adapters on a frozen base (zrl/modeling/lora)."""

from typing import Literal

from pydantic import Field, model_validator

from zrl.config.base import Strict


class LoRATargets(Strict):
    """Which of the policy's weights get low-rank adapters (each family declares its modules of each kind:
    `ModelFamily.lora_modules`, zrl/models/family.py)."""

    attention: bool = Field(True, description="the attention projections (q, k, v, o; MoE++: q, k, both value "
                                              "halves, o)")
    experts: Literal["per_expert", "shared_a"] | None = Field(
        "per_expert", description="the routed experts' gate/up and down projections: per_expert = an A [r, in] and "
                                  "a B [out, r] per expert; shared_a = one A per projection shared by all experts, "
                                  "a B per expert; null = none")
    dense_mlp: bool = Field(True, description="the dense SwiGLU MLPs (dense layers' MLPs and GLM-4.5's shared "
                                              "experts); a family without any adapts nothing here")
    router: bool = Field(
        False, description="the router's input projection (Qwen3-MoE's gate, MoE++'s router down-projection; "
                           "GLM-4.5's router has none an adapter can wrap). Off by default: the engine records "
                           "the experts it picks with its own router and the trainer replays them, weighted by "
                           "its router; vLLM's LoRA does not reach the router (its MoE runner calls the gate "
                           "module it was built with), so an adapted router separates trainer and engine "
                           "probabilities step by step (zrl/modeling/lora/__init__.py)")


class LoRASpec(Strict):
    """Low-rank adapters on a frozen base: W x + (alpha / rank) B A dropout(x), B = 0 at the start. The base
    stays in `model.dtype`, the adapters are fp32 masters (zrl/modeling/lora)."""

    rank: int = Field(16, ge=1, description="r, the adapters' inner dimension")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on an adapter's input (training only)")
    targets: LoRATargets = LoRATargets()
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="what steps the adapters: AdamW (the stage's optimizer.adamw, its lr defaulting to "
                             "optimizer.muon.lr) or Muon on each adapter matrix (the stage's optimizer.muon); the "
                             "default is the measured better on the tiny recipe (zrl/trainer/worker.py)")

    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto", description="how the weights reach the rollout engines: adapter = the adapters alone, loaded by "
                            "vLLM's LoRA under one name per policy version; merged = full weights with the "
                            "adapters merged tensor by tensor; auto = adapter where vLLM serves it for the model "
                            "and device, else merged (the choice and its reason are logged, serving/lora_sync.py)")

    @model_validator(mode="after")
    def _something_to_adapt(self):
        t = self.targets
        if not (t.attention or t.experts or t.dense_mlp or t.router):
            raise ValueError("targets: every target is off, so nothing would train; turn one on or drop `lora`")
        return self

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
