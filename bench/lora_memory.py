"""Trainer memory and step time, full fine-tuning vs LoRA, on the tiny checkpoint of every registered family.

For each family, model dtype and mode (full: every weight, Muon on the matrices + AdamW on the rest; lora:
`model.lora` adapters at the given rank, AdamW or Muon on them), a 1-rank TrainerWorker (gloo, in process)
takes `--steps` RL steps on synthetic batches shaped like recipes/tiny-cpu.yaml's (16 prompts x 8 samples,
prompts of 8-40 tokens, responses of 1-24) after a weight sync, so the on-policy scoring's host copy
exists. Measured, not computed: the bytes of the parameters (the model's tensors, base and adapters), of
the gradients present when the optimizer steps, of the optimizer state after the last step, and of the
on-policy scoring's host copy (zrl/trainer/onpolicy.py), each divided by the base's parameter count; and
the median trainer step time (perf/step_s) after the first step.

    python bench/lora_memory.py --steps 6 --markdown bench/results/lora-memory-cpu-2026-11-28.md
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import warnings
from datetime import date
from pathlib import Path

import torch

from zrl.config.schema import Algorithm, DPPOBinaryTV, LoRASpec, MuonSpec, Optimizer
from zrl.models import get_family, registered_types
from zrl.modeling.lora import is_adapter
from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
from zrl.trainer.distributed import init_process_group
from zrl.trainer.synthetic import synthetic_train_batch

ROOT = Path(__file__).resolve().parents[1]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def measure(path: Path, rdzv: Rendezvous, dtype: str, lora: LoRASpec | None, steps: int) -> dict:
    settings = TrainerSettings(param_dtype=dtype, token_budget=4096, max_response_tokens=24, lora=lora,
                               optimizer=Optimizer(muon=MuonSpec(lr=5e-4)),
                               algorithm=Algorithm(trust_region=DPPOBinaryTV(delta=0.1), router_bias_update=False))
    worker = TrainerWorker(rdzv, path, settings)
    grad_bytes = []
    step = worker.optimizer.step

    def counting_step(*args, **kwargs):  # the gradients as the optimizer sees them
        grad_bytes.append(_bytes(_local(p.grad) for g in worker.optimizer.param_groups for p in g["params"]
                                 if p.grad is not None))
        return step(*args, **kwargs)

    worker.optimizer.step = counting_step
    worker.weights_synced()
    cfg = worker.model.config
    shape = get_family(cfg.model_type).shape(cfg)
    times = []
    for i in range(steps):
        batch = synthetic_train_batch(vocab_size=cfg.vocab_size, shape=shape, num_groups=16, group_size=8,
                                      prompt_tokens=(8, 40), response_tokens=(1, 24), trainer_step=i, seed=i)
        times.append(worker.train_step(worker.share_of(batch))["perf/step_s"])
        if i % 2 == 1:
            worker.weights_synced()  # a sync every other step: the scoring copy refreshes
    named = dict(worker.model.named_parameters())
    base = sum(p.numel() for n, p in named.items() if not is_adapter(n))
    trained = sum(p.numel() for p in named.values() if p.requires_grad)
    state = [v for s in worker.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    row = {"base_params": base, "trained_params": trained,
           "params": _bytes(_local(p) for p in named.values()) / base, "grads": max(grad_bytes) / base,
           "optimizer": _bytes(_local(t) for t in state) / base,
           "scoring_copy": _bytes(worker.synced._held) / base,
           "step_s": statistics.median(times[1:])}
    row["total"] = row["params"] + row["grads"] + row["optimizer"]
    del worker
    return row


def table(rows: list[tuple[str, str, str, dict]]) -> str:
    lines = ["| family | dtype | mode | base params | trained | params B/p | grads B/p | optimizer B/p | "
             "**total B/p** | scoring copy B/p | step s (median) |", "|---" * 11 + "|"]
    for family, dtype, mode, r in rows:
        lines.append(f"| {family} | {dtype} | {mode} | {r['base_params']:,} | {r['trained_params']:,} | "
                     f"{r['params']:.2f} | {r['grads']:.2f} | {r['optimizer']:.2f} | **{r['total']:.2f}** | "
                     f"{r['scoring_copy']:.2f} | {r['step_s']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank, recipes' scale)")
    parser.add_argument("--families", default=",".join(registered_types()))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = Rendezvous("127.0.0.1", port, rank=0, world_size=1, backend="gloo", timeout_s=120)
    init_process_group(rdzv)
    modes = {"full": None, f"lora r{args.rank} adamw": LoRASpec(rank=args.rank, alpha=2.0 * args.rank),
             f"lora r{args.rank} muon": LoRASpec(rank=args.rank, alpha=2.0 * args.rank, optimizer="muon")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            path = get_family(family).build_tiny(Path(tmp) / f"tiny-{family}", 0)
            for dtype in args.dtypes.split(","):
                for mode, lora in modes.items():
                    rows.append((family, dtype, mode, measure(path, rdzv, dtype, lora, args.steps)))
                    print(rows[-1], flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    text = (f"### {date.today()}, commit {commit}, {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}, 1 gloo rank, 1 thread, {args.steps} RL steps\n\n{table(rows)}")
    print(text)
    if args.markdown is not None:
        with args.markdown.open("a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
