"""Momentum-free Muon + AdamW in one torch optimizer, FSDP2-aware (ZAYA1-8B report §IV-E; docs/algorithms.md §5).

Responsibility: one `torch.optim.Optimizer` whose param groups are tagged `"optimizer": "muon"` or
`"adamw"`, so one LR scheduler, one `state_dict` and one `step()` serve the whole model.

Muon update of a matrix W [m, n] (each expert of a 3-D [E, m, n] tensor is its own matrix):
    W ← W·(1 − lr·wd) − lr·0.2·sqrt(max(m, n))·NS(g)
with NS = `newton_schulz` (5 bf16 steps). With momentum μ > 0 (comparison runs only):
m ← μ·m + g and NS runs on m (or on g + μ·m with Nesterov) — torch.optim.Muon keeps the EMA
(1 − μ)·m instead, which NS's normalisation makes equivalent.

Invariants:
- momentum = 0 allocates no optimizer state at all for Muon parameters (not even a step count);
  `state` holds only AdamW moments (and momentum buffers when μ > 0).
- NS is batched across parameters by shape, in batches of at most NS_BATCH_BYTES, so the step's
  transient memory does not grow with the depth.
- A matrix whose NS input has Frobenius norm <= `skip_norm` (default 0: exactly zero — an expert
  that received no tokens) is skipped entirely: no update and NO weight decay, the batched analogue
  of torch optimizers skipping a parameter whose grad is None. Decaying unrouted experts would
  shrink them for not being chosen, a drift unrelated to the RL signal.
- FSDP2 DTensor parameters (Shard(0)) give the same result as the unsharded model: in
  "layer_sharded" mode each whole 2-D matrix is gathered on one owner rank (all_to_all), NS runs
  there, and the update rows go back (all_to_all); 3-D expert tensors, already whole per rank,
  run locally. "replicated" mode all-gathers every gradient and runs every NS on every rank.

Gradient clipping: NS(c·G) = NS(G) for any c > 0 (up to the 1e-7 in the norm), so scaling Muon
gradients by a global clip factor changes neither the direction nor the size of the Muon update;
it could only push a tiny matrix under `skip_norm`. `clip_grad_norm_` therefore clips the AdamW
groups' gradients only (against their own norm) and reports the norms of both groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.tensor import DTensor
from torch.nn.utils import get_total_norm
from torch.optim.adamw import adamw

from zrl.config.schema import AdamWSpec, MuonSpec
from zrl.optim.layer_shard import LayerShardPlan, ShardLayout, all_to_all, gather_full, shard_layout
from zrl.optim.newton_schulz import NS_COEFFICIENTS, NS_EPS, NS_STEPS, muon_update_scale, newton_schulz, ns_flops

MUON = "muon"
ADAMW = "adamw"
DistributedMode = Literal["layer_sharded", "replicated"]
_COMM_DTYPE = torch.bfloat16  # NS casts to bf16 first, so bf16 on the wire loses nothing
# Same-shaped matrices run NS together in batches of at most this many bytes of fp32 copies
# (`_bounded_batches`): a [48, 2048, 4096] batch, three ZAYA1 layers' expert matrices.
NS_BATCH_BYTES = 3 << 30
# Hyperparameter defaults are the recipe schema's (the one place defaults are written).
_MUON_SPEC, _ADAMW_SPEC = MuonSpec(), AdamWSpec()


@dataclass(frozen=True)
class MuonHyperparams:
    """Defaults for "muon" groups; a group dict may override any field by name."""

    lr: float = _MUON_SPEC.lr
    weight_decay: float = _MUON_SPEC.weight_decay
    momentum: float = _MUON_SPEC.momentum
    nesterov: bool = _MUON_SPEC.nesterov
    ns_steps: int = NS_STEPS
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    eps: float = NS_EPS
    skip_norm: float = 0.0

    def __post_init__(self) -> None:
        _check_group(MUON, self.__dict__)


@dataclass(frozen=True)
class AdamWHyperparams:
    """Defaults for "adamw" groups; a group dict may override any field by name."""

    lr: float = _MUON_SPEC.lr  # a recipe's AdamW lr defaults to Muon's (the update RMS is matched)
    betas: tuple[float, float] = _ADAMW_SPEC.betas
    eps: float = _ADAMW_SPEC.eps
    weight_decay: float = _ADAMW_SPEC.weight_decay

    def __post_init__(self) -> None:
        _check_group(ADAMW, self.__dict__)


@dataclass(frozen=True)
class GradNorms:
    """L2 norms of the gradients before clipping; `total` covers both groups."""

    muon: float
    adamw: float
    total: float
    adamw_clipped: bool


@dataclass
class MuonStepStats:
    """What this rank did in the last Muon step (for metrics and the layer-sharding tests)."""

    ns_flops: int = 0
    matrices: int = 0  # orthogonalised on this rank
    skipped: int = 0  # zero-gradient matrices this rank decided to skip
    sent_elements: int = 0  # elements this rank put into Muon collectives


_GROUP_KEYS = {MUON: set(MuonHyperparams.__dataclass_fields__), ADAMW: set(AdamWHyperparams.__dataclass_fields__)}
_COMMON_KEYS = {"params", "optimizer", "name"}


def _check_group(tag: str, group: dict[str, Any]) -> None:
    """Validate hyperparameter values of one group (after defaults were filled in)."""
    if group["lr"] < 0:
        raise ValueError(f"{tag} lr must be >= 0, got {group['lr']}")
    if group["weight_decay"] < 0:
        raise ValueError(f"{tag} weight_decay must be >= 0, got {group['weight_decay']}")
    if tag == MUON:
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"muon momentum must be in [0, 1), got {group['momentum']}")
        if group["ns_steps"] < 1 or len(group["ns_coefficients"]) != 3:
            raise ValueError("muon needs ns_steps >= 1 and three ns_coefficients")
        if group["skip_norm"] < 0:
            raise ValueError(f"muon skip_norm must be >= 0, got {group['skip_norm']}")
    else:
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"adamw betas must be in [0, 1), got {group['betas']}")
        if group["eps"] <= 0:
            raise ValueError(f"adamw eps must be > 0, got {group['eps']}")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _MuonItem:
    param: torch.Tensor
    group: dict[str, Any]
    ns_input: torch.Tensor  # local rows, bf16: [m_r, n] or [E_r, m, n]
    layout: ShardLayout | None
    update: torch.Tensor | None = None  # local rows of NS(g), bf16
    skipped: torch.Tensor | None = None  # [B] bool, one per local matrix
    # set when the NS job covers more rows than this rank holds (replicated mode)
    row_slice: tuple[int, int] | None = field(default=None)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for "muon" groups, AdamW for "adamw" groups, one optimizer.

    `params`: iterable of dicts `{"params": [...], "optimizer": "muon" | "adamw", **overrides}`;
    an optional "name" is kept for logs. Muon parameters must be 2-D or 3-D ([E, m, n] experts).
    `distributed_mode` only matters for row-sharded DTensor parameters.
    """

    def __init__(self, params: Iterable[dict[str, Any]], *, muon: MuonHyperparams = MuonHyperparams(),
                 adamw: AdamWHyperparams = AdamWHyperparams(),
                 distributed_mode: DistributedMode = "layer_sharded"):
        if distributed_mode not in ("layer_sharded", "replicated"):
            raise ValueError(f"distributed_mode must be 'layer_sharded' or 'replicated', got {distributed_mode!r}")
        self._hyper = {MUON: muon, ADAMW: adamw}
        self.distributed_mode = distributed_mode
        self.last_muon_stats = MuonStepStats()
        groups = list(params)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise ValueError("MuonAdamW takes a non-empty list of param-group dicts tagged 'optimizer'")
        super().__init__(groups, defaults={})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        tag = param_group.get("optimizer")
        if tag not in _GROUP_KEYS:
            raise ValueError(f"param group needs 'optimizer' in {sorted(_GROUP_KEYS)}, got {tag!r}")
        unknown = set(param_group) - _GROUP_KEYS[tag] - _COMMON_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)} in a {tag} group; valid: "
                             f"{sorted(_GROUP_KEYS[tag] | _COMMON_KEYS)}")
        group = {**self._hyper[tag].__dict__, **param_group}
        _check_group(tag, group)
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in params:
            if torch.is_complex(p):
                raise ValueError("complex parameters are not supported")
            if tag == MUON and p.ndim not in (2, 3):
                raise ValueError(f"Muon takes 2-D matrices or 3-D [E, m, n] expert tensors; got shape "
                                 f"{tuple(p.shape)} in group {group.get('name', '?')!r} (use AdamW for it)")
        group["params"] = params
        super().add_param_group(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = [g.get("optimizer") for g in state_dict["param_groups"]]
        current = [g["optimizer"] for g in self.param_groups]
        if saved != current:
            raise ValueError(f"param-group optimizer tags differ: saved {saved}, current {current}")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["optimizer"] == ADAMW:
                self._adamw_group_step(group)
        self._muon_step()
        return loss

    # AdamW -----------------------------------------------------------------------------------
    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW here does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    # Muon ------------------------------------------------------------------------------------
    def _muon_inputs(self) -> list[_MuonItem]:
        items = []
        for group in self.param_groups:
            if group["optimizer"] != MUON:
                continue
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                grad = _local(p.grad)
                if mu > 0:
                    state = self.state[p]  # touched only with momentum: μ = 0 keeps no state
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                    buf = _local(state["momentum_buffer"])
                    buf.mul_(mu).add_(grad)
                    ns_in = grad.add(buf, alpha=mu) if group["nesterov"] else buf
                else:
                    ns_in = grad
                items.append(_MuonItem(param=p, group=group, ns_input=ns_in.to(_COMM_DTYPE),
                                       layout=shard_layout(p)))
        return items

    def _muon_step(self) -> None:
        stats = MuonStepStats()
        items = self._muon_inputs()
        jobs: list[tuple[torch.Tensor, dict[str, Any]]] = []  # ([B, m, n] bf16, group)
        sinks = []  # per job: a callback receiving (update [B, m, n], skipped [B])
        by_pg: dict[Any, list[_MuonItem]] = defaultdict(list)  # row-sharded 2-D items to exchange
        for item in items:
            lay = item.layout
            if lay is None or (item.param.ndim == 3 and self.distributed_mode == "layer_sharded"):
                # Whole matrices are already local: plain/replicated tensors, or expert tensors
                # whose dim-0 shard holds whole experts.
                if item.ns_input.numel():
                    jobs.append((_as_batch(item.ns_input), item.group))
                    sinks.append(_store(item))
            elif self.distributed_mode == "replicated":
                jobs.append((_as_batch(gather_full(item.ns_input, lay)), item.group))
                stats.sent_elements += item.ns_input.numel()
                item.row_slice = lay.rows()[lay.rank]
                sinks.append(_store(item))
            else:
                by_pg[lay.group].append(item)

        exchanges = [self._gather_to_owners(pg, group_items, items, jobs, sinks, stats)
                     for pg, group_items in by_pg.items()]
        for (updates, skipped), sink in zip(_orthogonalize(jobs, stats), sinks):
            sink(updates, skipped)
        for exchange in exchanges:
            _return_to_row_shards(*exchange, stats)
        for item in items:
            if item.update is not None:
                _apply_muon_update(item)
        self.last_muon_stats = stats

    def _gather_to_owners(self, pg, group_items: list[_MuonItem], items: list[_MuonItem], jobs: list, sinks: list,
                          stats: MuonStepStats):
        """First all_to_all: every 2-D matrix of `pg` arrives whole on its owner, as an NS job."""
        lay = group_items[0].layout
        plan = LayerShardPlan([tuple(it.param.shape) for it in group_items], lay.world_size, lay.rank,
                              self._expert_loads(items, pg, lay), steps=NS_STEPS)
        send_splits, recv_splits = plan.forward_splits()
        send = plan.pack_forward([it.ns_input for it in group_items], _COMM_DTYPE, group_items[0].ns_input.device)
        stats.sent_elements += send.numel()
        owned_full = plan.unpack_forward(all_to_all(send, send_splits, recv_splits, pg))  # [m, n] each
        owned_results: list[list[Any]] = [[None, None] for _ in plan.owned]
        for slot, i, full in zip(owned_results, plan.owned, owned_full):
            jobs.append((full.unsqueeze(0), group_items[i].group))
            sinks.append(_store_into(slot))
        return pg, plan, group_items, owned_results

    @staticmethod
    def _expert_loads(items: list[_MuonItem], pg, lay: ShardLayout) -> list[int]:
        """NS FLOPs each rank of `pg` already runs on its local whole experts."""
        loads = [0] * lay.world_size
        for it in items:
            if it.layout is not None and it.layout.group is pg and it.param.ndim == 3:
                per_expert = ns_flops(it.param.shape[1:], NS_STEPS)  # same cost model as the plan
                for r, (start, end) in enumerate(it.layout.rows()):
                    loads[r] += (end - start) * per_expert
        return loads

    # Clipping --------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float | None) -> GradNorms:
        """Clip AdamW-group gradients to `max_norm` (None: only measure); Muon grads untouched."""
        if max_norm is not None and max_norm <= 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        grads = {MUON: [], ADAMW: []}
        for group in self.param_groups:
            grads[group["optimizer"]].extend(p.grad for p in group["params"] if p.grad is not None)
        muon_norm, adamw_norm = _global_norm(grads[MUON]), _global_norm(grads[ADAMW])
        clipped = max_norm is not None and adamw_norm > max_norm
        if clipped:
            # Same coefficient as torch.nn.utils.clip_grad_norm_ (1e-6 guards a zero norm).
            coef = max_norm / (adamw_norm + 1e-6)
            for g in grads[ADAMW]:
                g.mul_(coef)
        return GradNorms(muon=muon_norm, adamw=adamw_norm, total=math.hypot(muon_norm, adamw_norm),
                         adamw_clipped=clipped)


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.ndim == 2 else t  # [B, m, n]


def _store(item: _MuonItem):
    def sink(updates: torch.Tensor, skipped: torch.Tensor) -> None:
        if item.row_slice is not None:  # a full tensor was orthogonalised: keep this rank's rows
            start, end = item.row_slice
            if item.param.ndim == 3:  # rows of dim 0 are experts
                updates, skipped = updates[start:end], skipped[start:end]
            else:
                updates = updates[:, start:end]
        item.update = updates.reshape(_local(item.param).shape)
        item.skipped = skipped
    return sink


def _store_into(slot: list[Any]):
    def sink(updates: torch.Tensor, skipped: torch.Tensor) -> None:
        slot[0], slot[1] = updates, skipped
    return sink


def _return_to_row_shards(pg, plan: LayerShardPlan, group_items: list[_MuonItem], owned_results: list[list[Any]],
                          stats: MuonStepStats) -> None:
    """Second all_to_all: each rank receives its rows of every update plus the skip flag."""
    send_splits, recv_splits = plan.backward_splits()
    send = plan.pack_backward([upd[0] for upd, _ in owned_results], [bool(skip[0]) for _, skip in owned_results],
                              _COMM_DTYPE, group_items[0].ns_input.device)
    stats.sent_elements += send.numel()
    for item, (rows, skip) in zip(group_items, plan.unpack_backward(all_to_all(send, send_splits, recv_splits, pg))):
        item.update = rows  # [m_r, n]
        item.skipped = torch.tensor([skip])


def _orthogonalize(jobs: list[tuple[torch.Tensor, dict[str, Any]]], stats: MuonStepStats):
    """NS of every job's [B, m, n] matrices, batched across jobs by shape and NS settings.

    Returns, per job, (update [B, m, n] bf16 with zero rows for skipped matrices, skipped [B]).
    """
    results = []
    buckets: dict[tuple, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for j, (mats, group) in enumerate(jobs):
        norms = torch.linalg.matrix_norm(mats.float())  # [B]
        skipped = norms <= group["skip_norm"]
        results.append((torch.zeros_like(mats, dtype=torch.bfloat16), skipped))
        keep = (~skipped).nonzero().flatten()
        stats.skipped += int(skipped.sum())
        if keep.numel():
            key = (mats.shape[-2], mats.shape[-1], group["ns_steps"], tuple(group["ns_coefficients"]), group["eps"])
            buckets[key].append((j, keep))
    for (m, n, steps, coefficients, eps), members in buckets.items():
        for batch in _bounded_batches(members, m * n * 4):
            stacked = torch.cat([jobs[j][0][keep] for j, keep in batch])  # [ΣB, m, n]
            out = newton_schulz(stacked, steps, coefficients, eps)
            stats.ns_flops += ns_flops(stacked.shape, steps)
            stats.matrices += stacked.shape[0]
            offset = 0
            for j, keep in batch:
                results[j][0][keep] = out[offset:offset + keep.numel()]
                offset += keep.numel()
    return results


def _bounded_batches(members: list[tuple[int, torch.Tensor]], fp32_bytes_per_matrix: int) -> list[list]:
    """`members` in consecutive runs of at most NS_BATCH_BYTES of fp32 matrices (a job larger than that
    is a run of its own). NS makes fp32 and bf16 copies of its whole batch, so one batch of every
    same-shaped matrix grows with the depth: at 34 ZAYA1 layers its fp32 copy of the expert matrices
    alone was 17 GiB, the allocation a one-GPU trainer step ran out of memory on (H200, 2026-11-28)."""
    batches, size = [], 0
    for j, keep in members:
        nbytes = keep.numel() * fp32_bytes_per_matrix
        if not batches or size + nbytes > NS_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((j, keep))
        size += nbytes
    return batches


def _apply_muon_update(item: _MuonItem) -> None:
    """W ← W·(1 − lr·wd) − lr·0.2·sqrt(max(m, n))·NS(g), skipping zero-gradient matrices."""
    p = _local(item.param)
    if p.numel() == 0 or bool(item.skipped.all()):
        return
    lr, wd = item.group["lr"], item.group["weight_decay"]
    alpha = -lr * muon_update_scale(item.param.shape[-2], item.param.shape[-1])
    if bool(item.skipped.any()):
        # Experts without gradient keep their weights bit for bit (their update rows are zero).
        keep_factor = torch.full_like(item.skipped, 1 - lr * wd, dtype=p.dtype)
        p.mul_(torch.where(item.skipped, torch.ones_like(keep_factor), keep_factor).view(-1, 1, 1))
    else:
        p.mul_(1 - lr * wd)
    p.add_(item.update, alpha=alpha)


def _global_norm(grads: list[torch.Tensor]) -> float:
    """L2 norm over all `grads`; DTensor shards are reduced over their mesh (one collective each)."""
    by_mesh: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_mesh[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    squares = 0.0
    for gs in by_mesh.values():
        norm = get_total_norm(gs)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    return math.sqrt(squares)
