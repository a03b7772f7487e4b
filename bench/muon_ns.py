"""Muon step time under FSDP2: layer-sharded vs replicated Newton–Schulz, 2 ranks (gloo on CPU).

Runs itself under torchrun (`python bench/muon_ns.py [--layers 2 ...]`). Each rank holds an FSDP2
model of MoE-like matrices (attention q/k/v/o, router MLP + down-projection, 3-D experts [E, 2F, D]
and [E, D, F]); gradients are fixed random DTensors. For each mode it times `MuonAdamW.step()`
(Muon only: exchange + NS + update) and prints time, the NS FLOPs each rank ran, the NS FLOP rate,
and the replicated / layer-sharded time ratio (ideal: the world size).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from zrl.optim import MuonAdamW, MuonHyperparams, ns_flops


class Layer(nn.Module):
    def __init__(self, d: int, kv: int, ff: int, experts: int, router_hidden: int):
        super().__init__()
        shapes = {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d),
                  "router_down": (router_hidden, d), "router_mlp": (experts, router_hidden),
                  "w_gate_up": (experts, 2 * ff, d), "w_down": (experts, d, ff)}
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape) * 0.02))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--kv", type=int, default=64)
    ap.add_argument("--ff", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--router-hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def time_mode(model: nn.Module, mode: str, steps: int) -> tuple[float, int, int]:
    """Median seconds per step, this rank's NS FLOPs, elements this rank sent."""
    opt = MuonAdamW([{"params": list(model.parameters()), "optimizer": "muon"}],
                    muon=MuonHyperparams(lr=0.0), distributed_mode=mode)  # lr 0: weights stay fixed
    opt.step()  # warm-up
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), opt.last_muon_stats.ns_flops, opt.last_muon_stats.sent_elements


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(*[Layer(args.d, args.kv, args.ff, args.experts, args.router_hidden)
                            for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), p.device_mesh, [Shard(0)])
    total_flops = sum(ns_flops(p.shape) for p in model.parameters())

    rows = {}
    for mode in ("replicated", "layer_sharded"):
        seconds, flops, sent = time_mode(model, mode, args.steps)
        all_flops = [None] * world
        dist.all_gather_object(all_flops, flops)
        rows[mode] = (seconds, all_flops, sent)
    if rank == 0:
        print(f"device: {os.uname().machine}, torch {torch.__version__}, {world} ranks x "
              f"{torch.get_num_threads()} thread(s), gloo; load average {os.getloadavg()[0]:.2f} "
              f"(other processes share the cores)")
        print(f"matrices: {args.layers} layers x (q,o [{args.d}x{args.d}], k,v [{args.kv}x{args.d}], router "
              f"[{args.router_hidden}x{args.d}],[{args.experts}x{args.router_hidden}], experts "
              f"[{args.experts},{2 * args.ff},{args.d}] + [{args.experts},{args.d},{args.ff}]); "
              f"NS total {total_flops / 1e9:.2f} GFLOP/step")
        print(f"{'mode':<14} {'step ms':>9} {'NS GFLOP per rank':>22} {'GFLOP/s per rank':>17} {'sent MB':>8}")
        for mode, (seconds, all_flops, sent) in rows.items():
            per_rank = "/".join(f"{f / 1e9:.2f}" for f in all_flops)
            rate = max(all_flops) / 1e9 / seconds
            print(f"{mode:<14} {seconds * 1e3:9.1f} {per_rank:>22} {rate:17.1f} {sent * 2 / 1e6:8.2f}")
        rep, lay = rows["replicated"][0], rows["layer_sharded"][0]
        ideal = total_flops / max(rows["layer_sharded"][1])
        print(f"replicated / layer_sharded step time: {rep / lay:.2f}x (ideal from FLOP balance {ideal:.2f}x)")
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
