"""How a LoRA run's weights reach the rollout engines: adapter-only or merged, chosen once per run.

Two ways (docs/design.md, weight sync):
- `adapter`: only the adapters travel (a PEFT adapter, zrl.modeling.lora.peft_format); each engine loads
  them with vLLM's LoRA support under a per-version name (`AdapterVersions`: LoRARequest name
  `policy-v<version>`, id version + 1), and every request keeps the adapter of the version it was
  submitted under until it ends. Its routing is what that adapter's forwards chose (the capture records
  per request), and its prefix-cache salt names the same version, so a prefix computed under one adapter
  never serves another.
- `merged`: the full-weight path (zrl.pipeline.weight_sync), the adapters merged into their base tensors
  one tensor at a time on the trainer (zrl.modeling.lora.merge: each base tensor and its adapters gathered
  alone, never the whole model) and loaded in place like any full sync.

`choose_weight_sync` picks `adapter` only where vLLM can serve the adapters for that model and device, and
says why not otherwise. What rules it out:
- the router has adapters: vLLM's MoE runner calls the gate module it was built with, so its LoRA does not
  reach the router (zrl/modeling/lora/__init__.py);
- the trainer's base is not the checkpoint the engines loaded (a LoRA stage after a full fine-tuning
  stage trains adapters on that stage's export);
- the engines run on CPU (checked before the next, which imports vLLM). vLLM 0.32, with LoRA enabled on any
  fused-MoE model, selects the Triton MoE backend for every forward, adapters on the experts or not
  (fused_moe/oracle/unquantized.py, `select_unquantized_moe_backend`), and the CPU build has no Triton: the
  first forward fails with
  "AttributeError: module 'triton.language' has no attribute 'float32'" (fused_moe/experts/triton_moe.py;
  measured with the tiny Qwen3-MoE, attention-only adapters, `lora_target_modules` the four projections).
  Its CPU punica wrapper also lacks `add_lora_fused_moe` (lora/punica_wrapper/punica_base.py raises
  NotImplementedError), so expert adapters could not be served there even with another MoE backend;
- vLLM's model class for the architecture does not declare SupportsLoRA (MoE++'s `ZayaForCausalLM`; vLLM's
  Qwen3MoeForCausalLM and Glm4MoeForCausalLM do).
A recipe can force either way (`model.lora.sync`); forcing `adapter` where it is ruled out is refused
with the reason.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from zrl.config.lora import LoRASpec

SyncMode = Literal["full", "merged", "adapter"]

CPU_REASON = ("vLLM 0.32 runs every fused-MoE forward of a LoRA-enabled engine with its Triton MoE backend, "
              "which the CPU build lacks (AttributeError: module 'triton.language' has no attribute 'float32')")
# vLLM's allowed max_lora_rank values (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclasses.dataclass(frozen=True)
class SyncChoice:
    """How the run's weights reach the engines, and why."""

    mode: SyncMode
    reason: str

    def line(self) -> str:
        return f"weight sync sends {self._what()}: {self.reason}"

    def _what(self) -> str:
        return {"full": "full weights", "merged": "merged weights (adapters merged tensor by tensor)",
                "adapter": "the adapters only (vLLM LoRA, one adapter per policy version)"}[self.mode]


def vllm_supports_lora(architecture: str) -> bool:
    """Whether vLLM's model class for `architecture` declares SupportsLoRA (zrl's own vLLM models registered)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    from serving.plugin import register

    register()
    model = ModelRegistry.models.get(architecture)
    return model is not None and supports_lora(model.load_model_cls())


def adapter_sync_obstacle(model_type: str, lora: LoRASpec, *, rollout_on_gpu: bool,
                          base_is_served: bool = True) -> str | None:
    """Why the adapters alone cannot be served for this run (None: they can)."""
    from zrl.models import get_family

    if lora.targets.router:
        return "the router has adapters, and vLLM's LoRA does not reach an MoE router (it calls its own gate)"
    if not base_is_served:
        return "the trainer's base is an earlier stage's export, not the checkpoint the engines serve"
    if not rollout_on_gpu:  # first: it needs no vLLM import (the driver of a CPU run never loads vLLM)
        return CPU_REASON
    architecture = get_family(model_type).vllm_architecture
    if not vllm_supports_lora(architecture):
        return f"vLLM's {architecture} does not declare SupportsLoRA"
    return None


def choose_weight_sync(model_type: str, lora: LoRASpec | None, *, rollout_on_gpu: bool,
                       base_is_served: bool = True) -> SyncChoice:
    """The run's weight-sync mode: `full` without adapters; with them, `lora.sync` (auto: adapter-only
    where vLLM serves it for this model and device, else merged). Raises ValueError when the recipe
    forces `adapter` where it cannot run."""
    if lora is None:
        return SyncChoice("full", "the policy has no adapters")
    requested = lora.sync
    if requested == "merged":
        return SyncChoice("merged", "model.lora.sync: merged")
    obstacle = adapter_sync_obstacle(model_type, lora, rollout_on_gpu=rollout_on_gpu, base_is_served=base_is_served)
    if obstacle is None:
        return SyncChoice("adapter", f"vLLM serves {model_type} adapters on this device "
                                     f"(model.lora.sync: {requested})")
    if requested == "adapter":
        raise ValueError(f"model.lora.sync: adapter, but {obstacle}; use merged or auto")
    return SyncChoice("merged", obstacle)


def vllm_target_modules(model_type: str, lora: LoRASpec) -> list[str]:
    """The module names vLLM's LoRA wraps for `lora`'s targets (its `lora_target_modules`): the last part of
    each declared module, `experts` for the routed experts (what the PEFT adapter's keys name)."""
    from zrl.models import get_family

    declared, targets = get_family(model_type).lora_modules, lora.targets
    patterns = ((declared.attention if targets.attention else ()) + (declared.dense_mlp if targets.dense_mlp else ())
                + (declared.router if targets.router else ()))
    names = {p.rsplit(".", 1)[-1] for p in patterns}
    if targets.experts and declared.experts:
        names.add("experts")
    return sorted(names)


def engine_lora_args(model_type: str, lora: LoRASpec, max_versions: int = 2) -> dict:
    """vLLM engine arguments that serve `lora`'s adapters: up to `max_versions` versions in one batch (the
    current one and the one before, whose requests finish under it)."""
    rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), None)
    if rank is None:
        raise ValueError(f"model.lora.rank {lora.rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=max_versions, max_cpu_loras=max_versions + 1,
                lora_target_modules=vllm_target_modules(model_type, lora))


class AdapterVersions:
    """The engine's adapters by policy version: which one new requests get, which in-flight requests still
    hold, which can be dropped.

    Version v's adapter is vLLM's LoRARequest(`policy-v<v>`, v + 1, its directory); before any adapter is
    loaded requests run on the base (B = 0 there: the same model). A request takes the current adapter at
    submit (`take`) and gives it back when it ends (`give_back`); an adapter that is neither current nor
    held is returned by `give_back` / `load` for the engine to remove, with its directory."""

    def __init__(self) -> None:
        self.current: int | None = None
        self._requests: dict[int, object] = {}  # version -> LoRARequest
        self._paths: dict[int, Path] = {}
        self._holders: dict[int, int] = {}      # version -> in-flight requests holding it

    def load(self, path: str | Path, version: int) -> tuple[object, list[int]]:
        """Make version `version`'s adapter (PEFT directory `path`) the current one; returns its LoRARequest
        and the versions now unused (to remove)."""
        from vllm.lora.request import LoRARequest

        if self.current is not None and version <= self.current:
            raise ValueError(f"adapter version {version} after version {self.current}: versions only grow")
        request = LoRARequest(lora_name=f"policy-v{version}", lora_int_id=version + 1, lora_path=str(path))
        previous, self.current = self.current, version
        self._requests[version], self._paths[version] = request, Path(path)
        return request, self._unused(previous)

    def load_base(self) -> list[int]:
        """New base weights were loaded in place (a merged export): new requests run on them without an
        adapter; returns the versions now unused (to remove)."""
        previous, self.current = self.current, None
        return self._unused(previous)

    def take(self) -> tuple[int | None, object | None]:
        """(version, LoRARequest) for a new request: the current adapter, held until `give_back`."""
        if self.current is None:
            return None, None
        self._holders[self.current] = self._holders.get(self.current, 0) + 1
        return self.current, self._requests[self.current]

    def give_back(self, version: int | None) -> list[int]:
        """A request holding `version` ended; returns the versions now unused (to remove)."""
        if version is None:
            return []
        self._holders[version] -= 1
        return self._unused(version)

    def request(self, version: int) -> object:
        return self._requests[version]

    def path(self, version: int) -> Path:
        return self._paths[version]

    def forget(self, version: int) -> None:
        self._requests.pop(version, None)
        self._paths.pop(version, None)

    def held(self) -> dict[int, int]:
        return {v: n for v, n in self._holders.items() if n > 0}

    def _unused(self, version: int | None) -> list[int]:
        if version is None or version == self.current or self._holders.get(version, 0) > 0:
            return []
        self._holders.pop(version, None)
        return [version] if version in self._requests else []
