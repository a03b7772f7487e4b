"""Engine/trainer mismatch statistics: hand values, numpy parity, merging, empty and constant inputs."""

import math

import numpy as np
import pytest
import torch

from zrl.canaries.mismatch import MismatchStats, merge_mismatch_sums, mismatch_stats, mismatch_sums

D = torch.float64


def test_identical_inputs():
    lp = torch.log(torch.tensor([0.9, 0.5, 0.01], dtype=D))
    s = mismatch_stats(lp, lp.clone())
    assert (s.num_tokens, s.kl_k1, s.kl_k3, s.mean_abs_prob_diff, s.max_abs_prob_diff) == (3, 0.0, 0.0, 0.0, 0.0)
    assert s.pearson_prob == pytest.approx(1.0) and s.pearson_logprob == pytest.approx(1.0)


def test_hand_values():
    lp = torch.log(torch.tensor([0.5, 0.25], dtype=D))
    lq = torch.log(torch.tensor([0.25, 0.5], dtype=D))
    s = mismatch_stats(lp, lq)
    # log ρ = ±ln 2: k1 = mean(-log ρ) = 0; k3 = mean(2 - 1 - ln 2, 0.5 - 1 + ln 2) = 0.25
    assert s.kl_k1 == pytest.approx(0.0, abs=1e-15)
    assert s.kl_k3 == pytest.approx(0.25)
    assert s.pearson_prob == pytest.approx(-1.0) and s.pearson_logprob == pytest.approx(-1.0)
    assert s.mean_abs_prob_diff == pytest.approx(0.25) and s.max_abs_prob_diff == pytest.approx(0.25)


def test_matches_numpy_on_random_tokens_and_masks():
    g = torch.Generator().manual_seed(0)
    lq = torch.log_softmax(torch.randn(200, 50, generator=g, dtype=D), -1)[:, 0]
    lp = lq + 0.01 * torch.randn(200, generator=g, dtype=D)
    mask = torch.rand(200, generator=g) > 0.3
    s = mismatch_stats(lp, lq, mask)
    x, y = lp[mask].numpy(), lq[mask].numpy()
    assert s.num_tokens == int(mask.sum())
    assert s.kl_k1 == pytest.approx(np.mean(y - x), rel=1e-10)
    rho = np.exp(x - y)
    assert s.kl_k3 == pytest.approx(np.mean(rho - 1 - np.log(rho)), rel=1e-10)
    assert s.pearson_prob == pytest.approx(np.corrcoef(np.exp(x), np.exp(y))[0, 1], abs=1e-12)
    assert s.pearson_logprob == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
    assert s.max_abs_prob_diff == pytest.approx(np.max(np.abs(np.exp(x) - np.exp(y))))


def test_merge_microbatches_equals_whole():
    g = torch.Generator().manual_seed(1)
    lq = -torch.rand(30, generator=g, dtype=D) * 3
    lp = lq + 0.05 * torch.randn(30, generator=g, dtype=D)
    whole = mismatch_stats(lp, lq)
    parts = [mismatch_sums(lp[s], lq[s]) for s in (slice(0, 7), slice(7, 7), slice(7, 30))]
    merged = MismatchStats.from_sums(merge_mismatch_sums(parts))
    for k, v in whole.as_metrics().items():
        assert merged.as_metrics()[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_empty_and_fully_masked_inputs_are_nan():
    e = torch.empty(0, dtype=D)
    for s in (mismatch_stats(e, e), mismatch_stats(torch.zeros(3), torch.zeros(3), torch.zeros(3, dtype=torch.bool))):
        assert s.num_tokens == 0
        assert all(math.isnan(v) for k, v in s.as_metrics().items() if k != "num_tokens")


def test_zero_variance():
    const = torch.full((4,), math.log(0.5), dtype=D)
    varying = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=D))
    s = mismatch_stats(const, varying)
    assert math.isnan(s.pearson_prob) and math.isnan(s.pearson_logprob)
    assert math.isfinite(s.kl_k1) and math.isfinite(s.kl_k3)
    other = torch.full((4,), math.log(0.25), dtype=D)
    assert math.isnan(mismatch_stats(const, other).pearson_prob)
    assert mismatch_stats(const, const.clone()).pearson_prob == 1.0


def test_bf16_inputs_and_shape_errors():
    lp = torch.log(torch.tensor([0.5, 0.3, 0.2])).bfloat16()
    s = mismatch_stats(lp, lp.float())
    assert s.num_tokens == 3 and s.kl_k3 == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="shapes differ"):
        mismatch_stats(lp, lp[:2])
    with pytest.raises(ValueError, match="loss_mask"):
        mismatch_stats(lp, lp, torch.ones(2, dtype=torch.bool))
