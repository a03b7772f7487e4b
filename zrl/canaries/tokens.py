"""Rare-token fraction and gibberish heuristic (ZAYA1-8B report §IV-F, Appendix E; docs/algorithms.md §8).

Responsibility (monitors only, no reward gate): per rollout, the fraction of tokens whose id lies in the top X% of the tokenizer's id
range (X in 10/5/2/1% by default), and the gibberish mask: tokens sampled with a logprob more than
2 nats below uniform, log(1/V) - 2, AND lying in the rare band (top 10% of ids).

Conventions: token ids and logprobs are 1-D array-likes (lists, numpy arrays, CPU torch tensors);
V = `vocab_size` is the tokenizer's id range (not a padded embedding size). The rare band for X is
the top round(X·V) ids (at least one), i.e. ids >= V - round(X·V). An empty rollout has fraction 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from zrl.config.schema import Canaries

# The recipe schema's default bands (the one place defaults are written): 10, 5, 2, 1 % of the ids.
RARE_TOKEN_BANDS: tuple[float, ...] = tuple(Canaries.model_fields["rare_token_bands"].default_factory())
GIBBERISH_BAND = 0.10
GIBBERISH_MARGIN_NATS = 2.0


def rare_band_start(vocab_size: int, band: float) -> int:
    """First id of the top `band` fraction of [0, vocab_size)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if not 0.0 < band <= 1.0:
        raise ValueError(f"band must lie in (0, 1], got {band}")
    return vocab_size - max(1, round(band * vocab_size))


def _ids(token_ids: ArrayLike, vocab_size: int) -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got range [{ids.min()}, {ids.max()}]")
    return ids


def rare_token_fractions(token_ids: ArrayLike, vocab_size: int,
                         bands: Sequence[float] = RARE_TOKEN_BANDS) -> dict[float, float]:
    """{band: fraction of the rollout's tokens with id in the top `band` of the id range}."""
    ids = _ids(token_ids, vocab_size)
    if ids.size == 0:
        return {band: 0.0 for band in bands}
    return {band: float(np.mean(ids >= rare_band_start(vocab_size, band))) for band in bands}


def gibberish_mask(token_ids: ArrayLike, logprobs: ArrayLike, vocab_size: int, *,
                   band: float = GIBBERISH_BAND, margin_nats: float = GIBBERISH_MARGIN_NATS) -> np.ndarray:
    """[Tr] bool: logprob < log(1/V) - margin AND id in the top `band` of the id range (CWM heuristic)."""
    ids = _ids(token_ids, vocab_size)
    lps = np.asarray(logprobs, dtype=np.float64)
    if lps.shape != ids.shape:
        raise ValueError(f"logprobs shape {lps.shape} != token ids shape {ids.shape}")
    low = lps < -math.log(vocab_size) - margin_nats
    return low & (ids >= rare_band_start(vocab_size, band))


def gibberish_fraction(token_ids: ArrayLike, logprobs: ArrayLike, vocab_size: int, *,
                       band: float = GIBBERISH_BAND, margin_nats: float = GIBBERISH_MARGIN_NATS) -> float:
    """Fraction of the rollout's tokens flagged by `gibberish_mask` (0 for an empty rollout)."""
    mask = gibberish_mask(token_ids, logprobs, vocab_size, band=band, margin_nats=margin_nats)
    return float(mask.mean()) if mask.size else 0.0
