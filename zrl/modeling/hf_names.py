"""A family's Hugging Face names, declared once: how each parameter of its model is keyed in an HF
checkpoint. The loader, the export, weight sync and the rollout engine's list of a complete update's
keys are all derived from it (hf_io.py, zrl.models.ModelFamily).

The rules, in order:
- the LM head `lm_head.weight` keeps its name; a tied head (config `tie_word_embeddings`) is not
  stored, and a checkpoint that stores it anyway must hold the embedding there;
- fused expert tensors `<...>.experts.gate_up_proj` [E, 2F, D] (gate rows, then up rows) and
  `<...>.experts.down_proj` [E, D, F] are stored as they are, or, with `per_expert`, one matrix per
  expert: `<...>.experts.<e>.gate_proj.weight` [F, D], `up_proj.weight` [F, D], `down_proj.weight` [D, F]
  (a checkpoint in the fused layout still loads);
- every other parameter or buffer is `prefix + name`;
- tensors whose name ends with one of `fp32` stay fp32 whatever dtype the weights load or export in;
- with `layers_beyond_config_unused`, checkpoint tensors of decoder layers past the config's last
  (`<prefix>layers.<i>.*` with i >= the model's layer count: modules the family does not run, such as
  multi-token-prediction layers stored after the decoder) are skipped on load and never written.

Importing this module imports no torch (families declare their names at class level).
"""

from __future__ import annotations

import dataclasses
import re

_FUSED = re.compile(r"^(.+\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class HFNames:
    model_type: str  # config.json's, for messages
    prefix: str = "model."
    lm_head: str = "lm_head.weight"
    per_expert: bool = False
    fp32: tuple[str, ...] = ()
    layers_beyond_config_unused: bool = False

    def hf_key(self, name: str) -> str:
        """A state-dict name (not a fused expert tensor under `per_expert`) -> its HF key."""
        return name if name == self.lm_head else self.prefix + name

    def param_name(self, key: str) -> str:
        """An HF key -> the state-dict name (a per-expert key gives the per-expert name, see `expert_part`)."""
        if key == self.lm_head:
            return key
        if not key.startswith(self.prefix):
            raise KeyError(f"unexpected checkpoint key {key!r} ({self.model_type} keys start with {self.prefix!r} "
                           f"or are {self.lm_head!r})")
        return key[len(self.prefix):]

    def expert_part(self, name: str) -> tuple[str, int, str] | None:
        """(experts module name, expert, projection) of a per-expert name, else None."""
        match = _PER_EXPERT.match(name) if self.per_expert else None
        return None if match is None else (match.group(1), int(match.group(2)), match.group(3))

    def unused(self, name: str, num_layers: int) -> bool:
        """Whether state-dict name `name` of a checkpoint belongs to a layer past the model's `num_layers`
        that the family declares unused (skipped on load)."""
        match = _LAYER.match(name) if self.layers_beyond_config_unused else None
        return match is not None and int(match.group(1)) >= num_layers

    def keeps_fp32(self, name: str) -> bool:
        return name.endswith(self.fp32) if self.fp32 else False

    def hf_tensors(self, name: str, tensor) -> list[tuple[str, object]]:
        """One tensor of the state dict -> its HF key(s) and tensor(s), views of `tensor` (same device)."""
        match = _FUSED.match(name) if self.per_expert else None
        if match is None:
            return [(self.hf_key(name), tensor)]
        prefix, fused = self.hf_key(match.group(1)), match.group(2)
        out = []
        for expert, matrix in enumerate(tensor):
            if fused == "down_proj":  # [D, F]
                out.append((f"{prefix}.{expert}.down_proj.weight", matrix))
            else:  # [2F, D]: gate rows, then up rows
                gate, up = matrix.chunk(2, dim=0)
                out += [(f"{prefix}.{expert}.gate_proj.weight", gate), (f"{prefix}.{expert}.up_proj.weight", up)]
        return out
