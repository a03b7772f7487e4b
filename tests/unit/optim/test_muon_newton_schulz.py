"""Newton–Schulz orthogonalisation, Muon update scale and FLOP count: hand-computed edge cases."""

import math

import pytest
import torch

from zrl.optim import NS_COEFFICIENTS, muon_update_scale, newton_schulz, ns_flops

A, B, C = NS_COEFFICIENTS


def _bf16(v: float) -> float:
    return torch.tensor(v, dtype=torch.float32).bfloat16().float().item()


def _scalar_ns_bf16(x: float, steps: int = 5) -> float:
    """NS on a single singular value x, rounding to bf16 once per fused op like bmm/baddbmm on CPU."""
    for _ in range(steps):
        gram = _bf16(x * x)
        poly = _bf16(B * gram + C * gram * gram)
        x = _bf16(A * x + poly * x)
    return x


def _ns_fp32(g: torch.Tensor) -> torch.Tensor:
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    for _ in range(5):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape, expected", [
    ((3, 5), 5 * (4 * 9 * 5 + 2 * 27)),  # P=3, Q=5: 10·P²·(2Q+P) = 1170
    ((5, 3), 1170),  # transposed first: same cost
    ((2, 3, 5), 2340),  # a batch of two
    ((4, 4), 5 * 384),
])
def test_ns_flops(shape, expected):
    assert ns_flops(shape) == expected


def test_ns_flops_one_step_and_bad_shape():
    assert ns_flops((4, 4), steps=1) == 4 * 16 * 4 + 2 * 64
    with pytest.raises(ValueError, match="matrix"):
        ns_flops((7,))


@pytest.mark.parametrize("m, n, expected", [(16, 64, 1.6), (64, 16, 1.6), (1, 1, 0.2), (9, 4, 0.6)])
def test_update_scale_is_0p2_sqrt_max_dim(m, n, expected):
    assert muon_update_scale(m, n) == pytest.approx(expected, rel=1e-12)


def test_update_scale_rejects_empty():
    with pytest.raises(ValueError):
        muon_update_scale(0, 3)


def test_scaled_identity_maps_to_iterated_polynomial():
    # 3·I₄: ‖G‖_F = 6, X = I/2 exactly; every singular value follows x ← a·x + b·x³ + c·x⁵.
    out = newton_schulz(3 * torch.eye(4)).float()
    expected = _scalar_ns_bf16(0.5)
    assert expected == 0.82421875  # hand-traced with bf16 rounding once per fused op
    assert torch.equal(out, expected * torch.eye(4))
    # the same polynomial in fp64 gives 0.7654: the quintic oscillates, bf16 shifts where it lands
    x = 0.5
    for _ in range(5):
        x = A * x + B * x**3 + C * x**5
    assert abs(x - expected) < 0.1


def test_rank_one_matrix_stays_rank_one():
    # u·vᵀ with u = 1₄, v = 1₁₆: ‖G‖_F = 8, X = G/8 exactly, singular value 1 → f⁵(1) = 0.6875 in bf16.
    out = newton_schulz(torch.ones(4, 16)).float()
    assert _scalar_ns_bf16(1.0) == 0.6875
    assert torch.equal(out, torch.full((4, 16), 0.6875 / 8))


def test_zero_matrix_gives_zero_not_nan():
    out = newton_schulz(torch.zeros(3, 6, 4))
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.zeros(3, 6, 4))


def test_singular_values_land_in_the_muon_band():
    torch.manual_seed(0)
    for shape in [(32, 64), (64, 64), (64, 32)]:
        s = torch.linalg.svdvals(newton_schulz(torch.randn(shape)).float())
        # measured [0.608, 1.135]: the quintic maps every singular value into roughly [0.6, 1.2]
        assert s.min() > 0.55 and s.max() < 1.25, shape


def test_close_to_fp32_iteration():
    torch.manual_seed(1)
    for shape in [(16, 48), (48, 16), (64, 64), (7, 3)]:
        g = torch.randn(shape)
        ref = _ns_fp32(g)
        rel = (newton_schulz(g).float() - ref).norm() / ref.norm()
        assert rel < 0.03, shape  # measured 0.015–0.017: bf16 rounding through 5 iterations


def test_transpose_and_row_permutation_are_exact():
    torch.manual_seed(2)
    g = torch.randn(8, 24)
    assert torch.equal(newton_schulz(g.T), newton_schulz(g).T)  # tall matrices run transposed
    perm = torch.randperm(8)
    assert torch.equal(newton_schulz(g[perm]), newton_schulz(g)[perm])  # same dot products, permuted


def test_batch_equals_one_matrix_at_a_time():
    torch.manual_seed(3)
    g = torch.randn(5, 12, 20)
    assert torch.equal(newton_schulz(g), torch.stack([newton_schulz(x) for x in g]))


def test_scale_invariance():
    torch.manual_seed(4)
    g = torch.randn(16, 48)
    base = newton_schulz(g).float()
    assert torch.equal(newton_schulz(8 * g).float(), base)  # a power of two scales exactly
    for c in (1000.0, 1e-3):
        rel = (newton_schulz(c * g).float() - base).norm() / base.norm()
        assert rel < 0.04  # measured 0.024 / 0.017: only bf16 rounding of the normalised input differs


def test_rejects_vectors_and_zero_steps():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.ones(4))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz(torch.ones(2, 2), steps=0)


def test_fewer_steps_follow_the_polynomial():
    out = newton_schulz(torch.ones(4, 16), steps=1).float()
    assert out[0, 0].item() * 8 == pytest.approx(_scalar_ns_bf16(1.0, steps=1))
    # exact f(1) = a + b + c = 0.701; bf16 rounds b + c = -2.7435 to -2.75 first: 0.6945 → 0.6953125
    assert math.isclose(A + B + C, 0.701, rel_tol=1e-9)
    assert _scalar_ns_bf16(1.0, steps=1) == 0.6953125
