"""Trainer-side logprobs under the engine's sampling distribution vs an independent float64 computation.

The independent version is written from the definitions, token against token, with no sort and no
floor: temperature divides the logits; min-p keeps p_j >= min_p * max p; top-k keeps a token when fewer
than k surviving tokens are strictly more probable; top-p keeps it when the renormalised mass of the
surviving tokens strictly more probable than it is < p; the target is always kept. Values and
gradients of zrl.modeling.logprobs (fp32, chunked) must match it.
"""

import math

import pytest
import torch

from zrl.modeling.logprobs import SamplingDistribution, chunked_token_logprobs, support_floor

T, D, V = 16, 8, 12


def inputs(seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen) * scale
    weight = torch.randn(V, D, generator=gen)
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[5] = -100  # an ignored position
    return hidden, weight, targets


def independent_support(z: torch.Tensor, s: SamplingDistribution) -> torch.Tensor:
    """[T, V] bool from the definitions; z: tempered float64 logits [T, V]."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if s.min_p > 0:
        p = z.softmax(-1)
        keep &= p >= s.min_p * p.amax(-1, keepdim=True)
    higher = z[:, None, :] > z[:, :, None]  # [T, j, i]: token i strictly more probable than token j
    if s.top_k > 0:
        keep &= (higher & keep[:, None, :]).sum(-1) < s.top_k
    if s.top_p < 1:
        p = z.masked_fill(~keep, -math.inf).softmax(-1)  # renormalised over the survivors
        keep &= (p[:, None, :] * higher).sum(-1) < s.top_p
    return keep


def independent(hidden, weight, targets, s: SamplingDistribution):
    """(logprob [T], entropy [T], d(sum lp + sum ent)/d hidden, /d weight) in float64."""
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = (h @ w.t()) / s.temperature
    keep = independent_support(z.detach(), s)
    rows = torch.arange(T)[targets >= 0]
    keep[rows, targets[rows]] = True
    logp = z.masked_fill(~keep, -math.inf).log_softmax(-1)
    lp = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0].masked_fill(targets < 0, 0.0)
    ent = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad, keep


def ours(hidden, weight, targets, s: SamplingDistribution | None, chunk_tokens=5):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = chunked_token_logprobs(h, w, targets, chunk_tokens=chunk_tokens, with_entropy=True, sampling=s)
    (lp.sum() + ent.sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def assert_matches(got, want):
    # fp32 against float64, measured over every case here: logprob 1.4e-6 (5.5e-6 on the ~-120 of stale
    # targets in the one-token case), entropy 3.8e-7, gradients 3.6e-6 (5.4e-5 on values of ~1.2e3 in the
    # one-token case: inside the relative term)
    for name, a, b in zip(("logprob", "entropy", "grad hidden", "grad weight"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


CASES = {
    "temperature-0.7": SamplingDistribution(temperature=0.7),
    "temperature-1.3": SamplingDistribution(temperature=1.3),
    "top-k-1": SamplingDistribution(top_k=1),
    "top-k-4": SamplingDistribution(temperature=0.8, top_k=4),
    "top-p-0.9": SamplingDistribution(top_p=0.9),
    "top-p-0.9-t0.7": SamplingDistribution(temperature=0.7, top_p=0.9),
    "top-p-0.3": SamplingDistribution(top_p=0.3),
    "min-p-0.1": SamplingDistribution(min_p=0.1),
    "combined": SamplingDistribution(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("s", CASES.values(), ids=CASES.keys())
def test_matches_the_definitions(s):
    hidden, weight, targets = inputs(seed=1, scale=0.8)
    *want, keep = independent(hidden, weight, targets, s)
    assert_matches(ours(hidden, weight, targets, s), want)
    if s.filtered:  # the filter removed tokens, and some targets lie outside the filtered support
        z = (hidden.double() @ weight.double().t()) / s.temperature
        support = independent_support(z, s)
        assert (~support).any(-1).sum() >= T // 2
        assert not support[torch.arange(T), targets.clamp_min(0)][targets >= 0].all()


def test_temperature_differs_from_the_plain_softmax():
    hidden, weight, targets = inputs(seed=2)
    plain, tempered = ours(hidden, weight, targets, None), ours(hidden, weight, targets, SamplingDistribution(0.7))
    assert (plain[0] - tempered[0]).abs().max() > 0.05  # not vacuous: the two distributions differ


def test_inactive_filters_equal_the_temperature_only_distribution():
    """top_p = 1 and min_p = 0 are off; top_k >= V keeps every token: all equal temperature alone."""
    hidden, weight, targets = inputs(seed=3)
    base = ours(hidden, weight, targets, SamplingDistribution(temperature=0.9))
    for s in (SamplingDistribution(temperature=0.9, top_p=1.0), SamplingDistribution(temperature=0.9, top_k=V),
              SamplingDistribution(temperature=0.9, top_k=V + 50)):
        for a, b in zip(ours(hidden, weight, targets, s), base):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def tied_inputs():
    """Logits (per row) 3, 2, 2, 2, 1, 0, ...: equal weight rows give bitwise equal logits."""
    weight = torch.zeros(V, D)
    weight[:, 0] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0] + [0.0] * (V - 5))
    hidden = torch.zeros(T, D)
    hidden[:, 0] = 1.0
    targets = torch.arange(T) % V
    return hidden, weight, targets


@pytest.mark.parametrize("s, kept", [
    (SamplingDistribution(top_k=2), 4),  # the 2nd largest is tied with two more: all three stay
    (SamplingDistribution(top_k=4), 4),
    # mass of the top token 0.387, of each tied token 0.142: p = 0.5 cuts through the tie (vLLM's
    # sort keeps 2 of the 3), p = 0.3 before it
    (SamplingDistribution(top_p=0.5), 4),
    (SamplingDistribution(top_p=0.3), 1),
], ids=["top-k-inside-tie", "top-k-at-tie-end", "top-p-inside-tie", "top-p-before-tie"])
def test_ties_at_the_boundary_are_all_kept(s, kept):
    hidden, weight, targets = tied_inputs()
    floor = support_floor(hidden, weight, s)
    assert ((hidden @ weight.t()) >= floor[:, None]).sum(-1).eq(kept).all()
    *want, keep = independent(hidden, weight, targets, s)
    assert independent_support(hidden.double() @ weight.double().t(), s).sum(-1).eq(kept).all()
    assert_matches(ours(hidden, weight, targets, s), want)


@pytest.mark.parametrize("s", [SamplingDistribution(top_p=0.9), SamplingDistribution(min_p=0.1),
                               SamplingDistribution(temperature=0.5, top_k=3)], ids=["top-p", "min-p", "top-k"])
def test_all_mass_in_one_token(s):
    """One logit 60 above the rest: the filters keep only it (logprob 0); a stale target elsewhere
    keeps a finite logprob, that of the two-token support {top, target}."""
    hidden, weight, targets = inputs(seed=4, scale=0.1)
    weight[7] = 0.0
    weight[7, 0] = 600.0
    hidden[:, 0] = 0.1  # z_7 = 60 + O(0.1), every other |z| < 1
    lp, *_ = ours(hidden, weight, targets, s)
    *want, keep = independent(hidden, weight, targets, s)
    if s.top_k == 0:
        assert (keep.sum(-1) <= 2).all()
    assert torch.isfinite(lp).all()
    on_top = targets == 7
    assert on_top.any() and (lp[on_top] == 0).all()
    assert_matches(ours(hidden, weight, targets, s), want)


def test_chunking_does_not_change_the_result():
    hidden, weight, targets = inputs(seed=5)
    s = SamplingDistribution(temperature=0.7, top_k=5, top_p=0.85, min_p=0.02)
    # Chunks change the order of fp32 sums (the weight gradient sums over tokens chunk by chunk), so the
    # two sides may differ by their two errors against float64, each within assert_matches' 1e-5.
    # Measured 1.1e-6 here on an Intel Xeon with AVX512-FP16 (7.6e-6 worst over seeds 0-39); a chunk
    # counted twice or dropped would differ by O(0.1).
    for a, b in zip(ours(hidden, weight, targets, s, chunk_tokens=1), ours(hidden, weight, targets, s, chunk_tokens=64)):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_invalid_distributions_raise():
    for kwargs, field in ((dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
                          (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p")):
        with pytest.raises(ValueError, match=field):
            SamplingDistribution(**kwargs)
