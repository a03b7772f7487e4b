"""Document layout of a packed token stream: boundaries, positions and offsets inside documents.

The model runs on one flat stream of T tokens made of N documents laid end to end (`cu_seqlens`,
the cumulative lengths [0, len_0, len_0 + len_1, ..., T]). Everything that mixes neighbouring tokens
(attention, the two CCA convolutions, the delayed value half) must restart at each boundary so that a
packed batch gives exactly what running each document alone gives. `PackedLayout` holds the few
index tensors those operations need, computed once per forward and shared by all layers.

Invariants: documents are non-empty and cover [0, T) in order; `positions` restart at 0 at every
boundary unless the caller supplied its own position ids.

Host synchronisation: the boundaries are needed on the host (`seq_lens` is a Python tuple, used to
slice documents for attention), so the layout is built from host values. Boundaries given as Python
ints (the trainer's packer has them) cost no synchronisation; given as a device tensor, or derived
from position ids, they are read back once per layout. Host data reaches the device through
`copy_to_device`, never a blocking copy (which waits for the whole stream on CUDA).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Per-forward index tensors for a packed stream (T tokens, N documents, P = conv history)."""

    cu_seqlens: torch.Tensor  # [N + 1] int64, 0 .. T
    seq_lens: tuple[int, ...]  # N document lengths on the host
    positions: torch.Tensor  # [T] int64 RoPE position of each token
    doc_start: torch.Tensor  # [T] bool, True at the first token of each document
    doc_offset: torch.Tensor  # [T] int64, tokens since the start of the token's document (0 at a start)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_docs(self) -> int:
        return len(self.seq_lens)

    @property
    def uniform_seq_len(self) -> int | None:
        """The common document length when all are equal (attention then runs as one batch)."""
        return self.seq_lens[0] if len(set(self.seq_lens)) == 1 else None


def copy_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without making the host wait for the device.

    A blocking host-to-CUDA copy (`.to(device)`, `torch.tensor(data, device=...)`) synchronises the
    stream after the copy; an asynchronous one from pinned memory does not, and the caching host
    allocator keeps the pinned block until the copy has run. (To the CPU it is no copy at all.)
    """
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a packed stream whose position ids restart at 0 for each document.

    `position_ids` is [T] (one stream) or [B, S] (each row also starts a document). Within a document
    positions must increase by exactly one; a stream that does not start at 0 starts a document anyway.
    """
    if position_ids.dim() not in (1, 2):
        raise ValueError(f"position_ids must be [T] or [B, S], got shape {tuple(position_ids.shape)}")
    pos = position_ids.reshape(-1).to(torch.int64)  # [T]
    starts = pos == 0
    starts[0] = True
    if position_ids.dim() == 2:
        starts[:: position_ids.shape[1]] = True
    continues = ~starts[1:]
    if bool((pos[1:][continues] != pos[:-1][continues] + 1).any()):
        raise ValueError("position_ids must increase by 1 inside a document and restart at 0 for the next one")
    bounds = torch.nonzero(starts).flatten()
    return torch.cat([bounds, bounds.new_tensor([pos.numel()])])


def build_layout(
    num_tokens: int,
    *,
    device: torch.device,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    position_ids: torch.Tensor | None = None,
    row_length: int | None = None,
) -> PackedLayout:
    """Layout of T tokens: boundaries from `cu_seqlens`, else from `position_ids`, else rows/one doc.

    `cu_seqlens` is [N + 1]: Python ints (no synchronisation) or a tensor (read to the host once).
    `row_length` marks the [B, S] form (rows of S tokens, flattened): each row is at least one document.
    When both `cu_seqlens` and `position_ids` are given, boundaries come from the former and RoPE
    positions from the latter.
    """
    if cu_seqlens is None:
        if position_ids is not None:
            cu_seqlens = cu_seqlens_from_position_ids(
                position_ids if row_length is None else position_ids.reshape(-1, row_length))
        else:
            cu_seqlens = range(0, num_tokens + 1, row_length or max(num_tokens, 1))
    if isinstance(cu_seqlens, torch.Tensor):
        bounds = cu_seqlens.flatten().tolist()  # the one host read of a tensor given boundaries
    else:
        bounds = [int(b) for b in cu_seqlens]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at the token count {num_tokens}, got {bounds}")
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if min(lens) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    # An empty document has no tokens to compute; dropping it keeps the per-document loops simple.
    bounds = bounds[:1] + [b for b, n in zip(bounds[1:], lens) if n > 0]
    lens = [n for n in lens if n > 0]
    cu = copy_to_device(torch.tensor(bounds, dtype=torch.int64), device)  # [N + 1]
    doc_start = torch.zeros(num_tokens, dtype=torch.bool, device=device)  # [T]
    doc_start[cu[:-1]] = True
    doc_ids = torch.cumsum(doc_start, dim=0) - 1  # [T] index of each token's document
    doc_offset = torch.arange(num_tokens, device=device) - cu[doc_ids]  # [T]
    if position_ids is not None:
        positions = position_ids.reshape(-1).to(device=device, dtype=torch.int64)
        if positions.numel() != num_tokens:
            raise ValueError(f"position_ids has {positions.numel()} entries for {num_tokens} tokens")
    else:
        positions = doc_offset
    return PackedLayout(
        cu_seqlens=cu,
        seq_lens=tuple(lens),
        positions=positions,
        doc_start=doc_start,
        doc_offset=doc_offset,
    )
