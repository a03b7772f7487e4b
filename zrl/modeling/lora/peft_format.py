"""The adapters as a PEFT adapter directory: `adapter_config.json` + `adapter_model.safetensors`.

Keys are PEFT's for a LoRA on a module of the Hugging Face model: `base_model.model.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r], `<module>` the family's HF key of the module's weight without
`.weight` (zrl.modeling.hf_names). Experts are written one module per expert and projection, as a
checkpoint with per-expert matrices names them (what vLLM's LoRA loader reads for MoE layers):
`<experts>.<e>.gate_proj`, `.up_proj`, `.down_proj`. The fused gate/up adapter maps exactly onto the two:
they share the input, so both get expert e's A and B's gate rows [0, F) or up rows [F, 2F). A shared A
is written into every expert (PEFT has no shared form); reading it back into a shared-A model checks
that the copies are equal. Adapters are stored in fp32, their training dtype.

`load_peft_adapter` reads such a directory into a model adapted the same way (rank and alpha must
agree, every adapter must be present and nothing else).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from zrl.modeling.lora.apply import adapted_modules
from zrl.modeling.lora.layers import ADAPTER_DTYPE, LoRALinear
from zrl.models import family_of

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."

Full = Callable[[torch.Tensor], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


def _module_key(hf_weight_key: str) -> str:
    return _PREFIX + hf_weight_key.removesuffix(".weight")


def _peft_slots(model: nn.Module) -> Iterator[tuple[str, str, str, Callable]]:
    """(PEFT module key, module name, adapter attribute, read) per written matrix pair: `read(A, B)` gives
    that key's (A, B) from the module's full adapter tensors."""
    names = family_of(model).hf_names
    for name, module in adapted_modules(model):
        if isinstance(module, LoRALinear):
            yield _module_key(names.hf_key(f"{name}.weight")), name, "", lambda a, b: (a, b)
            continue
        experts_key = names.hf_key(name)
        f = module.down_proj.shape[2]
        for e in range(module.num_experts):
            ai = 0 if module.shared_a else e
            base = f"{_PREFIX}{experts_key}.{e}"
            yield (f"{base}.gate_proj", name, "gate_up_proj",
                   lambda a, b, e=e, ai=ai: (a[ai], b[e, :f]))
            yield (f"{base}.up_proj", name, "gate_up_proj",
                   lambda a, b, e=e, ai=ai: (a[ai], b[e, f:]))
            yield (f"{base}.down_proj", name, "down_proj",
                   lambda a, b, e=e, ai=ai: (a[ai], b[e]))


def _adapter_pair(module: nn.Module, attr: str) -> tuple[nn.Parameter, nn.Parameter]:
    if attr:
        return getattr(module, f"{attr}_lora_A"), getattr(module, f"{attr}_lora_B")
    return module.lora_A, module.lora_B


def _settings(model: nn.Module) -> tuple[int, float, float]:
    """(rank, alpha, dropout) shared by every adapted module."""
    found = {(m.rank, m.scale * m.rank, m.dropout) for _, m in adapted_modules(model)}
    if len(found) != 1:
        raise ValueError(f"adapters differ in (rank, alpha, dropout) or are absent: {sorted(found)}")
    return found.pop()


@torch.no_grad()
def peft_adapter(model: nn.Module, *, base_model: str | None = None,
                 full: Full = _local) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT key -> CPU fp32 tensor, adapter_config.json's content) of `model`'s adapters; collective when
    `full` is (a module's adapters are gathered once, held until the next module's come)."""
    rank, alpha, dropout = _settings(model)
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    gathered: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for key, name, attr, read in _peft_slots(model):
        if (name, attr) not in gathered:
            if any(held != name for held, _ in gathered):
                gathered.clear()  # one module's adapters at a time
            a, b = _adapter_pair(model.get_submodule(name), attr)
            gathered[(name, attr)] = (full(a).to("cpu", ADAPTER_DTYPE), full(b).to("cpu", ADAPTER_DTYPE))
        a, b = read(*gathered[(name, attr)])
        tensors[f"{key}.lora_A.weight"] = a.clone()  # own storage: a shared A is written per expert
        tensors[f"{key}.lora_B.weight"] = b.clone()
        targets.add(key.rsplit(".", 1)[1])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    return tensors, config


def write_peft_adapter(tensors: dict[str, torch.Tensor], config: dict, path: str | Path) -> Path:
    """Write `peft_adapter`'s result as directory `path` (created)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def save_peft_adapter(model: nn.Module, path: str | Path, *, base_model: str | None = None) -> Path:
    """Write the adapters of an unsharded `model` as a PEFT directory `path`."""
    return write_peft_adapter(*peft_adapter(model, base_model=base_model), path)


def read_peft_config(path: str | Path) -> dict:
    config = json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, not LORA")
    return config


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str | Path, *, missing_ok: bool = False) -> None:
    """Copy the adapters of PEFT directory `path` into `model` (adapted with the same targets, rank, alpha).
    With `missing_ok`, `model` may have more adapters than `path` holds: those keep their values (B = 0 after
    `apply_lora`: no change to the base), so a model adapted on every target reads any subset of them."""
    path = Path(path)
    config = read_peft_config(path)
    rank, alpha, _ = _settings(model)
    if (config["r"], float(config["lora_alpha"])) != (rank, float(alpha)):
        raise ValueError(f"{path}: r={config['r']}, lora_alpha={config['lora_alpha']}; the model's adapters have "
                         f"r={rank}, alpha={alpha}")
    with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}
    expected = set()
    shared_a: dict[tuple[str, str], torch.Tensor] = {}
    for key, name, attr, read in _peft_slots(model):
        module = model.get_submodule(name)
        a_param, b_param = _adapter_pair(module, attr)
        a_view, b_view = read(a_param.data, b_param.data)
        a_key, b_key = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
        expected.update((a_key, b_key))
        if missing_ok and a_key not in stored and b_key not in stored:
            continue
        for k, view in ((a_key, a_view), (b_key, b_view)):
            if k not in stored:
                raise ValueError(f"{path}: no {k}")
            if tuple(stored[k].shape) != tuple(view.shape):
                raise ValueError(f"{path}: {k} has shape {tuple(stored[k].shape)}, the model's {tuple(view.shape)}")
        if attr and module.shared_a:
            first = shared_a.setdefault((name, attr), stored[a_key])
            if not torch.equal(first, stored[a_key]):
                raise ValueError(f"{path}: {a_key} differs from expert 0's A, but {name} shares one A")
        a_view.copy_(stored[a_key])
        b_view.copy_(stored[b_key])
    unexpected = sorted(set(stored) - expected)
    if unexpected:
        raise ValueError(f"{path}: {len(unexpected)} tensors match no adapter of the model, e.g. {unexpected[0]}")
