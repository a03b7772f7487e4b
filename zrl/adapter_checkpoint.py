"""A PEFT LoRA adapter directory together with its base, as one Hugging Face checkpoint (`zrl eval` and `zrl ttc`
with `--adapter`).

The adapter directory is read with peft's own `LoraConfig` (rank, alpha, the base it names as
`base_model_name_or_path`: a run's `stages/<name>/adapter` names the checkpoint its trainer was built on).
The base is that checkpoint unless the caller names one. The merge is zrl's (zrl.modeling.lora): the base is
loaded in fp32 and adapted on every target its family declares; the directory's adapters are copied in and
the ones it lacks keep B = 0, which leaves their weights exactly as the base has them; the export writes
W + (alpha / r) B A tensor by tensor in the base's layout (zrl.trainer.export.export_hf_checkpoint), with
the base's tokenizer files. Plain LoRA only: rsLoRA and DoRA scale or decompose differently and are refused.

Every problem with the input is one line naming the option (AdapterError, or zrl.hub.ModelPathError for a
base that cannot be had); nothing is written then.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("zrl")

ADAPTER_OPTION = "--adapter"


class AdapterError(ValueError):
    """An adapter directory, or a base, that cannot be merged (one line, naming the option)."""


def adapter_base(adapter: str | Path) -> str | None:
    """The base checkpoint the adapter directory names (`base_model_name_or_path`), None when it names none."""
    return _config(adapter).base_model_name_or_path or None


def _config(adapter: str | Path):
    from peft import LoraConfig

    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise AdapterError(f"{ADAPTER_OPTION}: {adapter}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        config = LoraConfig.from_pretrained(str(adapter))
    except (TypeError, ValueError) as exc:  # another PEFT type, or fields LoraConfig rejects
        raise AdapterError(f"{ADAPTER_OPTION}: {adapter}: not a LoRA adapter_config.json ({exc})") from None
    if config.peft_type.value != "LORA":
        raise AdapterError(f"{ADAPTER_OPTION}: {adapter}: peft_type {config.peft_type.value}, not LORA")
    for field in ("use_rslora", "use_dora"):
        if getattr(config, field):
            raise AdapterError(f"{ADAPTER_OPTION}: {adapter}: {field} is true; zrl merges plain LoRA "
                               "(W + lora_alpha / r * B A) only")
    return config


def merge_adapter(adapter: str | Path, base: str | Path, out: str | Path) -> Path:
    """Write the base checkpoint directory `base` with the adapters of PEFT directory `adapter` merged in as
    a Hugging Face checkpoint directory `out` (new or empty); returns `out`."""
    import torch

    from zrl.config.lora import LoRASpec, LoRATargets
    from zrl.modeling.lora import apply_lora, load_peft_adapter
    from zrl.models import family_of_checkpoint
    from zrl.trainer.export import export_hf_checkpoint

    config = _config(adapter)
    family = family_of_checkpoint(base)
    targets = LoRATargets(attention=True, experts="per_expert", dense_mlp=True,
                          router=bool(family.lora_modules.router))
    try:
        spec = LoRASpec(rank=config.r, alpha=config.lora_alpha, targets=targets)
    except ValueError as exc:
        raise AdapterError(f"{ADAPTER_OPTION}: {adapter}: r={config.r}, lora_alpha={config.lora_alpha}: "
                           f"{exc.errors()[0]['msg'] if hasattr(exc, 'errors') else exc}") from None
    model = family.load_model(base, dtype=torch.float32)
    apply_lora(model, spec)
    try:
        load_peft_adapter(model, adapter, missing_ok=True)
    except ValueError as exc:  # adapters of another model: a key or a shape the base does not have
        raise AdapterError(f"{ADAPTER_OPTION}: {exc} (is {base} its base?)") from None
    export_hf_checkpoint(model, out, version=0, dtype=torch.float32, companion_dir=base)
    log.info("%s merged into %s (r=%d, lora_alpha=%g) in %s", adapter, base, config.r, config.lora_alpha, out)
    return Path(out)
