"""One trainer rank for tests/distributed/test_trainer_fsdp.py: runs every scenario, rank 0 records results.

Usage: python trainer_worker_script.py DATA.pkl MODEL_DIR OUT_DIR PORT RANK WORLD_SIZE
The parent test starts WORLD_SIZE of these (plain processes, the controller's rendezvous, as Ray
actors would be) once with 2 ranks and once with 1; each run writes OUT_DIR/w<WORLD_SIZE>/:
full fp32 weights after each scenario as <name>.pt (HF keys) and results.json (metrics and facts).
The assertions live in the test; this script only runs the code.
"""

import json
import pickle
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zrl.config.schema import Algorithm, MuonSpec, Optimizer
from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
from zrl.trainer.distributed import init_process_group

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def settings(**overrides) -> TrainerSettings:
    base = dict(param_dtype="float32", token_budget=48, max_response_tokens=32, activation_checkpointing=True,
                optimizer=Optimizer(muon=MuonSpec(lr=2e-2), warmup_steps=2, grad_clip_norm=0.5),
                algorithm=Algorithm(router_replay=True, router_bias_update=True))
    base.update(overrides)
    return TrainerSettings(**base)


def full_weights(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    out = {}
    for bucket in worker.export_weights(dtype=None, bucket_bytes=1 << 16):
        out.update((k, t.clone()) for k, t in bucket.tensors)
    return out


class GradientRecorder:
    """Captures the full global gradients right before each optimizer step (after the AdamW clip).

    Uses the optimizer's public step pre-hook; every rank gathers (a collective), rank 0 keeps them.
    """

    def __init__(self, worker: TrainerWorker) -> None:
        self.names = {id(p): n for n, p in worker.model.named_parameters()}
        self.steps: list[dict[str, torch.Tensor]] = []
        worker.optimizer.register_step_pre_hook(self)

    def __call__(self, optimizer, args, kwargs) -> None:
        grads = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[self.names[id(p)]] = g.clone()
        self.steps.append(grads)


def main() -> None:
    data_path, model_dir, out_root, port, rank, world = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    data = pickle.loads(Path(data_path).read_bytes())
    out = Path(out_root) / f"w{world}"
    out.mkdir(parents=True, exist_ok=True)
    rdzv = Rendezvous("127.0.0.1", int(port), rank, world, backend="gloo", timeout_s=120)
    init_process_group(rdzv)  # shared by every worker below; destroyed at the end
    results: dict = {}

    def record(name: str, worker: TrainerWorker) -> None:
        weights = full_weights(worker)  # collective: every rank gathers
        if rank == 0:
            torch.save(weights, out / f"{name}.pt")

    batches = data["batches"]

    # A: three uninterrupted steps, weights after each; then the exports.
    w = TrainerWorker(rdzv, model_dir, settings())
    grads = GradientRecorder(w)
    record("init", w)
    results["A_metrics"] = []
    for k, batch in enumerate(batches, start=1):
        results["A_metrics"].append(w.train_step(w.share_of(batch)))
        record(f"A_step{k}", w)
        if rank == 0:
            torch.save(grads.steps[-1], out / f"A_grad{k}.pt")
    buckets = list(w.export_weights(dtype=torch.bfloat16, bucket_bytes=1 << 16))
    results["buckets"] = [{"version": b.version, "index": b.index, "last": b.last, "bytes": b.num_bytes,
                           "dtypes": sorted({str(t.dtype) for _, t in b.tensors}),
                           "names": [k for k, _ in b.tensors]} for b in buckets]
    w.export_hf(out / "hf", dtype=None)
    del w

    # B: one step, checkpoint, a fresh worker resumes and runs the remaining two.
    w = TrainerWorker(rdzv, model_dir, settings())
    w.train_step(w.share_of(batches[0]))
    w.save_checkpoint(out / "ckpt", data_state={"prompt_cursor": 17, "saved_on": world})
    del w
    w = TrainerWorker(rdzv, model_dir, settings())
    results["B_data_state"] = w.load_checkpoint(out / "ckpt")
    results["B_version_after_load"] = w.version
    for batch in batches[1:]:
        w.train_step(w.share_of(batch))
    record("B_final", w)
    del w

    # C: resume on this world size from the 2-rank checkpoint (when this is the 1-rank run).
    other = Path(out_root) / "w2" / "ckpt"
    if world == 1 and other.exists():
        w = TrainerWorker(rdzv, model_dir, settings())
        grads = GradientRecorder(w)
        results["C_data_state"] = w.load_checkpoint(other)
        results["C_metrics"] = []
        for k, batch in enumerate(batches[1:], start=2):
            results["C_metrics"].append(w.train_step(w.share_of(batch)))
            record(f"C_step{k}", w)
            torch.save(grads.steps[-1], out / f"C_grad{k}.pt")
        del w

    # D: the first step without activation checkpointing.
    w = TrainerWorker(rdzv, model_dir, settings(activation_checkpointing=False))
    w.train_step(w.share_of(batches[0]))
    record("D_step1", w)
    del w

    # E: every recorded expert id is expert 2: only expert 2's weights may receive gradient.
    w = TrainerWorker(rdzv, model_dir, settings(algorithm=Algorithm(router_replay=True, router_bias_update=False)))
    results["E_metrics"] = w.train_step(w.share_of(data["replay_batch"]))
    record("E", w)
    del w

    # F: HSDP, 2 replica groups of 1 shard each (2-rank run only).
    if world == 2:
        w = TrainerWorker(rdzv, model_dir, settings(hsdp_replicas=2))
        w.train_step(w.share_of(batches[0]))
        record("F_step1", w)
        del w

    # H: a batch with a single packable rollout: on 2 ranks, rank 1 runs only the dummy microbatch.
    w = TrainerWorker(rdzv, model_dir, settings())
    grads = GradientRecorder(w)
    results["H_metrics"] = w.train_step(w.share_of(data["single_batch"]))
    record("H", w)
    if rank == 0:
        torch.save(grads.steps[-1], out / "H_grad.pt")
    del w

    # I: A's three steps, each after a weight sync (TrainerRank.sync_weights' call): steps 2 and 3 also
    # score the tokens of the previous synced version under a host copy of its weights.
    w = TrainerWorker(rdzv, model_dir, settings())
    results["I_metrics"] = []
    for batch in batches:
        w.weights_synced()
        results["I_metrics"].append(w.train_step(w.share_of(batch)))
    record("I_step3", w)
    del w

    # J: after a sync at version 0 and one step, a single packable rollout of version-0 tokens: on 2
    # ranks, rank 1 runs the scoring forward on the dummy microbatch (under its own swapped shards).
    w = TrainerWorker(rdzv, model_dir, settings())
    w.weights_synced()
    w.train_step(w.share_of(batches[0]))
    results["J_metrics"] = w.train_step(w.share_of(data["single_version0"]))
    del w

    # G: one SFT step.
    w = TrainerWorker(rdzv, model_dir, settings())
    results["G_metrics"] = w.sft_step(data["sft_examples"])
    record("G", w)
    del w

    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
