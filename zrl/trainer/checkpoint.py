"""Trainer checkpoints: torch.distributed.checkpoint (DCP) tensors plus one JSON of small state.

Layout of a checkpoint directory:
  DCP files (`.metadata`, `__<rank>_0.distcp`)   model parameters and buffers, AdamW moments
  trainer_state.json (written by rank 0)         step, the caller's data position, LR scheduler,
                                                 bias-balancer AdamW state, RNG, world size

Invariants:
- Resharding: tensors are saved by fully-qualified name with their DTensor placements, so a
  checkpoint saved on W ranks loads on any number of ranks (DCP reshards on load).
- The optimizer entry is written only once the optimizer has state: DCP's optimizer state-dict
  helper would otherwise run a zero-lr step to create the AdamW moments, advancing AdamW's step count
  before the first real step (the resumed run would then differ from an uninterrupted one).
- Muon parameters have no optimizer state at momentum 0, so loading uses `strict=False`
  (zrl/optim/README.md "Checkpoints").
- `data_state` is opaque to the trainer: any JSON-able dict (e.g. buffer / prompt-source position)
  comes back unchanged from `load_checkpoint`.
- The JSON file is written after the DCP files (then all ranks meet at a barrier), so a directory
  with trainer_state.json holds a complete checkpoint.
- The model's weights alone load in one process without a process group (`load_model_weights`, for
  `zrl export`): DCP reads them into a plain module whatever the number of ranks that saved them.
- Frozen parameters (the base under LoRA, zrl.modeling.lora) are not saved: they are the run's
  `model.path`, unchanged. A checkpoint of a LoRA run holds the adapters, their optimizer state and the
  buffers; loading checks that whatever it does not hold is frozen in the model it loads into.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:  # the router-bias controller of a model family that has one (ModelFamily.bias_balancer)
    from zrl.models.family import BiasController

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
# The model entry: trained parameters and buffers; frozen parameters (a LoRA run's base) are the model path's.
_TRAINED = StateDictOptions(ignore_frozen_params=True)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TrainerState:
    step: int
    data_state: dict[str, Any]
    world_size: int  # of the run that saved it


def save_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, bias_balancer: BiasController | None,
                    step: int, data_state: dict[str, Any] | None = None) -> None:
    """Collective: every rank calls it with the same path."""
    path = Path(path)
    data_state = dict(data_state or {})
    _check_json(data_state)
    has_optimizer_state = bool(optimizer.state)
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=_TRAINED)}
    if has_optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        meta = {
            "format": FORMAT_VERSION, "step": step, "data_state": data_state, "world_size": dist.get_world_size(),
            "has_optimizer_state": has_optimizer_state, "scheduler": scheduler.state_dict(),
            "bias_balancer": None if bias_balancer is None else _bias_balancer_state(bias_balancer),
            "rng": {"torch": torch.get_rng_state().tolist(),
                    "cuda": torch.cuda.get_rng_state().tolist() if torch.cuda.is_available() else None},
        }
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(path / STATE_FILE)
    dist.barrier()
    logger.info("saved trainer checkpoint at step %d to %s", step, path)


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler,
                    bias_balancer: BiasController | None) -> TrainerState:
    """Collective: restore everything `save_checkpoint` wrote, on any number of ranks."""
    path = Path(path)
    meta = read_trainer_state(path)
    state: dict[str, Any] = {"model": get_model_state_dict(model, options=_TRAINED)}
    if meta["has_optimizer_state"]:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    _set_trained_state(model, state["model"])
    if meta["has_optimizer_state"]:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))
    scheduler.load_state_dict(meta["scheduler"])
    if (meta["bias_balancer"] is None) != (bias_balancer is None):
        raise ValueError("the checkpoint and this trainer disagree on router bias balancing "
                         f"(saved: {meta['bias_balancer'] is not None}, now: {bias_balancer is not None})")
    if bias_balancer is not None:
        _load_bias_balancer_state(bias_balancer, meta["bias_balancer"])
    torch.set_rng_state(torch.tensor(meta["rng"]["torch"], dtype=torch.uint8))
    if meta["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(meta["rng"]["cuda"], dtype=torch.uint8))
    logger.info("loaded trainer checkpoint of step %d (saved on %d ranks) from %s", meta["step"],
                meta["world_size"], path)
    return TrainerState(step=meta["step"], data_state=meta["data_state"], world_size=meta["world_size"])


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer_state.json of the complete checkpoint `path`; FileNotFoundError or ValueError (one line)
    for a directory that is none, or one of another format."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete trainer checkpoint (no {STATE_FILE})")
    meta = json.loads(state_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{state_file}: checkpoint format {meta.get('format')}, this trainer reads {FORMAT_VERSION}")
    return meta


def load_model_weights(path: str | Path, model: torch.nn.Module) -> int:
    """Load the model entry of checkpoint `path` into `model`, a plain (unsharded) module of the same
    architecture, in this process alone (no process group needed); returns the checkpoint's step."""
    meta = read_trainer_state(path)
    state = {"model": get_model_state_dict(model, options=_TRAINED)}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the point here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    _set_trained_state(model, state["model"])
    return meta["step"]


def _set_trained_state(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a state dict of the trained parameters and buffers (`_TRAINED`); every key it lacks must be a
    frozen parameter of `model`."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    result = set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    missing = set(result.missing_keys) - frozen
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint and model disagree: missing {sorted(missing)[:3]}, unexpected "
                         f"{sorted(result.unexpected_keys)[:3]}")


def _check_json(data_state: dict[str, Any]) -> None:
    try:
        json.dumps(data_state)
    except TypeError as exc:
        raise ValueError(f"data_state must be JSON-serialisable: {exc}") from None


def _bias_balancer_state(balancer: BiasController) -> dict[str, Any]:
    """The balancer's AdamW moments as lists (float32 values are exact in JSON's float64)."""
    sd = balancer.optimizer.state_dict()
    return {"state": {str(i): {k: v.tolist() for k, v in s.items()} for i, s in sd["state"].items()},
            "param_groups": sd["param_groups"]}


def _load_bias_balancer_state(balancer: BiasController, saved: dict[str, Any]) -> None:
    device = balancer.biases[0].device
    state = {int(i): {k: torch.tensor(v, dtype=torch.float32, device="cpu" if k == "step" else device)
                      for k, v in s.items()} for i, s in saved["state"].items()}
    balancer.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
