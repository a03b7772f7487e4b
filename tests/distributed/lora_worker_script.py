"""One LoRA trainer rank for tests/distributed/test_trainer_lora_fsdp.py: runs its scenarios, rank 0 records.

Usage: python lora_worker_script.py DATA.pkl MODEL_DIR OUT_DIR PORT RANK WORLD_SIZE
Started with 2 ranks, then with 1 (which also resumes from the 2-rank run's checkpoint); each run writes
OUT_DIR/w<WORLD_SIZE>/: full states (the model's names, adapters included) as <name>.pt, gradients as
<name>_grad.pt, the merged HF export (hf/) and the PEFT adapter directory (adapter/). The assertions
live in the test.
"""

import pickle
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zrl.config.schema import Algorithm, LoRASpec, MuonSpec, Optimizer
from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
from zrl.trainer.distributed import init_process_group

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
LORA = LoRASpec(rank=4, alpha=8.0, targets={"router": True})


def settings(**overrides) -> TrainerSettings:
    base = dict(param_dtype="float32", token_budget=48, max_response_tokens=32, activation_checkpointing=True,
                lora=LORA, optimizer=Optimizer(muon=MuonSpec(lr=2e-2), warmup_steps=0, grad_clip_norm=0.5),
                algorithm=Algorithm(router_replay=True, router_bias_update=False))
    base.update(overrides)
    return TrainerSettings(**base)


def full_state(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    """Collective: every rank gathers."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in worker.model.state_dict().items()}


def main() -> None:
    data_path, model_dir, out_root, port, rank, world = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    batches = pickle.loads(Path(data_path).read_bytes())
    out = Path(out_root) / f"w{world}"
    out.mkdir(parents=True, exist_ok=True)
    rdzv = Rendezvous("127.0.0.1", int(port), rank, world, backend="gloo", timeout_s=120)
    init_process_group(rdzv)
    names: dict[int, str] = {}
    grads: list[dict[str, torch.Tensor]] = []

    def record(name: str, worker: TrainerWorker) -> None:
        state = full_state(worker)
        if rank == 0:
            torch.save(state, out / f"{name}.pt")

    def grad_hook(optimizer, args, kwargs) -> None:
        step = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    step[names[id(p)]] = g.clone()
        grads.append(step)

    w = TrainerWorker(rdzv, model_dir, settings())
    names.update({id(p): n for n, p in w.model.named_parameters()})
    w.optimizer.register_step_pre_hook(grad_hook)
    record("A_init", w)
    w.train_step(w.share_of(batches[0]))
    record("A_step1", w)
    w.save_checkpoint(out / "ckpt", data_state={"saved_on": world})
    w.train_step(w.share_of(batches[1]))
    record("A_step2", w)
    if rank == 0:
        torch.save(grads, out / "A_grads.pt")
    w.export_hf(out / "hf", dtype=None)
    w.export_adapter(out / "adapter")
    del w

    other = Path(out_root) / "w2" / "ckpt"
    if world == 1 and other.exists():
        w = TrainerWorker(rdzv, model_dir, settings())
        w.load_checkpoint(other)
        record("C_loaded", w)
        w.train_step(w.share_of(batches[1]))
        record("C_step2", w)
        del w

    w = TrainerWorker(rdzv, model_dir, settings(param_dtype="bfloat16"))
    record("B_init", w)
    w.train_step(w.share_of(batches[0]))
    record("B_step1", w)
    del w

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
