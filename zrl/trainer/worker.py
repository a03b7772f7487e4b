"""TrainerWorker: one FSDP2 rank of the trainer pool, as a plain class (a Ray actor hosts it).

A plain class so it runs in-process in tests (docs/design.md, style rule 1).

One `train_step(share)`:
  1. the rank packs the rollouts of its own `RankShare` (the buffer split the released batch by the
     token-budget packing plan: equal microbatch counts on all ranks; a rank with nothing left runs a
     1-token no-loss microbatch so the FSDP2 collectives still match);
  2. per microbatch: forward with router replay -> trust-region loss over GLOBAL counts -> backward
     (gradients accumulate; FSDP2 reduce-scatters with SUM, see distributed.py), without waiting for
     the GPU: the step's one wait is at its end (phase times are CUDA events, statistics stay on the
     device until then);
  3. AdamW-only clipping, Muon + AdamW step, LR schedule, optional router-bias balancing on the
     all-reduced global expert counts;
  4. two all-reduces turn the per-rank statistics into the global batch's metrics.
Before 2., an RL step scores a sample of its tokens sampled by the previous synced version under a host
copy of those weights (`mismatch/onpolicy_*` on every step whatever the sync cadence; onpolicy.py), and
puts the current weights back bit for bit.
`version` = optimizer steps applied; a share must say its batch was pulled at this version.

Everything collective (steps, checkpoints, exports) must be called on every rank in the same order.
"""

from __future__ import annotations

import collections
import logging
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from zrl.models import family_of_checkpoint
from zrl.modeling import kernels
from zrl.modeling.lora import apply_lora, initial_adapter_state
from zrl.modeling.precision import fp32_without_tf32
from zrl.optim import MuonAdamW, lr_scheduler
from zrl.trainer import checkpoint as ckpt
from zrl.trainer.activations import OffloadSavedTensors, configure_checkpointing
from zrl.trainer.batch import SFTExample, pack_rollouts, pack_sft
from zrl.trainer.distributed import Rendezvous, build_mesh, device_of_backend, init_process_group, shard_model
from zrl.trainer.export import (DEFAULT_BUCKET_BYTES, WeightBucket, export_hf_checkpoint, export_peft_adapter,
                                iter_weight_buckets)
from zrl.trainer.loss import StepStats, forward_logprobs, rl_microbatch_loss, sft_microbatch_loss
from zrl.trainer.onpolicy import SyncedShards, onpolicy_sample
from zrl.trainer.settings import TrainerSettings
from zrl.trainer.packing import input_length, plan_rank, split_batch
from zrl.types import RankShare, TrainBatch

logger = logging.getLogger(__name__)


class PhaseClock:
    """Seconds spent per phase of a step (forward, backward, optimizer), summed over its laps.

    On CUDA a mark is an event recorded on the current stream, and the times are read once, by
    `seconds()` at the step's end: timing a phase by synchronising before and after it would stop
    the host from queueing work ahead of the GPU three times per microbatch. On the CPU ops run
    synchronously and a mark is the host clock.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._last = None
        self._laps: dict[str, list] = {}

    def _mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Start timing (what ran since the last lap belongs to no phase)."""
        self._last = self._mark()

    def lap(self, phase: str) -> None:
        """Add the time since the last mark to `phase`."""
        now = self._mark()
        self._laps.setdefault(phase, []).append((self._last, now))
        self._last = now

    def seconds(self) -> dict[str, float]:
        """Each phase's total; on CUDA waits for the last mark (the step's one wait for the GPU)."""
        if self._cuda and self._last is not None:
            self._last.synchronize()
        elapsed = ((lambda a, b: a.elapsed_time(b) / 1e3) if self._cuda else (lambda a, b: b - a))
        return collections.defaultdict(float, {phase: sum(elapsed(a, b) for a, b in laps)
                                               for phase, laps in self._laps.items()})


class TrainerWorker:
    def __init__(self, rendezvous: Rendezvous, model_path: str | Path, settings: TrainerSettings) -> None:
        self.rendezvous = rendezvous
        self.rank, self.world_size = rendezvous.rank, rendezvous.world_size
        self.model_path = Path(model_path)
        self.settings = settings
        self._owns_group = init_process_group(rendezvous)
        backend = dist.get_backend()
        self.device = device_of_backend(backend)
        self.mesh = build_mesh(self.device.type, self.world_size, settings.hsdp_replicas)
        self.family = family_of_checkpoint(self.model_path)  # the model contract (zrl/models)
        self.model = self._build_model()
        self.shape = self.family.shape(self.model.config)
        self.version = 0
        self.synced = SyncedShards()  # the previous synced version's weights, for mismatch/onpolicy_*
        self._build_optimizer()
        if settings.activation_offload and self.device.type == "cpu":
            logger.info("activation offload requested on CPU: nothing to offload to, running without it")

    # ------------------------------------------------------------------ set-up

    def _build_model(self) -> torch.nn.Module:
        """Build on the meta device, shard, then load the checkpoint: rank 0 reads it and broadcasts.

        With `settings.lora` the base is adapted on the meta device and kept in `param_dtype` (frozen: no
        fp32 master, no gradient, no optimizer state); rank 0 broadcasts the adapters' initial values
        (B = 0) with the base weights."""
        config = self.family.read_config(self.model_path)
        kernels.set_backend(self.settings.kernels)
        fp32_without_tf32()
        lora = self.settings.lora
        base_dtype = self.settings.torch_param_dtype if lora is not None else torch.float32
        with torch.device("meta"):
            model = self.family.build(config)
            if lora is not None:
                model.to(base_dtype)
                apply_lora(model, lora)
        configure_checkpointing(model, enabled=self.settings.activation_checkpointing,
                                every_layers=self.settings.activation_checkpointing_every_layers,
                                selective=self.settings.activation_checkpointing_selective)
        shard_model(model, self.mesh, self.settings.torch_param_dtype, units=self.family.fsdp_units(model))
        model.to_empty(device=self.device)
        full = {}
        if self.rank == 0:
            full = self.family.load_state_dict(self.model_path, dtype=base_dtype)
            if lora is not None:
                full.update(initial_adapter_state(model))
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return model

    def _build_optimizer(self) -> None:
        s = self.settings
        groups = self.family.optimizer_param_groups(self.model)  # trainable parameters only
        # Under LoRA only the adapters train, all of them AdamW's (zrl.modeling.params: they are no Linear
        # weight) unless model.lora.optimizer is muon; a group without parameters is left out (a checkpoint
        # would not record its tag). AdamW is the default, measured on recipes/tiny-lora-cpu.yaml (2026-11-28,
        # CPU, seeds 0-2, the same warm start 0.325/0.849/0.664 and 30 RL steps at the recipe's lr 5e-4;
        # bench/results/lora-recipe-seeds-cpu-2026-11-28.md): held-out accuracy AdamW 0.486/0.861/0.730 (+0.080
        # mean), Muon 0.404/0.856/0.704 (+0.042), higher with AdamW on 3 of 3 seeds. Muon's step is RMS 0.2 lr
        # per element, AdamW's early steps about lr: Muon at 5x the lr (2.5e-3) reached 0.484 on seed 0 (only
        # that seed ran), so Muon needs its own lr where AdamW keeps the full-fine-tuning one. Muon keeps no
        # optimizer state: 4.2 vs 6.5 trainer bytes per base parameter on the bf16 tiny MoE++ at rank 16
        # (bench/results/lora-memory-cpu-2026-11-28.md).
        names = ("hidden_matrices", "embed_norm_conv") if s.lora is None else ("adapters", "adapters")
        if s.lora is not None and s.lora.optimizer == "muon":  # each A [r, in] and B [out, r] (per expert)
            groups = {"muon": {**groups["muon"], **groups["adamw"]}, "adamw": {}}
        self.optimizer = MuonAdamW(
            [{"params": list(groups[tag].values()), "optimizer": tag, "name": name}
             for tag, name in zip(("muon", "adamw"), names) if groups[tag]],
            muon=s.muon_hyperparams(), adamw=s.adamw_hyperparams(), distributed_mode=s.muon_mode)
        self.scheduler = lr_scheduler(self.optimizer, warmup_steps=s.optimizer.warmup_steps,
                                      schedule=s.optimizer.schedule, total_steps=s.total_steps)
        self.bias_balancer = (self.family.bias_balancer(self.model, lr=s.bias_balancer_lr)
                              if s.algorithm.router_bias_update else None)

    def rebased(self, model_path: str | Path, settings: TrainerSettings) -> TrainerWorker:
        """A new worker in this one's process group with the model of `model_path` and `settings`, for a stage
        that switches between full fine-tuning and adapters (`settings.lora`), which `start_stage` cannot
        change: the model and optimizer are built anew (no optimizer state carries over), the step count
        (`version`) continues. This worker is spent: its model and optimizer are released first."""
        owns, version = self._owns_group, self.version
        self._owns_group = False
        del self.model, self.optimizer, self.scheduler
        self.synced.drop()
        worker = TrainerWorker(self.rendezvous, model_path, settings)
        worker._owns_group, worker.version = owns, version
        return worker

    def start_stage(self, settings: TrainerSettings, *, keep_optimizer_state: bool = False) -> None:
        """Next cascade stage on the same policy: new objective, optimizer hyperparameters and schedule.

        `keep_optimizer_state` carries the AdamW moments over (recipe `inherit.optimizer_state`).
        Sharding and memory settings cannot change without rebuilding the worker.
        """
        fixed = ("param_dtype", "kernels", "lora", "hsdp_replicas", "activation_checkpointing",
                 "activation_checkpointing_every_layers", "activation_checkpointing_selective")
        changed = [f for f in fixed if getattr(settings, f) != getattr(self.settings, f)]
        if changed:
            raise ValueError(f"{changed} cannot change between stages of one TrainerWorker")
        moments = self.optimizer.state_dict()["state"] if keep_optimizer_state else None
        self.settings = settings
        self.synced.drop()  # the stage's engines start from the current weights: no older version's tokens
        self._build_optimizer()
        if moments:
            sd = self.optimizer.state_dict()
            self.optimizer.load_state_dict({"state": moments, "param_groups": sd["param_groups"]})

    # ------------------------------------------------------------------ steps

    def train_step(self, share: RankShare) -> dict[str, float]:
        """One RL optimizer step; every rank passes its own share of the same released batch."""
        if share.trainer_step != self.version:
            raise ValueError(f"batch was pulled at trainer step {share.trainer_step}, the policy is at {self.version}")
        if share.rank != self.rank:
            raise ValueError(f"rank {self.rank} was given the share of rank {share.rank}")
        s, shape = self.settings, self.shape
        objective = s.objective()

        def pack(rollouts, advantages, indices):
            return pack_rollouts(rollouts, advantages, indices, num_layers=shape.num_layers,
                                 experts_per_token=shape.experts_per_token, replay=s.replay, device=self.device,
                                 num_experts=shape.num_experts, skip_class=shape.skip_class)

        def build(indices):
            return pack(share.rollouts, share.advantages, indices)

        def loss_fn(mb, stats):
            return rl_microbatch_loss(self.model, mb, objective, global_num_seqs=share.num_sequences,
                                      global_num_tokens=share.num_response_tokens, trainer_step=self.version,
                                      stats=stats, with_entropy=s.with_entropy, chunk_tokens=s.logprob_chunk_tokens)

        def score(stats, clock):
            self._score_onpolicy(share, pack, stats, clock)

        metrics = self._step("rl", [list(mb) for mb in share.microbatches], share.packing_stats, build, loss_fn,
                             before=score)
        metrics.update({"batch/num_sequences": float(share.num_sequences),
                        "batch/num_response_tokens": float(share.num_response_tokens),
                        "batch/max_staleness": float(share.max_staleness),
                        "batch/mean_staleness": share.mean_staleness,
                        "batch/advantage_abs_mean": share.advantage_abs_mean})
        return metrics

    def share_of(self, batch: TrainBatch) -> RankShare:
        """This rank's share of a whole batch, for callers that hold one (tests, benchmarks); the
        pipeline's buffer sends every rank its share instead."""
        return split_batch(batch, self.world_size, self.settings.token_budget)[self.rank]

    def sft_step(self, examples: Sequence[SFTExample]) -> dict[str, float]:
        """One supervised step: token-mean NLL of the response tokens over all ranks' examples."""
        if not examples:
            raise ValueError("sft_step needs at least one example")
        lengths = [input_length(len(e.prompt_ids), len(e.token_ids)) for e in examples]
        num_tokens = sum(e.num_trained_tokens for e in examples)  # a multi-turn example's replies are not targets

        def build(indices):
            return pack_sft(examples, indices, device=self.device)

        def loss_fn(mb, stats):
            return sft_microbatch_loss(self.model, mb, global_num_tokens=num_tokens, stats=stats,
                                       with_entropy=self.settings.with_entropy,
                                       chunk_tokens=self.settings.logprob_chunk_tokens)

        part = plan_rank(lengths, self.rank, self.world_size, self.settings.token_budget)
        metrics = self._step("sft", part.microbatches, part.plan.stats(), build, loss_fn)
        metrics.update({"batch/num_sequences": float(len(examples)), "batch/num_response_tokens": float(num_tokens)})
        return metrics

    def _step(self, kind: str, microbatches: list[list[int]], packing_stats, build, loss_fn,
              before=None) -> dict[str, float]:
        """Forward/backward over this rank's `microbatches` (indices for `build`; [] = a no-loss
        microbatch), then the optimizer step; `packing_stats` describe the whole batch's plan.
        `before(stats, clock)` runs ahead of the microbatches (the RL step's on-policy scoring)."""
        s = self.settings
        start = time.perf_counter()
        self._reset_peak_memory()
        stats = StepStats(kind, num_layers=self.shape.num_layers, num_classes=self.shape.count_classes,
                          device=self.device, with_entropy=s.with_entropy, replay=kind == "rl" and s.replay,
                          routing_metrics=self.family.routing_metrics)
        offload = OffloadSavedTensors() if s.activation_offload and self.device.type != "cpu" else None
        clock = PhaseClock(self.device)
        self.model.train()
        if before is not None:
            before(stats, clock)
        for indices in microbatches:
            with offload if offload is not None else nullcontext():
                self._microbatch(indices, build, loss_fn, stats, clock)
        clock.start()
        norms = self.optimizer.clip_grad_norm_(s.optimizer.grad_clip_norm)
        lrs = {g["optimizer"]: g["lr"] for g in self.optimizer.param_groups}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        phases = clock.seconds()  # waits for the step's queued work, once
        forward_s, backward_s, optimizer_s = phases["forward"], phases["backward"], phases["optimizer"]
        step_s = time.perf_counter() - start
        stats.maxes["perf"] = torch.tensor([step_s, forward_s, backward_s, optimizer_s, phases["onpolicy"],
                                            self._peak_memory_bytes()], dtype=torch.float64, device=self.device)
        stats.all_reduce()
        bias_error = None
        if self.bias_balancer is not None:
            bias_error = self.bias_balancer.step(stats.expert_counts())
        self.version += 1

        metrics = stats.metrics()
        step_s, forward_s, backward_s, optimizer_s, onpolicy_s, peak = stats.maxes["perf"].tolist()
        tokens = metrics["batch/input_tokens"]
        metrics.update(packing_stats)
        metrics.update({
            "grad/norm_muon": norms.muon, "grad/norm_adamw": norms.adamw, "grad/norm_total": norms.total,
            "grad/adamw_clipped": float(norms.adamw_clipped),
            "optim/lr_muon": float(lrs.get("muon", 0.0)), "optim/lr_adamw": float(lrs.get("adamw", 0.0)),
            "optim/muon_ns_flops_local": float(self.optimizer.last_muon_stats.ns_flops),
            "optim/version": float(self.version),
            "perf/step_s": step_s, "perf/forward_s": forward_s, "perf/backward_s": backward_s,
            "perf/optimizer_s": optimizer_s, "perf/onpolicy_s": onpolicy_s,
            "perf/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "perf/tokens_per_s_per_rank": tokens / step_s / self.world_size if step_s > 0 else 0.0,
            "perf/microbatches": float(len(microbatches)),
            "perf/peak_memory_gib": peak / 2**30,
        })
        if offload is not None:
            metrics["perf/offloaded_gib_rank"] = offload.offloaded_bytes / 2**30
        if bias_error is not None:
            metrics["routing/bias_balance_error_abs_max"] = float(bias_error.abs().max())
        return metrics

    def _microbatch(self, indices: list[int], build, loss_fn, stats: StepStats, clock: PhaseClock) -> None:
        """Build one microbatch, then its forward (loss and statistics) and backward, timed on `clock`.

        Nothing here waits for the GPU (tests/unit/trainer/test_host_syncs.py counts what would), so
        the host queues the next kernels while the current ones run."""
        mb = build(indices)
        clock.start()
        out = loss_fn(mb, stats)
        clock.lap("forward")
        # The dummy's loss is 0 with a zero gradient; its backward only drives the collectives.
        out.loss.backward()
        clock.lap("backward")

    def _score_onpolicy(self, share: RankShare, pack, stats: StepStats, clock: PhaseClock) -> None:
        """Score up to `onpolicy_mismatch_tokens` of the share's tokens sampled by the copy's version under
        the copy (onpolicy.py), then refresh the copy when the current weights were synced since.

        Collective: every rank runs the forward or none does (the copy's version and the batch's
        staleness are the same everywhere); a rank with no such token runs the 1-token dummy."""
        synced, budget = self.synced, self.settings.onpolicy_mismatch_tokens
        if budget == 0:
            return
        version = synced.scored_version(share.trainer_step, share.max_staleness)
        clock.start()
        if version is None:
            if synced.refreshes(self.version):
                synced.refresh(self.model, self.version)
                clock.lap("onpolicy")
            return
        sample = onpolicy_sample(share.rollouts, version, max_scored_tokens=budget,
                                 max_input_tokens=self.settings.token_budget, seed=(self.version, self.rank))
        mb = pack(sample, np.zeros(len(sample)), list(range(len(sample))))  # [] -> the dummy
        with synced.swapped_in(self.model, self.version), torch.no_grad():
            out = forward_logprobs(self.model, mb, with_entropy=False, chunk_tokens=self.settings.logprob_chunk_tokens,
                                   sampling=self.settings.sampling)
            # FSDP2's root keeps its gathered (the copy's) parameters after a forward and records the
            # forward's order for backward prefetching, both cleared by a backward: reshard and clear
            # them so the training forward gathers the restored shards (without it the next backward
            # crashed: a segfault on 1 gloo rank).
            self.model.reset_iter_state()
        if not mb.is_dummy:
            stats.add_onpolicy(mb, out.logprobs, version, lag=self.version - version)
        clock.lap("onpolicy")

    def _reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak_memory_bytes(self) -> float:
        """GPU: max allocated this step. CPU: the process's peak resident set size (since start)."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0  # Linux reports KiB

    # ------------------------------------------------------------------ checkpoints and export

    def save_checkpoint(self, path: str | Path, data_state: dict[str, Any] | None = None) -> None:
        ckpt.save_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                             bias_balancer=self.bias_balancer, step=self.version, data_state=data_state)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore a checkpoint (saved on any number of ranks); returns the caller's data_state."""
        state = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                     bias_balancer=self.bias_balancer)
        self.version = state.step
        self.synced.drop()  # its version may not be this checkpoint's past
        return state.data_state

    def weights_synced(self) -> None:
        """A weight sync sent the current weights to the rollout engines (every rank calls it, before the
        sync's gathers): the next RL step keeps a host copy of them to score their tokens later."""
        if self.settings.onpolicy_mismatch_tokens > 0:
            self.synced.synced(self.version)

    def export_weights(self, dtype: torch.dtype | None = torch.bfloat16,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
        """Full weights in HF names, bucketed, stamped with `version`; collective, iterate to the end."""
        return iter_weight_buckets(self.model, version=self.version, dtype=dtype, bucket_bytes=bucket_bytes)

    def export_hf(self, path: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> None:
        """Write the policy as a HF checkpoint of its model_type (rank 0 writes, tokenizer files copied);
        with adapters, merged into the base tensor by tensor."""
        export_hf_checkpoint(self.model, path, version=self.version, dtype=dtype, companion_dir=self.model_path)

    def export_adapter(self, path: str | Path) -> None:
        """Write the adapters as a PEFT adapter directory naming the base, as an absolute path (rank 0
        writes); collective."""
        if self.settings.lora is None:
            raise ValueError("export_adapter: this trainer has no adapters (model.lora is unset)")
        export_peft_adapter(self.model, path, version=self.version, base_model=str(self.model_path.resolve()))

    def shutdown(self) -> None:
        """Release the process group if this worker created it."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
