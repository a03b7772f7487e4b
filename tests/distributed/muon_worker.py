"""torchrun worker for tests/distributed/test_muon_fsdp.py: FSDP2 MuonAdamW vs a 1-process reference.

Every rank builds the same stand-in model (uneven dim-0 sizes, 3-D experts with one never-routed
expert, a 1-D param, an embedding and a head), keeps an unsharded copy as the reference, shards
the other with `fully_shard` (gloo), runs identical forward/backward/clip/step on both for every
configuration, and rank 0 writes the measured differences and per-rank NS stats as JSON to argv[1].
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from zrl.optim import AdamWHyperparams, MuonAdamW, MuonHyperparams

VOCAB, D, FF, E, H, T = 7, 8, 6, 3, 17, 10
ZERO_EXPERT = E - 1  # never routed: its gradient is exactly zero


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.randn(E, 2 * FF, D) / D**0.5)  # [E, 2F, D]
        self.w_down = nn.Parameter(torch.randn(E, D, FF) / FF**0.5)  # [E, D, F]

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("td,tfd->tf", x, self.w_gate_up[expert_idx]).chunk(2, dim=-1)  # [T, F]
        # A reduction (not einsum's reshaped view) so FSDP2 does not warn about a view output.
        return (self.w_down[expert_idx] * (F.silu(gate) * up)[:, None, :]).sum(-1)  # [T, D]


class StandIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)  # [7, 8]: uneven over 2 ranks
        self.norm = nn.Parameter(torch.ones(D))
        self.wq = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.up = nn.Parameter(torch.randn(H, D) / D**0.5)  # tall, uneven
        self.down = nn.Parameter(torch.randn(D, H) / H**0.5)  # wide
        self.router = nn.Parameter(torch.randn(E, D) / D**0.5)  # [3, 8]: uneven
        self.gate = nn.Parameter(torch.randn(1, D) / D**0.5)  # [1, 8]: rank 1 holds zero rows
        self.experts = Experts()
        self.head = nn.Parameter(torch.randn(VOCAB, D) / D**0.5)

    def forward(self, tokens: torch.Tensor, expert_idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.norm  # [T, D]
        x = x + torch.tanh(x @ self.wq.T)
        x = x + torch.tanh(x @ self.up.T) @ self.down.T
        x = x * torch.sigmoid(x @ self.gate.T)  # [T, D] · [T, 1]
        probs = torch.softmax(x @ self.router.T, dim=-1)  # [T, E]
        x = x + probs.gather(1, expert_idx[:, None]) * self.experts(x, expert_idx)
        return F.cross_entropy(x @ self.head.T, targets)


def groups(model: StandIn) -> list[dict]:
    muon = [model.wq, model.up, model.down, model.router, model.gate, model.experts.w_gate_up,
            model.experts.w_down]
    return [{"params": muon, "optimizer": "muon", "name": "hidden"},
            {"params": [model.embed.weight, model.norm, model.head], "optimizer": "adamw", "name": "embed_head"}]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


CONFIGS = {
    "layer_sharded": dict(distributed_mode="layer_sharded", momentum=0.0, nesterov=False),
    "replicated": dict(distributed_mode="replicated", momentum=0.0, nesterov=False),
    "layer_sharded_nesterov": dict(distributed_mode="layer_sharded", momentum=0.9, nesterov=True),
}


def run_config(name: str, cfg: dict) -> dict:
    torch.manual_seed(0)
    ref = StandIn()
    init = {k: v.detach().clone() for k, v in ref.named_parameters()}
    sharded = copy.deepcopy(ref)
    fully_shard(sharded.experts)
    fully_shard(sharded)
    hyper = dict(muon=MuonHyperparams(lr=0.05, weight_decay=0.1, momentum=cfg["momentum"], nesterov=cfg["nesterov"]),
                 adamw=AdamWHyperparams(lr=0.01, weight_decay=0.1))
    ref_opt = MuonAdamW(groups(ref), **hyper)
    opt = MuonAdamW(groups(sharded), distributed_mode=cfg["distributed_mode"], **hyper)
    gen = torch.Generator().manual_seed(1)
    norms, flops, ref_flops = [], [], []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (T,), generator=gen)
        targets = torch.randint(0, VOCAB, (T,), generator=gen)
        expert_idx = torch.randint(0, E - 1, (T,), generator=gen)  # never ZERO_EXPERT
        for model, optim in ((ref, ref_opt), (sharded, opt)):
            optim.zero_grad()
            model(tokens, expert_idx, targets).backward()
            norms.append(optim.clip_grad_norm_(0.2).__dict__)
            optim.step()
        local = torch.tensor([opt.last_muon_stats.ns_flops], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        flops.append([int(g.item()) for g in gathered])
        ref_flops.append(ref_opt.last_muon_stats.ns_flops)
    params = dict(sharded.named_parameters())
    diffs = {k: (full(params[k]).detach() - v.detach()).abs().max().item() for k, v in ref.named_parameters()}
    moved = {k: (v.detach() - init[k]).abs().max().item() for k, v in ref.named_parameters()}
    zero_expert = {k: bool(torch.equal(full(params[f"experts.{k}"]).detach()[ZERO_EXPERT],
                                       init[f"experts.{k}"][ZERO_EXPERT])) for k in ("w_gate_up", "w_down")}
    # DCP round trip: Muon params have no state, so loading needs strict=False (torch 2.13 raises
    # "Missing optimizer state" otherwise) — the trainer's checkpoint code must pass it.
    osd = get_optimizer_state_dict(sharded, opt)
    fresh = MuonAdamW(groups(sharded), distributed_mode=cfg["distributed_mode"], **hyper)
    set_optimizer_state_dict(sharded, fresh, osd, options=StateDictOptions(strict=False))
    dcp_equal = len(fresh.state) == len(opt.state) and all(
        torch.equal(_local(opt.state[p][k]), _local(fresh.state[p][k])) for p in opt.state for k in opt.state[p])
    return {"dcp_state_keys": sorted(osd["state"]), "dcp_round_trip_equal": dcp_equal, "max_abs_diff": diffs,
            "moved": moved, "norms_ref_vs_sharded": norms, "flops_per_rank": flops, "ref_flops": ref_flops,
            "state_size": len(opt.state), "ref_state_size": len(ref_opt.state), "zero_expert_unchanged": zero_expert}


def main() -> None:
    dist.init_process_group("gloo")
    results = {name: run_config(name, cfg) for name, cfg in CONFIGS.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
