"""Token-level trust regions: masks by hand, the DPPO gradient by autograd, stats, and mask properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zrl.algorithms.trust_region import (
    TRUST_REGION_NAMES,
    TrustRegionStats,
    binary_kl,
    binary_kl_keep_mask,
    binary_tv_keep_mask,
    dppo_binary_kl_loss,
    dppo_binary_tv_loss,
    policy_loss,
    ppo_clip_loss,
    truncated_is_weight,
)

D = torch.float64

# (p, q, A) and whether Binary-TV with delta = 0.1 keeps the token.
TV_CASES = [
    (0.50, 0.30, 1.0, False),   # p - q = 0.2 > delta, pushed further up
    (0.35, 0.30, 1.0, True),    # inside the region
    (0.10, 0.30, 1.0, True),    # far below q but A > 0 pushes back towards q
    (0.10, 0.30, -1.0, False),  # p - q = -0.2 < -delta, pushed further down
    (0.50, 0.30, -1.0, True),   # far above q but A < 0 pushes back towards q
    (0.90, 0.30, 0.0, True),    # A = 0 is never masked
    (0.25, 0.30, -1.0, True),   # inside the region
    (0.4001, 0.30, 2.0, False),  # just past +delta
    (0.3999, 0.30, 2.0, True),   # just inside +delta
    (0.1999, 0.30, -2.0, False),  # just past -delta
    (0.2001, 0.30, -2.0, True),   # just inside -delta
]


def _tensors(cases):
    p = torch.tensor([c[0] for c in cases], dtype=D)
    q = torch.tensor([c[1] for c in cases], dtype=D)
    a = torch.tensor([c[2] for c in cases], dtype=D)
    keep = torch.tensor([c[3] for c in cases])
    return p.log(), q.log(), a, keep


def test_binary_tv_mask_hand_cases():
    lp, lq, a, keep = _tensors(TV_CASES)
    assert torch.equal(binary_tv_keep_mask(lp, lq, a, delta=0.1), keep)


def test_binary_tv_loss_values_and_masking():
    lp, lq, a, keep = _tensors(TV_CASES)
    mask = torch.ones_like(keep)
    out = dppo_binary_tv_loss(lp, lq, a, mask, delta=0.1)
    expected = [(-c[2] * (c[0] / c[1]) * math.log(c[0]) if c[3] else 0.0) for c in TV_CASES]
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor(expected, dtype=D), rtol=1e-12, atol=1e-12)
    assert torch.equal(out.keep_mask, keep)


def _logits_setup(seed=0, t=6, v=5):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(t, v, generator=g, dtype=D, requires_grad=True)
    y = torch.randint(0, v, (t,), generator=g)
    # behaviour policy: a perturbed copy of theta (stale weights)
    lq = torch.log_softmax(theta.detach() + 0.3 * torch.randn(t, v, generator=g, dtype=D), -1)[torch.arange(t), y]
    return theta, y, lq


def test_dppo_gradient_is_a_grad_p_over_q_on_kept_tokens():
    theta, y, lq = _logits_setup(seed=1)  # token 3 has p - q = -0.165 with A < 0: masked
    t = y.numel()
    a = torch.tensor([1.0, -1.0, 0.5, -2.0, 0.0, 1.5], dtype=D)
    loss_mask = torch.tensor([True, True, True, True, True, False])
    lp = torch.log_softmax(theta, -1)[torch.arange(t), y]
    out = dppo_binary_tv_loss(lp, lq, a, loss_mask, delta=0.1)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), theta)
    # reference: sum over kept tokens of -A_t · p_t / q_t, whose gradient is -A_t ∇p_t / q_t
    p = torch.softmax(theta, -1)[torch.arange(t), y]
    keep = out.keep_mask.to(D)
    ref = (-(a * keep) * p / lq.exp()).sum()
    (ref_grad,) = torch.autograd.grad(ref, theta)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert out.keep_mask.tolist() == [True, True, True, False, True, False]  # 5: outside the loss mask
    assert grad.abs().sum() > 0


def test_dppo_gradient_with_is_cap_uses_capped_weight():
    theta, y, lq = _logits_setup(seed=0)  # p/q = 1.37 1.88 1.14 0.87 1.25 0.78
    t = y.numel()
    a = torch.ones(t, dtype=D)
    lp = torch.log_softmax(theta, -1)[torch.arange(t), y]
    cap = 1.2
    out = dppo_binary_tv_loss(lp, lq, a, torch.ones(t, dtype=torch.bool), delta=1.0, is_cap=cap)
    (grad,) = torch.autograd.grad(out.token_loss.sum(), theta, retain_graph=True)
    w = (lp.detach() - lq).exp().clamp(max=cap)
    (ref_grad,) = torch.autograd.grad((-a * w * lp).sum(), theta)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    m = out.stats.as_metrics()
    assert m["is_weight_max"] <= cap
    assert m["is_capped_frac"] == pytest.approx(3 / 6)


def test_masked_positions_with_inf_padding_give_zero_loss_and_finite_grad():
    lp = torch.tensor([-1.0, -float("inf"), -0.5], dtype=D, requires_grad=True)
    lq = torch.tensor([-1.1, -float("inf"), float("nan")], dtype=D)  # ratio 1.105: inside every region
    a = torch.tensor([1.0, float("nan"), 1.0], dtype=D)
    mask = torch.tensor([True, False, False])
    for name in TRUST_REGION_NAMES:
        out = policy_loss(name, lp, lq, a, mask)
        assert torch.isfinite(out.token_loss).all()
        assert out.token_loss[1:].eq(0).all()
        (grad,) = torch.autograd.grad(out.token_loss.sum(), lp)
        assert torch.isfinite(grad).all() and grad[1:].eq(0).all() and grad[0] != 0
        assert out.stats.as_metrics()["num_tokens"] == 1


def test_truncated_is_weight_is_detached_and_capped():
    lp = torch.tensor([0.0, -3.0], dtype=D, requires_grad=True)
    lq = torch.tensor([-2.0, -1.0], dtype=D)
    w = truncated_is_weight(lp, lq, is_cap=5.0)
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([5.0, math.exp(-2.0)], dtype=D))
    with pytest.raises(ValueError):
        truncated_is_weight(lp, lq, is_cap=0.0)


def test_binary_kl_values_and_edges():
    p = torch.tensor([0.5, 0.35, 0.3, 0.5, 1.0], dtype=D)
    q = torch.tensor([0.3, 0.3, 0.3, 1.0, 0.5], dtype=D)
    kl = binary_kl(p.log(), q.log())
    expect0 = 0.3 * math.log(0.3 / 0.5) + 0.7 * math.log(0.7 / 0.5)  # 0.082283
    expect1 = 0.3 * math.log(0.3 / 0.35) + 0.7 * math.log(0.7 / 0.65)  # 0.005631
    torch.testing.assert_close(kl[:4], torch.tensor([expect0, expect1, 0.0, math.log(2.0)], dtype=D))
    assert kl[4] == float("inf")  # p = 1 while q < 1
    assert not torch.isnan(kl).any()


def test_binary_kl_mask_hand_cases():
    p = torch.tensor([0.5, 0.35, 0.1, 0.1, 0.5, 0.9], dtype=D)
    q = torch.full((6,), 0.3, dtype=D)
    a = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0], dtype=D)
    # KL: 0.0823 (>0.05, p>q, A>0: drop), 0.0056 (keep), large but A>0 & p<q (keep),
    # large with A<0 & p<q (drop), p>q with A<0 (keep), A=0 (keep)
    keep = binary_kl_keep_mask(p.log(), q.log(), a, delta=0.05)
    assert keep.tolist() == [False, True, True, False, True, True]
    out = dppo_binary_kl_loss(p.log(), q.log(), a, torch.ones(6, dtype=torch.bool), delta=0.05)
    assert out.keep_mask.tolist() == keep.tolist()
    with pytest.raises(ValueError):
        binary_kl_keep_mask(p.log(), q.log(), a, delta=0.0)


def test_ppo_clip_values_and_zero_grad_when_clipped():
    q = torch.tensor([0.4, 0.4, 0.4, 0.4], dtype=D)
    p = torch.tensor([0.6, 0.2, 0.2, 0.44], dtype=D)  # ratios 1.5, 0.5, 0.5, 1.1
    a = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=D)
    lp = p.log().requires_grad_(True)
    out = ppo_clip_loss(lp, q.log(), a, torch.ones(4, dtype=torch.bool), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(out.token_loss.detach(), torch.tensor([-1.2, 0.8, -0.5, 1.1], dtype=D))
    assert out.keep_mask.tolist() == [False, False, True, True]
    (grad,) = torch.autograd.grad(out.token_loss.sum(), lp)
    # d(-ρA)/dlog p = -ρA on unclipped tokens
    torch.testing.assert_close(grad, torch.tensor([0.0, 0.0, -0.5, 1.1], dtype=D))
    m = out.stats.as_metrics()
    assert m["masked_frac_pos_adv"] == 0.5 and m["masked_frac_neg_adv"] == 0.5
    with pytest.raises(ValueError):
        ppo_clip_loss(lp, q.log(), a, torch.ones(4, dtype=torch.bool), clip_low=1.0)


def test_stats_hand_values_and_merge():
    lp, lq, a, keep = _tensors(TV_CASES)
    mask = torch.ones_like(keep)
    out = dppo_binary_tv_loss(lp, lq, a, mask)
    m = out.stats.as_metrics()
    p = torch.tensor([c[0] for c in TV_CASES], dtype=D)
    q = torch.tensor([c[1] for c in TV_CASES], dtype=D)
    pos, neg = a > 0, a < 0
    assert m["num_tokens"] == 11
    assert m["masked_frac"] == pytest.approx(4 / 11)
    assert m["masked_frac_pos_adv"] == pytest.approx(float((~keep & pos).sum() / pos.sum()))  # 2/5
    assert m["masked_frac_neg_adv"] == pytest.approx(float((~keep & neg).sum() / neg.sum()))  # 2/5
    assert m["mean_abs_prob_diff"] == pytest.approx(float((p - q).abs().mean()))
    ratio = p / q
    assert m["is_weight_mean"] == pytest.approx(float(ratio.mean()))
    assert m["is_weight_max"] == pytest.approx(3.0) and m["is_weight_min"] == pytest.approx(1 / 3)
    # merging two halves gives the whole
    h1 = dppo_binary_tv_loss(lp[:5], lq[:5], a[:5], mask[:5]).stats
    h2 = dppo_binary_tv_loss(lp[5:], lq[5:], a[5:], mask[5:]).stats
    merged = TrustRegionStats.merge([h1, h2]).as_metrics()
    for k, v in m.items():
        assert merged[k] == pytest.approx(v), k


def test_stats_empty_input_is_nan_not_error():
    e = torch.empty(0, dtype=D)
    out = dppo_binary_tv_loss(e, e, e, torch.empty(0, dtype=torch.bool))
    m = out.stats.as_metrics()
    assert m["num_tokens"] == 0
    assert all(math.isnan(m[k]) for k in m if k != "num_tokens")
    all_masked = dppo_binary_tv_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.bool))
    assert math.isnan(all_masked.stats.as_metrics()["masked_frac"])
    merged = TrustRegionStats.merge([out.stats, dppo_binary_tv_loss(*_tensors(TV_CASES)[:3],
                                                                    torch.ones(11, dtype=torch.bool)).stats])
    assert merged.as_metrics()["is_weight_max"] == pytest.approx(3.0)


def test_padded_2d_and_bf16_inputs():
    lp, lq, a, keep = _tensors(TV_CASES[:10])
    out = dppo_binary_tv_loss(lp.reshape(2, 5), lq.reshape(2, 5), a.reshape(2, 5), torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(out.keep_mask.reshape(-1), keep)
    out16 = dppo_binary_tv_loss(lp.bfloat16(), lq.bfloat16(), a.bfloat16(), torch.ones(10, dtype=torch.bool))
    assert out16.token_loss.dtype == torch.float32


def test_dispatch():
    assert TRUST_REGION_NAMES == ("dppo_binary_tv", "dppo_binary_kl", "ppo_clip")
    lp, lq, a, _ = _tensors(TV_CASES)
    mask = torch.ones(len(TV_CASES), dtype=torch.bool)
    via = policy_loss("dppo_binary_tv", lp, lq, a, mask, delta=0.15, is_cap=1e4)
    direct = dppo_binary_tv_loss(lp, lq, a, mask, delta=0.15)
    torch.testing.assert_close(via.token_loss, direct.token_loss)
    with pytest.raises(ValueError, match="dppo_binary_tv"):
        policy_loss("grpo_clip", lp, lq, a, mask)
    with pytest.raises(TypeError):
        policy_loss("ppo_clip", lp, lq, a, mask, delta=0.1)
    with pytest.raises(ValueError, match="shape"):
        policy_loss("ppo_clip", lp, lq[:3], a, mask)


logprob = st.floats(-8.0, 0.0, allow_nan=False)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(logprob, logprob, st.sampled_from([-2.0, -0.5, 0.0, 0.5, 2.0])), min_size=1, max_size=16),
       st.sampled_from([0.05, 0.1, 0.15, 0.3]))
def test_property_tv_never_masks_tokens_pushed_towards_behaviour(tokens, delta):
    lp = torch.tensor([t[0] for t in tokens], dtype=D)
    lq = torch.tensor([t[1] for t in tokens], dtype=D)
    a = torch.tensor([t[2] for t in tokens], dtype=D)
    keep = binary_tv_keep_mask(lp, lq, a, delta=delta)
    p, q = lp.exp(), lq.exp()
    towards = (a == 0) | ((a > 0) & (p <= q)) | ((a < 0) & (p >= q))
    assert keep[towards].all()
    # and what is masked is outside the region, on the harmful side
    dropped = ~keep
    assert ((p - q).abs()[dropped] > delta).all()
    assert ((a * (p - q))[dropped] > 0).all()
    kl_keep = binary_kl_keep_mask(lp, lq, a)
    assert kl_keep[towards].all()
