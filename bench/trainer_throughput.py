"""Trainer throughput: packed token-budget microbatches vs padded fixed-count microbatches (1 rank).

For the tiny MoE++ config and a small one, builds a seeded zaya checkpoint, starts a 1-rank
TrainerWorker (gloo on CPU, NCCL on a GPU) and times full RL optimizer steps on synthetic batches
whose response lengths are heavy-tailed (as RL rollouts are):
- packed: `TrainerWorker.train_step` (token budget per microbatch, no padding, cu_seqlens);
- padded (baseline): the same objective, forward/backward on microbatches of a fixed number of
  rollouts, each padded to the batch's longest sequence (masked pad tokens still go through every
  layer), then the same optimizer step.
Prints real (non-pad) trainer tokens/s of both and their ratio, plus the packing efficiencies.
Usage: python bench/trainer_throughput.py [--steps 3] [--configs tiny,small]
"""

import argparse
import socket
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch

from zrl.assets import build_tiny_model
from zrl.config.schema import Algorithm, MuonSpec, Optimizer
from zrl.trainer import Rendezvous, TrainerSettings, TrainerWorker
from zrl.trainer.batch import Microbatch, input_length, pack_rollouts
from zrl.trainer.loss import rl_microbatch_loss
from zrl.models import get_family
from zrl.trainer.synthetic import synthetic_train_batch

CONFIGS = {
    "tiny": {},  # the zaya family's tiny_config (zrl/moepp/family.py): D 64, 2 layers, 4 experts
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                  moe_intermediate_size=512, num_experts=8, router_hidden_size=64),
}
TOKEN_BUDGET = 2048
ROWS_PER_PADDED_MICROBATCH = 4


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    return ap.parse_args()


def heavy_tailed_batch(model_config, args, trainer_step: int, seed: int):
    """Responses of 8..512 tokens, log-uniform: most short, a few long (what padding pays for)."""
    batch = synthetic_train_batch(vocab_size=model_config.vocab_size,
                                  shape=get_family(model_config.model_type).shape(model_config), num_groups=args.groups,
                                  group_size=args.group_size, prompt_tokens=(16, 64), response_tokens=(1, 1),
                                  trainer_step=trainer_step, seed=seed)
    rng = np.random.default_rng(seed)
    groups = []
    for g in batch.groups:
        rollouts = []
        for r in g.rollouts:
            n = int(np.exp(rng.uniform(np.log(8), np.log(512))))
            tokens = rng.integers(3, model_config.vocab_size, size=n, dtype=np.int32)
            routing = rng.integers(0, model_config.num_experts + 1, size=(len(r.prompt_ids) + n,
                                                                           model_config.num_hidden_layers))
            rollouts.append(type(r)(prompt_ids=r.prompt_ids, token_ids=tokens,
                                    logprobs=np.log(rng.uniform(0.02, 1.0, size=n)).astype(np.float32),
                                    routing=routing.astype(np.uint8), version_segments=r.version_segments,
                                    finish_reason="stop"))
        groups.append(type(g)(group_id=g.group_id, prompt=g.prompt, rollouts=tuple(rollouts),
                              verifications=g.verifications, rewards=g.rewards, length_bonuses=g.length_bonuses,
                              advantages=g.advantages, canary_flags=g.canary_flags))
    return type(batch)(groups=tuple(groups), trainer_step=trainer_step)


def padded(mb: Microbatch, width: int) -> Microbatch:
    """Each document of `mb` extended to `width` tokens with masked pad tokens (pad id 0, no target)."""
    bounds = list(mb.cu_seqlens)
    pieces = {k: [] for k in ("input_ids", "targets", "loss_mask", "seq_idx", "behaviour_logprobs", "advantages",
                              "versions", "routing")}
    fill = {"input_ids": 0, "targets": -1, "loss_mask": False, "seq_idx": -1, "behaviour_logprobs": 0.0,
            "advantages": 0.0, "versions": -1, "routing": 255}
    for start, end in zip(bounds[:-1], bounds[1:]):
        for key in pieces:
            part = getattr(mb, key)[start:end]
            pad = torch.full((width - (end - start),) + part.shape[1:], fill[key], dtype=part.dtype)
            pieces[key].append(torch.cat([part, pad]))
    cat = {k: torch.cat(v) for k, v in pieces.items()}
    n = len(bounds) - 1
    return Microbatch(cu_seqlens=torch.arange(n + 1) * width, num_sequences=n, **cat)


def padded_step(worker: TrainerWorker, batch) -> float:
    """Seconds of one step on fixed-count padded microbatches (same objective and optimizer)."""
    s = worker.settings
    rollouts, advantages = batch.rollouts(), batch.advantages()
    width = max(input_length(len(r.prompt_ids), len(r.token_ids)) for r in rollouts)
    start = time.perf_counter()
    for first in range(0, len(rollouts), ROWS_PER_PADDED_MICROBATCH):
        indices = list(range(first, min(first + ROWS_PER_PADDED_MICROBATCH, len(rollouts))))
        mb = padded(pack_rollouts(rollouts, advantages, indices, num_layers=worker.model.config.num_hidden_layers,
                                  replay=True, device=worker.device), width)
        rl_microbatch_loss(worker.model, mb, s.objective(), global_num_seqs=batch.num_sequences,
                           global_num_tokens=batch.num_response_tokens, trainer_step=worker.version,
                           with_entropy=s.with_entropy).loss.backward()
    worker.optimizer.clip_grad_norm_(s.optimizer.grad_clip_norm)
    worker.optimizer.step()
    worker.scheduler.step()
    worker.optimizer.zero_grad(set_to_none=True)
    worker.version += 1  # keep the worker's batch-version check in step with the padded steps
    return time.perf_counter() - start


def bench_config(name: str, overrides: dict, args, rdzv: Rendezvous) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, **overrides)
        settings = TrainerSettings(param_dtype="float32", token_budget=TOKEN_BUDGET, max_response_tokens=512,
                                   optimizer=Optimizer(muon=MuonSpec(lr=1e-4)),
                                   algorithm=Algorithm(router_replay=True))
        worker = TrainerWorker(rdzv, path, settings)
        cfg = worker.model.config
        params = sum(p.numel() for p in worker.model.parameters())
        worker.train_step(worker.share_of(heavy_tailed_batch(cfg, args, worker.version, seed=100)))  # warm-up
        padded_step(worker, heavy_tailed_batch(cfg, args, worker.version, seed=101))
        packed_tps, padded_tps, last = [], [], {}
        for k in range(args.steps):
            batch = heavy_tailed_batch(cfg, args, worker.version, seed=k)
            start = time.perf_counter()
            last = worker.train_step(worker.share_of(batch))
            packed_tps.append(last["batch/input_tokens"] / (time.perf_counter() - start))
            batch = heavy_tailed_batch(cfg, args, worker.version, seed=k)
            real = sum(input_length(len(r.prompt_ids), len(r.token_ids)) for r in batch.rollouts())
            padded_tps.append(real / padded_step(worker, batch))
        return {"name": name, "params": params, "packed": statistics.median(packed_tps),
                "padded": statistics.median(padded_tps), "efficiency": last["packing/efficiency"],
                "padded_efficiency": last["packing/padded_efficiency"], "microbatches": last["perf/microbatches"],
                "tokens": last["batch/input_tokens"]}


def main() -> None:
    args = parse()
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rdzv = Rendezvous("127.0.0.1", port, rank=0, world_size=1)
    device = "cuda" if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device {device}; torch {torch.__version__}; {args.groups}x{args.group_size} rollouts per batch, "
          f"responses log-uniform in [8, 512] tokens; token budget {TOKEN_BUDGET}; padded baseline: "
          f"{ROWS_PER_PADDED_MICROBATCH} rollouts per microbatch padded to the longest; median of {args.steps} steps")
    print(f"{'config':8} {'params':>10} {'tokens/step':>11} {'packed tok/s':>13} {'padded tok/s':>13} "
          f"{'ratio':>6} {'pack eff':>9} {'pad eff':>8} {'microbatches':>12}")
    for name in args.configs.split(","):
        r = bench_config(name, CONFIGS[name], args, rdzv)
        print(f"{r['name']:8} {r['params']:>10,} {r['tokens']:>11.0f} {r['packed']:>13.1f} {r['padded']:>13.1f} "
              f"{r['packed'] / r['padded']:>6.2f} {r['efficiency']:>9.2f} {r['padded_efficiency']:>8.2f} "
              f"{r['microbatches']:>12.0f}")


if __name__ == "__main__":
    main()
