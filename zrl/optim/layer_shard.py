"""Layer sharding of Muon's Newton–Schulz work across FSDP2 ranks (Zyphra's layer-sharded Muon, strategy #3).

Source and formula: docs/algorithms.md §5. Shapes (docs/shapes.md): a matrix is [m, n], a rank's row
shard [m_r, n].

Responsibility: given Muon parameters that FSDP2 holds as DTensors sharded on dim 0 (row shards),
(1) describe each one's layout, (2) assign every whole 2-D matrix to one owner rank, balanced by NS
cost, (3) pack/unpack the row shards for one `all_to_all_single` that gathers each matrix on its
owner, and the reverse one that returns each rank its rows of the update.

Invariants:
- Row shards follow `torch.chunk` semantics on dim 0, exactly as FSDP2 / DTensor `Shard(0)` split
  them: chunk = ceil(m / world_size); rank r holds rows [min(r·chunk, m), min((r+1)·chunk, m)) — trailing
  ranks may hold zero rows (uneven shards).
- Every rank computes the same plan from global shapes alone (no collective needed), so the
  split sizes agree on all ranks. Matrix i travels to owner(i) in item order.
- 3-D expert tensors [E, m, n] are sharded on the expert dim by FSDP2, so each rank already holds
  whole expert matrices: they are orthogonalised in place and enter the plan only as each rank's
  initial load (the 2-D matrices are then placed to even out the total).
- The return message carries, per matrix, the owner's rows of the update plus one flag element
  (1 = skipped because the gradient was zero), so receivers also skip weight decay.
- Collectives used: `all_to_all_single` with uneven splits (available on gloo and NCCL).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from zrl.optim.newton_schulz import ns_flops


def row_ranges(num_rows: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) rows of each rank under `torch.chunk(num_rows, world_size)` semantics."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    chunk = math.ceil(num_rows / world_size) if num_rows else 0
    return [(min(r * chunk, num_rows), min((r + 1) * chunk, num_rows)) for r in range(world_size)]


@dataclass(frozen=True)
class ShardLayout:
    """Where one DTensor parameter's rows live: a Shard(0) over one mesh dim, Replicate elsewhere."""

    mesh: DeviceMesh
    placements: tuple
    mesh_dim: int
    group: dist.ProcessGroup
    rank: int  # coordinate along `mesh_dim`
    world_size: int
    global_shape: torch.Size

    def rows(self) -> list[tuple[int, int]]:
        return row_ranges(self.global_shape[0], self.world_size)


def shard_layout(param: torch.Tensor) -> ShardLayout | None:
    """Layout of a row-sharded DTensor; None for a plain tensor or a fully replicated DTensor."""
    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    shard_dims = [i for i, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    if not shard_dims:
        return None
    if len(shard_dims) != 1 or placements[shard_dims[0]] != Shard(0):
        raise ValueError(
            f"Muon supports DTensor parameters sharded on dim 0 over one mesh dim (FSDP2's default, "
            f"HSDP included); got placements {placements} for shape {tuple(param.shape)}")
    mesh_dim = shard_dims[0]
    mesh = param.device_mesh
    layout = ShardLayout(
        mesh=mesh, placements=placements, mesh_dim=mesh_dim, group=mesh.get_group(mesh_dim),
        rank=mesh.get_local_rank(mesh_dim), world_size=mesh.size(mesh_dim),
        global_shape=param.shape)
    start, end = layout.rows()[layout.rank]
    local_rows = param.to_local().shape[0]
    if local_rows != end - start:
        raise ValueError(
            f"local shard of {tuple(param.shape)} has {local_rows} rows on rank {layout.rank}, "
            f"expected {end - start} (torch.chunk split over {layout.world_size} ranks)")
    return layout


def assign_owners(costs: Sequence[int], world_size: int, initial_loads: Sequence[int]) -> list[int]:
    """Longest-processing-time greedy: costliest matrix first, to the least-loaded rank.

    Ties go to the lower rank and, among equal costs, the earlier item — deterministic, so every
    rank derives the same assignment.
    """
    if len(initial_loads) != world_size:
        raise ValueError(f"need {world_size} initial loads, got {len(initial_loads)}")
    heap = [(int(load), rank) for rank, load in enumerate(initial_loads)]
    heapq.heapify(heap)
    owners = [0] * len(costs)
    for idx in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[idx] = rank
        heapq.heappush(heap, (load + int(costs[idx]), rank))
    return owners


class LayerShardPlan:
    """Owner assignment and message layout for the 2-D matrices of one process group.

    `shapes[i]` is the global [m, n] of matrix i; `steps` is the NS step count used for costs.
    """

    def __init__(self, shapes: Sequence[tuple[int, int]], world_size: int, rank: int,
                 initial_loads: Sequence[int], steps: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of {world_size}")
        self.shapes = [tuple(s) for s in shapes]
        self.world_size = world_size
        self.rank = rank
        costs = [ns_flops(s, steps) for s in self.shapes]
        self.owners = assign_owners(costs, world_size, initial_loads)
        self.loads = list(initial_loads)
        for i, owner in enumerate(self.owners):
            self.loads[owner] += costs[i]
        self.rows = [row_ranges(m, world_size) for m, _ in self.shapes]
        self.owned = [i for i, o in enumerate(self.owners) if o == rank]
        self._by_owner = [[i for i, o in enumerate(self.owners) if o == r] for r in range(world_size)]

    def _n_rows(self, item: int, rank: int) -> int:
        start, end = self.rows[item][rank]
        return end - start

    # forward: row shards → owners
    def forward_splits(self) -> tuple[list[int], list[int]]:
        """(send sizes per destination, receive sizes per source) in elements."""
        send = [sum(self._n_rows(i, self.rank) * self.shapes[i][1] for i in self._by_owner[d])
                for d in range(self.world_size)]
        recv = [sum(self._n_rows(i, s) * self.shapes[i][1] for i in self.owned)
                for s in range(self.world_size)]
        return send, recv

    def pack_forward(self, local_shards: Sequence[torch.Tensor], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """Flat send buffer: for each destination, its matrices' local rows, in item order."""
        parts = [local_shards[i].reshape(-1).to(dtype)
                 for d in range(self.world_size) for i in self._by_owner[d]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    def unpack_forward(self, recv: torch.Tensor) -> list[torch.Tensor]:
        """Whole [m, n] matrices of `self.owned`, reassembled from every source's rows."""
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in self.owned}
        offset = 0
        for s in range(self.world_size):
            for i in self.owned:
                n_rows, n_cols = self._n_rows(i, s), self.shapes[i][1]
                pieces[i].append(recv[offset:offset + n_rows * n_cols].view(n_rows, n_cols))
                offset += n_rows * n_cols
        if offset != recv.numel():
            raise RuntimeError(f"forward message has {recv.numel()} elements, plan expects {offset}")
        return [torch.cat(pieces[i]) for i in self.owned]

    # backward: owners' updates → row shards, plus a skip flag per matrix
    def backward_splits(self) -> tuple[list[int], list[int]]:
        send = [sum(self._n_rows(i, d) * self.shapes[i][1] + 1 for i in self.owned)
                for d in range(self.world_size)]
        recv = [sum(self._n_rows(i, self.rank) * self.shapes[i][1] + 1 for i in self._by_owner[s])
                for s in range(self.world_size)]
        return send, recv

    def pack_backward(self, updates: Sequence[torch.Tensor], skipped: Sequence[bool],
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`updates[k]` [m, n] and `skipped[k]` belong to `self.owned[k]`."""
        parts = []
        for d in range(self.world_size):
            for k, i in enumerate(self.owned):
                start, end = self.rows[i][d]
                parts.append(updates[k][start:end].reshape(-1).to(dtype))
                parts.append(torch.full((1,), float(skipped[k]), dtype=dtype, device=device))
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)

    def unpack_backward(self, recv: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
        """(local rows of the update [m_r, n], skipped) for every matrix, in item order."""
        rows_of: dict[int, torch.Tensor] = {}
        flag_at: dict[int, int] = {}
        offset = 0
        for s in range(self.world_size):
            for i in self._by_owner[s]:
                n_rows, n_cols = self._n_rows(i, self.rank), self.shapes[i][1]
                rows_of[i] = recv[offset:offset + n_rows * n_cols].view(n_rows, n_cols)
                flag_at[i] = offset + n_rows * n_cols
                offset += n_rows * n_cols + 1
        if offset != recv.numel():
            raise RuntimeError(f"backward message has {recv.numel()} elements, plan expects {offset}")
        # One device→host copy for all flags rather than one sync per matrix.
        flags = recv[torch.tensor([flag_at[i] for i in range(len(self.shapes))], dtype=torch.long,
                                  device=recv.device)].tolist()
        return [(rows_of[i], flags[i] != 0) for i in range(len(self.shapes))]


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """One uneven `all_to_all_single` over `group`."""
    recv = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return recv


def gather_full(local: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """All-gather a row-sharded tensor on every rank (the replicated baseline)."""
    stride = torch.empty(layout.global_shape, device="meta").stride()
    dt = DTensor.from_local(local, layout.mesh, layout.placements, run_check=False,
                            shape=layout.global_shape, stride=stride)
    return dt.full_tensor()
