"""Rare-token fractions and the gibberish heuristic: hand-computed values and edge cases."""

import math

import numpy as np
import pytest
import torch

from zrl.canaries.tokens import (
    RARE_TOKEN_BANDS,
    gibberish_fraction,
    gibberish_mask,
    rare_band_start,
    rare_token_fractions,
)


def test_band_starts():
    assert rare_band_start(1000, 0.10) == 900
    assert rare_band_start(1000, 0.01) == 990
    assert rare_band_start(262_272, 0.02) == 262_272 - 5245  # round(5245.44)
    assert rare_band_start(10, 0.01) == 9  # at least one id
    for bad_v, bad_b in ((0, 0.1), (100, 0.0), (100, 1.5)):
        with pytest.raises(ValueError):
            rare_band_start(bad_v, bad_b)


def test_rare_token_fractions_hand_values():
    ids = [0, 899, 900, 949, 950, 979, 980, 989, 990, 999]
    assert RARE_TOKEN_BANDS == (0.10, 0.05, 0.02, 0.01)
    # >= 900: 8 ids, >= 950: 6, >= 980: 4, >= 990: 2
    assert rare_token_fractions(ids, 1000) == {0.10: 0.8, 0.05: 0.6, 0.02: 0.4, 0.01: 0.2}
    assert rare_token_fractions(torch.tensor(ids), 1000, bands=(0.5,)) == {0.5: 0.9}  # all but id 0
    assert rare_token_fractions([], 1000) == {b: 0.0 for b in RARE_TOKEN_BANDS}
    with pytest.raises(ValueError, match="lie in"):
        rare_token_fractions([1000], 1000)


def test_gibberish_mask_needs_low_logprob_and_rare_id():
    v = 1000
    floor = -math.log(v) - 2.0  # -8.9078
    ids = [950, 950, 100, 999, 900]
    lps = [floor - 0.1, floor + 0.1, -12.0, -20.0, floor]
    assert gibberish_mask(ids, lps, v).tolist() == [True, False, False, True, False]
    assert gibberish_fraction(ids, lps, v) == pytest.approx(2 / 5)
    assert gibberish_fraction(np.array([], dtype=int), [], v) == 0.0
    # a narrower band excludes 950
    assert gibberish_mask(ids, lps, v, band=0.01).tolist() == [False, False, False, True, False]
    with pytest.raises(ValueError, match="shape"):
        gibberish_mask(ids, lps[:2], v)
