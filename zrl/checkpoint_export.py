"""`zrl export`: a trainer checkpoint (`<run>/checkpoints/step_N`) as a Hugging Face checkpoint directory,
the same as a stage's export (`<run>/stages/<name>/hf`).

A trainer checkpoint holds tensors (torch.distributed.checkpoint) and the trainer's state, no config and
no tokenizer: those come from the model the run started from, `model.path` (and `revision`) of the run's
recipe.resolved.yaml two directories up (zrl/run_dir.py), or from `model_path` when given. The family's
module is built on the meta device, the checkpoint's weights load into it in this process, without Ray or
a process group (zrl.trainer.checkpoint.load_model_weights), and the stage's own writer exports it
(zrl.trainer.export.export_hf_checkpoint: config.json, safetensors, the model directory's tokenizer
files), in the run's `model.dtype` unless `dtype` is given. A stage that trains `model.lora`'s adapters
checkpoints only them: the model is adapted as the trainer adapted it, its base read from the model
directory (or, after a stage that trained every weight, from that stage's export), and the export has the
adapters merged in (the base's layout).

Invariants: nothing is written unless the checkpoint is complete and its model is found; `out` is new or
empty. Every problem with the input is one line: an ExportError, or zrl.hub.ModelPathError for a model
path that cannot be had.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

from zrl.config import RecipeError, load_recipe
from zrl.config.schema import ModelSpec, Recipe
from zrl.run_dir import RunDir

log = logging.getLogger("zrl")


class ExportError(ValueError):
    """A checkpoint, a run or an output directory that cannot be exported from or to (one line)."""


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, model_path: str | None = None,
                      dtype: str | None = None) -> Path:
    """Write the trainer checkpoint `checkpoint` as a Hugging Face checkpoint directory `out`; returns `out`."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from zrl.assets import is_checkpoint_dir
    from zrl.hub import local_checkpoint
    from zrl.modeling.lora import adapter_parameters, apply_lora
    from zrl.models import family_of_checkpoint
    from zrl.trainer.checkpoint import load_model_weights, read_trainer_state
    from zrl.trainer.export import export_hf_checkpoint
    from zrl.trainer.settings import DTYPES

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint}: no such directory")
    try:
        step = read_trainer_state(checkpoint)["step"]
    except (OSError, ValueError) as exc:  # not a checkpoint, an unfinished one, another format
        raise ExportError(str(exc)) from None
    if not (checkpoint / ".metadata").is_file():
        raise ExportError(f"{checkpoint}: no .metadata, not a torch.distributed.checkpoint directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory")
    spec, field = model_of(checkpoint, model_path, step)
    model_dir = local_checkpoint(field, spec.path, spec.revision, is_checkpoint_dir,
                                 "model checkpoint directory (config.json and *.safetensors)")
    family = family_of_checkpoint(model_dir)
    with torch.device("meta"):
        model = family.build(family.read_config(model_dir))
        if spec.lora is not None:
            apply_lora(model, spec.lora)
    model.to_empty(device="cpu")
    if spec.lora is not None:  # the checkpoint holds the adapters; the frozen base is the model's own
        missing = model.load_state_dict(family.load_state_dict(model_dir, dtype=torch.float32), strict=False)
        if set(missing.missing_keys) - set(adapter_parameters(model)) or missing.unexpected_keys:
            raise ExportError(f"{model_dir}: not the base of {checkpoint} ({missing})")
    try:
        load_model_weights(checkpoint, model)
    except CheckpointException as exc:  # another model's checkpoint: DCP names a key or shape that differs
        reason = (str(exc).strip().splitlines() or ["CheckpointException"])[-1]  # the last line of its traceback
        raise ExportError(f"{checkpoint}: does not hold the weights of {model_dir} ({reason})") from None
    export_dtype = dtype or spec.dtype
    export_hf_checkpoint(model, out, version=step, dtype=DTYPES[export_dtype], companion_dir=model_dir)
    log.info("trainer step %d of %s exported to %s (%s, model and tokenizer of %s)", step, checkpoint, out,
             export_dtype, model_dir)
    return out


def model_of(checkpoint: Path, model_path: str | None, step: int | None = None) -> tuple[ModelSpec, str]:
    """The model the checkpoint's trainer was built on and the field that names it (for messages): `model_path`,
    else `model` of the run's recipe.resolved.yaml (`<run>/checkpoints/step_N`: two directories up), as the
    stage holding trainer step `step` trained it (`_as_trained_in_stage`)."""
    run = RunDir(checkpoint.resolve().parent.parent)
    resolved = run.resolved_recipe
    recorded, field = None, f"{resolved}: model.path"
    if resolved.is_file():
        raw = yaml.safe_load(resolved.read_text())
        recorded = ModelSpec.model_validate(raw["model"]) if isinstance(raw, dict) and "model" in raw else None
        if recorded is not None and step is not None and raw.get("stages"):
            try:
                recipe = load_recipe(resolved)
            except RecipeError as exc:
                raise ExportError(f"{resolved}: {exc.lines[0]}") from None
            recorded, field = _as_trained_in_stage(recipe, recorded, field, run, step)
    if model_path is not None:
        recorded_fields = {"dtype": recorded.dtype, "lora": recorded.lora} if recorded else {}
        return ModelSpec(path=model_path, **recorded_fields), "--model"
    if recorded is None:
        raise ExportError(f"{checkpoint}: no run's {resolved.name} at {resolved} to name the model; give --model")
    return recorded, field


def _as_trained_in_stage(recipe: Recipe, spec: ModelSpec, field: str, run: RunDir, step: int) -> tuple[ModelSpec, str]:
    """`spec` as the stage that trains step `step` used it: adapters or not (the stage's `lora`), and its base,
    which after a switch between full fine-tuning and adapters is the export of the stage before the switch
    (Recipe.trainer_base), `<run>/stages/<name>/hf`."""
    index = recipe.stage_of_step(step)
    if index is None:
        return spec, field
    spec = spec.model_copy(update={"lora": recipe.stage_lora(index)})
    base = recipe.trainer_base(index)
    if base is None:
        return spec, field
    return (spec.model_copy(update={"path": str(run.stage_hf(base))}),
            f"the export of stage {base!r}, the base of stage {recipe.stages[index].name!r}")
