"""Document layout of a packed token stream: boundaries, positions and offsets inside documents.

The model runs on one flat stream of T tokens made of N documents laid end to end (`cu_seqlens`,
the cumulative lengths [0, len_0, len_0 + len_1, ..., T]). Everything that mixes neighbouring tokens
(attention, the two CCA convolutions, the delayed value half) must restart at each boundary so that a
packed batch gives exactly what running each document alone gives. `PackedLayout` holds the few
index tensors those operations need, computed once per forward and shared by all layers.

Invariants: documents are non-empty and cover [0, T) in order; `positions` restart at 0 at every
boundary unless the caller supplied its own position ids; one host synchronisation per layout
(`seq_lens` is a Python tuple, used to slice documents for attention).
"""

from __future__ import annotations

import dataclasses

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
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    row_length: int | None = None,
) -> PackedLayout:
    """Layout of T tokens: boundaries from `cu_seqlens`, else from `position_ids`, else rows/one doc.

    `row_length` marks the [B, S] form (rows of S tokens, flattened): each row is at least one document.
    When both `cu_seqlens` and `position_ids` are given, boundaries come from the former and RoPE
    positions from the latter.
    """
    if cu_seqlens is None:
        if position_ids is not None:
            cu_seqlens = cu_seqlens_from_position_ids(
                position_ids if row_length is None else position_ids.reshape(-1, row_length))
        else:
            step = row_length or num_tokens
            cu_seqlens = torch.arange(0, num_tokens + 1, step, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.int64).flatten()  # [N + 1]
    bounds = cu.tolist()
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at the token count {num_tokens}, got {bounds}")
    lens = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if min(lens) < 0:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    if min(lens) == 0:
        # An empty document has no tokens to compute; dropping it keeps the per-document loops simple.
        cu = torch.unique_consecutive(cu)
        lens = [n for n in lens if n > 0]
    seq_lens = torch.tensor(lens, device=device)  # [N]
    doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device), seq_lens)  # [T]
    token_idx = torch.arange(num_tokens, device=device)  # [T]
    doc_offset = token_idx - cu[doc_ids]
    if position_ids is not None:
        positions = position_ids.reshape(-1).to(device=device, dtype=torch.int64)
        if positions.numel() != num_tokens:
            raise ValueError(f"position_ids has {positions.numel()} entries for {num_tokens} tokens")
    else:
        positions = doc_offset
    doc_start = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    doc_start[cu[:-1]] = True
    return PackedLayout(
        cu_seqlens=cu,
        seq_lens=tuple(lens),
        positions=positions,
        doc_start=doc_start,
        doc_offset=doc_offset,
    )
