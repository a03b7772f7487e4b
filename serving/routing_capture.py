"""Worker-side store of the routing captured from every engine step, per request and token position.

Each step hands over the chosen expert of every MoE layer for every token the forward computed
([T, L] uint8, T = the tokens of the step), the token positions and which request owns which span of
rows. Rows are written at (request, position), so chunked prefill, any batch composition and
recomputation after preemption (which writes the same positions again, counted in `recomputed_rows`)
all land where they belong.
Positions never computed keep zrl.types.NO_ROUTE (255, "no record").

Storage is paged: requests own fixed-size pages of one shared uint8 pool, so memory follows the
tokens actually in flight, and a step is recorded with a few vectorised numpy operations whatever
the number of requests (a Python loop runs only over requests that cross into a new page).

With prefix caching, a request that reuses cached KV blocks never computes their positions; their rows
are those recorded when the blocks were computed. The recorder then also keeps every recorded row per
physical KV slot (block id x block size + offset in the attention group's block table) and, the first time
a request runs from position p > 0, copies rows 0..p-1 from the slots its block table names. A step's own
rows are stored before any copy, so a hit on blocks computed in the same step reads them too.

`record_later` takes a step's routing and positions as device tensors without waiting for the device:
on CUDA they are copied into pinned host memory with non_blocking copies on the compute stream (so
ordered after the forward that wrote them and before the runner reuses its buffers), and the step is
recorded at the next step or before anything is read, whichever comes first. The engine step's host
thread therefore goes on launching the sampler while the copies run.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from zrl.types import NO_ROUTE


class _HostCopy:
    """A tensor on its way to host memory; `numpy()` waits for it. CUDA: a non_blocking copy into pinned
    memory on the current stream plus an event; elsewhere an immediate copy (the source is a buffer the
    runner reuses)."""

    def __init__(self, x: torch.Tensor) -> None:
        self._done = None
        if x.is_cuda:
            self._host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = x.detach().clone()

    def numpy(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        return self._host.numpy()


class RoutingRecorder:
    def __init__(self, num_layers: int, max_positions: int, page_rows: int = 128,
                 kv_block_size: int | None = None) -> None:
        """kv_block_size: the attention group's KV block size when prefix caching is on (module docstring)."""
        self.num_layers = num_layers
        self.page_rows = page_rows
        self.kv_block_size = kv_block_size
        self.cached_rows = 0  # rows copied from the KV-slot store for prefix-cache hits
        self._by_kv_slot = np.full((0, num_layers), NO_ROUTE, np.uint8)  # [KV slots, L]
        self.max_pages = -(-max_positions // page_rows)
        self.recomputed_rows = 0
        self._pool = np.full((0, page_rows, num_layers), NO_ROUTE, np.uint8)  # [pages, rows, L]
        self._free_pages: list[int] = []
        self._slots: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._page_table = np.full((0, self.max_pages), -1, np.int64)  # [slots, max_pages]
        self._num_pages = np.zeros(0, np.int64)  # [slots]
        self._computed = np.zeros(0, np.int64)  # [slots] highest computed position + 1
        self._pending: list[tuple] = []  # steps not yet recorded: record's arguments, tensors as _HostCopy

    def record_later(self, req_ids: list[str], query_start_loc: np.ndarray, positions: torch.Tensor,
                     routing: torch.Tensor, kv_blocks: np.ndarray | None = None) -> None:
        """As `record`, with positions [T] and routing [T, L] still on the device (module docstring)."""
        self._record_pending()
        self._pending.append((list(req_ids), query_start_loc.copy(), _HostCopy(positions), _HostCopy(routing),
                              None if kv_blocks is None else kv_blocks.copy()))

    def _record_pending(self) -> None:
        pending, self._pending = self._pending, []
        for req_ids, qsl, positions, routing, kv_blocks in pending:
            self.record(req_ids, qsl, positions.numpy(), routing.numpy(), kv_blocks)

    def record(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray,
               routing: np.ndarray, kv_blocks: np.ndarray | None = None) -> None:
        """routing [T, L] and positions [T] of one forward; request r owns rows qsl[r]:qsl[r + 1].

        kv_blocks [N, W]: each request's KV block ids (its block-table row, at least up to its last
        position), given when prefix caching is on.
        """
        self._record_pending()
        lengths = np.diff(query_start_loc)
        if (lengths <= 0).any():
            keep = lengths > 0
            req_ids = [r for r, k in zip(req_ids, keep) if k]
            query_start_loc = np.concatenate([[0], np.cumsum(lengths[keep])])
            kv_blocks = None if kv_blocks is None else kv_blocks[keep]
            lengths = lengths[keep]
        if not req_ids:
            return
        slots = np.fromiter((self._slot(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        positions = positions.astype(np.int64, copy=False)
        last = np.maximum.reduceat(positions, query_start_loc[:-1])  # [N] (requests)
        if int(last.max()) >= self.max_pages * self.page_rows:
            raise ValueError(f"position {int(last.max())} beyond the recorder's {self.max_pages * self.page_rows}")
        needed = last // self.page_rows + 1
        for i in np.nonzero(needed > self._num_pages[slots])[0]:
            self._add_pages(int(slots[i]), int(needed[i]))
        token_slots = np.repeat(slots, lengths)  # [T]
        self.recomputed_rows += int((positions < self._computed[token_slots]).sum())
        self._write(token_slots, positions, routing)
        if kv_blocks is not None:
            self._through_kv_slots(slots, lengths, positions[query_start_loc[:-1]], positions, routing, kv_blocks)
        np.maximum.at(self._computed, token_slots, positions + 1)

    def _write(self, token_slots: np.ndarray, positions: np.ndarray, rows: np.ndarray) -> None:
        pages = self._page_table[token_slots, positions // self.page_rows]
        self._pool[pages, positions % self.page_rows] = rows

    def _through_kv_slots(self, slots: np.ndarray, lengths: np.ndarray, first: np.ndarray, positions: np.ndarray,
                          routing: np.ndarray, kv_blocks: np.ndarray) -> None:
        """Store the step's rows by KV slot, then give each new request whose first position is p > 0 (a
        prefix-cache hit) the rows of positions 0..p-1 from the slots its block table names."""
        size = self.kv_block_size
        kv_slots = kv_blocks[np.repeat(np.arange(len(slots)), lengths), positions // size] * size + positions % size
        needed = (int(kv_blocks.max()) + 1) * size  # every slot the step's block tables name
        if needed > len(self._by_kv_slot):
            grown = np.full((max(needed, 2 * len(self._by_kv_slot)), self.num_layers), NO_ROUTE, np.uint8)
            grown[: len(self._by_kv_slot)] = self._by_kv_slot
            self._by_kv_slot = grown
        self._by_kv_slot[kv_slots] = routing
        for i in np.nonzero((self._computed[slots] == 0) & (first > 0))[0]:
            cached = np.arange(int(first[i]))
            self._write(np.full(len(cached), slots[i]), cached,
                        self._by_kv_slot[kv_blocks[i, cached // size] * size + cached % size])
            self.cached_rows += len(cached)

    def positions_computed(self, req_id: str) -> int:
        """Highest computed position + 1 of a request so far (0 if none; recomputation does not lower it)."""
        self._record_pending()
        slot = self._slots.get(req_id)
        return 0 if slot is None else int(self._computed[slot])

    def pop(self, req_id: str) -> np.ndarray:
        """[positions computed, L] uint8 table of the request, releasing its pages (empty if unknown)."""
        self._record_pending()
        slot = self._slots.pop(req_id, None)
        if slot is None:
            return np.full((0, self.num_layers), NO_ROUTE, np.uint8)
        pages = self._page_table[slot, : self._num_pages[slot]]
        table = self._pool[pages].reshape(-1, self.num_layers)[: self._computed[slot]].copy()
        self._pool[pages] = NO_ROUTE
        self._free_pages.extend(pages.tolist())
        self._page_table[slot] = -1
        self._num_pages[slot] = 0
        self._computed[slot] = 0
        self._free_slots.append(slot)
        return table

    def discard(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.pop(req_id)

    def __len__(self) -> int:
        self._record_pending()
        return len(self._slots)

    def _slot(self, req_id: str) -> int:
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free_slots:
                grow = max(16, len(self._num_pages))
                start = len(self._num_pages)
                self._page_table = np.concatenate([self._page_table, np.full((grow, self.max_pages), -1, np.int64)])
                self._num_pages = np.concatenate([self._num_pages, np.zeros(grow, np.int64)])
                self._computed = np.concatenate([self._computed, np.zeros(grow, np.int64)])
                self._free_slots.extend(range(start + grow - 1, start - 1, -1))
            slot = self._slots[req_id] = self._free_slots.pop()
        return slot

    def _add_pages(self, slot: int, total: int) -> None:
        while self._num_pages[slot] < total:
            if not self._free_pages:
                grow = max(16, len(self._pool))
                start = len(self._pool)
                self._pool = np.concatenate(
                    [self._pool, np.full((grow, self.page_rows, self.num_layers), NO_ROUTE, np.uint8)])
                self._free_pages.extend(range(start + grow - 1, start - 1, -1))
            self._page_table[slot, self._num_pages[slot]] = self._free_pages.pop()
            self._num_pages[slot] += 1
