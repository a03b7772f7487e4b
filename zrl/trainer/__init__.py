"""The FSDP2 trainer worker: one rank of the trainer pool as a plain class (a Ray actor hosts it).

Public API (see worker.py for the step, checkpoint and export semantics):
  Rendezvous(master_addr, master_port, rank, world_size, backend=None)   where a rank joins the pool
  TrainerSettings(...) / TrainerSettings.from_stage(stage, token_budget=...)   objective and knobs
  TrainerWorker(rendezvous, model_path, settings)
    .train_step(batch: TrainBatch) -> dict[str, float]       metrics named `panel/name`
    .sft_step(examples: Sequence[SFTExample]) -> dict[str, float]
    .save_checkpoint(dir, data_state) / .load_checkpoint(dir) -> data_state
    .export_weights(dtype, bucket_bytes) -> Iterator[WeightBucket]   (version-stamped, HF key names)
    .export_hf(dir, dtype) / .start_stage(settings, keep_optimizer_state=) / .shutdown()
    .weights_synced()   a weight sync sent the current weights (onpolicy.py scores their tokens later)
  SFTExample(prompt_ids, token_ids, loss_mask=None); WeightBucket(version, index, tensors, last)
  plan_microbatches / PackingPlan: the token-budget packing plan (pure; no torch import)
Names are exported lazily so `zrl.trainer.packing` stays importable without torch.
"""

from zrl.lazy_exports import module_getattr

_EXPORTS = {
    "PackingPlan": "packing", "plan_microbatches": "packing",
    "Microbatch": "batch", "SFTExample": "batch",
    "Rendezvous": "distributed",
    "WeightBucket": "export",
    "TrainerSettings": "settings",
    "TrainerWorker": "worker",
}

__all__ = sorted(_EXPORTS)

__getattr__ = module_getattr(__name__, _EXPORTS)
