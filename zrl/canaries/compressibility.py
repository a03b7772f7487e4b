"""Streaming LZ77 compressibility canary and its reward-zeroing gate (ZAYA1-8B report §IV-F, eq. 16).

Specification: docs/algorithms.md §8. Shapes: a rollout's token ids are [Tr] (docs/shapes.md).

Responsibility: per rollout, encode token ids as fixed-width little-endian bytes, cut them into
chunks of C tokens (a short final chunk is merged into the previous one), feed the chunks to ONE
stateful raw-deflate compressor `zlib.compressobj(1, zlib.DEFLATED, -10)` with a Z_SYNC_FLUSH after
each, and report r_c = max(0, len(out_c) - OVH) / len(chunk bytes), OVH = the size of a sync flush on
an empty stream (measured once, lazily; 5 bytes with stock zlib). A rollout is flagged when any
r_c < tau, and a flagged rollout's task reward is zeroed before advantages.

Chosen constants, calibrated with `python -m zrl.canaries.calibration` (a loop of P uniform random
ids over a 262,272-id vocabulary, after 2C + phase random tokens, phases 0, 4, ..., C - 4, 2,048
looping tokens; zlib 1.2.13; 2-core x86_64 CPU, 2026-11-21):
- BYTES_PER_TOKEN = 3 (ids < 2^24, any current vocabulary; ZAYA1 has 262,272 ids, so 2 bytes cannot
  hold them). deflate's usable window at wbits=-10 is 1024 - 262 = 762 bytes = 254 tokens at 3 B
  (190 at 4 B): every period 1..254 is detected, 255+ never (measured: the boundary is exact).
- CHUNK_TOKENS = 64. Level-1 deflate does not index strings inside its matches, so on a long loop the
  per-chunk ratio is bimodal: chunks either sit at the copy floor or stay high. At C = 64 every
  period <= 254 reaches the floor within P + 2C looping tokens at every phase (worst 380 tokens,
  P = 254). At C = 128 periods 67-69, 85 and 133-189 are missed at some phase; at C = 256 most
  periods from 17 up are missed; 4 B, C = 256, tau = 0.1 (the recipe schema's earlier LZ77Canary
  defaults) misses most periods from 31 up. C = 32 lifts the floor to 0.042, too close
  to tau.
- REPEAT_THRESHOLD = 0.05 (the report's production tau). At 3 B, C = 64: the in-loop minimum is
  <= 0.021 for every detected period; uniform random ids give >= 1.026 (64 rollouts x 4,096 tokens;
  0.887 at 4 B); iid Zipf ids 0.21 (a = 2) to 0.6; uniform ids over 16 ids 0.36. Word-level English
  technical text (the papers this project implements, ids by frequency rank or a random permutation) has its 0.1%
  quantile at 0.053-0.065, and its chunks below 0.05 (0.06-0.11%) are literal copies: repeated URLs,
  markdown table rules, duplicated LaTeX table cells. The in-loop values are bimodal: tau = 0.025
  and 0.03 detect the same periods with the same worst latency (380 tokens); 0.05 is kept.
Limits: loops longer than 254 tokens are invisible to this window; the first chunk of a rollout has no
history, so a rollout shorter than one chunk is only flagged if it repeats within itself.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from zrl.config.schema import LZ77Canary

# The calibrated values above are the recipe schema's defaults (the one place defaults are written).
BYTES_PER_TOKEN = LZ77Canary.model_fields["bytes_per_token"].default
CHUNK_TOKENS = LZ77Canary.model_fields["chunk_tokens"].default
REPEAT_THRESHOLD = LZ77Canary.model_fields["threshold"].default
ZLIB_LEVEL = 1
ZLIB_WBITS = -10  # raw deflate, 2^10-byte window


@functools.cache
def sync_flush_overhead_bytes() -> int:
    """Bytes a Z_SYNC_FLUSH emits on an empty stream with our settings (measured once per process)."""
    return len(zlib.compressobj(ZLIB_LEVEL, zlib.DEFLATED, ZLIB_WBITS).flush(zlib.Z_SYNC_FLUSH))


def token_bytes(token_ids: ArrayLike, bytes_per_token: int = BYTES_PER_TOKEN) -> bytes:
    """Little-endian fixed-width encoding of token ids [Tr] -> Tr · bytes_per_token bytes."""
    if bytes_per_token not in (1, 2, 3, 4):
        raise ValueError(f"bytes_per_token must be 1-4, got {bytes_per_token}")
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {ids.shape}")
    if ids.size == 0:
        return b""
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
    limit = 256 ** bytes_per_token
    if ids.min() < 0 or ids.max() >= limit:
        raise ValueError(f"token ids must lie in [0, {limit}) for {bytes_per_token} bytes/token, "
                         f"got range [{ids.min()}, {ids.max()}]")
    # [Tr, 4] little-endian bytes, keep the low `bytes_per_token` of each id
    le = ids.astype("<u4").view(np.uint8).reshape(-1, 4)
    return le[:, :bytes_per_token].tobytes()


class StreamingCompressibility:
    """Chunk ratios of one rollout fed incrementally (e.g. while it is generated).

    `feed` returns the ratios of the chunks it completed; `finish` returns the last one. A chunk is
    only emitted once at least C more tokens are pending, so the final short chunk can be merged.
    """

    def __init__(self, *, bytes_per_token: int = BYTES_PER_TOKEN, chunk_tokens: int = CHUNK_TOKENS) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.bytes_per_token = bytes_per_token
        self.chunk_tokens = chunk_tokens
        self._compressor = zlib.compressobj(ZLIB_LEVEL, zlib.DEFLATED, ZLIB_WBITS)
        self._pending = bytearray()
        self._finished = False

    def _chunk_ratio(self, chunk: bytes) -> float:
        out = len(self._compressor.compress(chunk)) + len(self._compressor.flush(zlib.Z_SYNC_FLUSH))
        return max(0, out - sync_flush_overhead_bytes()) / len(chunk)

    def feed(self, token_ids: ArrayLike) -> list[float]:
        if self._finished:
            raise RuntimeError("feed after finish")
        self._pending += token_bytes(token_ids, self.bytes_per_token)
        chunk_bytes = self.chunk_tokens * self.bytes_per_token
        ratios = []
        while len(self._pending) >= 2 * chunk_bytes:
            ratios.append(self._chunk_ratio(bytes(self._pending[:chunk_bytes])))
            del self._pending[:chunk_bytes]
        return ratios

    def finish(self) -> list[float]:
        """Ratio of the last chunk (C to 2C - 1 tokens, or the whole rollout if shorter); [] if empty."""
        if self._finished:
            raise RuntimeError("finish called twice")
        self._finished = True
        if not self._pending:
            return []
        ratio = self._chunk_ratio(bytes(self._pending))
        self._pending.clear()
        return [ratio]


def chunk_ratios(token_ids: ArrayLike, *, bytes_per_token: int = BYTES_PER_TOKEN,
                 chunk_tokens: int = CHUNK_TOKENS) -> np.ndarray:
    """Per-chunk compression ratios r_c of one rollout, [num_chunks] float64 ([] for an empty rollout)."""
    stream = StreamingCompressibility(bytes_per_token=bytes_per_token, chunk_tokens=chunk_tokens)
    ratios = stream.feed(token_ids) + stream.finish()
    return np.asarray(ratios, dtype=np.float64)


@dataclass(frozen=True)
class CompressibilityReport:
    ratios: np.ndarray  # [num_chunks] r_c
    min_ratio: float  # min r_c; +inf for an empty rollout
    flagged: bool  # any r_c < threshold


def compressibility_report(token_ids: ArrayLike, *, threshold: float = REPEAT_THRESHOLD,
                           bytes_per_token: int = BYTES_PER_TOKEN,
                           chunk_tokens: int = CHUNK_TOKENS) -> CompressibilityReport:
    """Ratios, their minimum and the repetition flag of one rollout."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
    ratios = chunk_ratios(token_ids, bytes_per_token=bytes_per_token, chunk_tokens=chunk_tokens)
    min_ratio = float(ratios.min()) if ratios.size else float("inf")
    return CompressibilityReport(ratios=ratios, min_ratio=min_ratio, flagged=min_ratio < threshold)


def repetition_gate(reward: float, flagged: bool) -> float:
    """Task reward after the repetition gate: 0 for a flagged rollout, unchanged otherwise."""
    return 0.0 if flagged else reward
