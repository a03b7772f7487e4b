"""Parity of the fused Triton LM head + log-softmax gather and of its library formulation (bf16 part
GEMMs) with the chunked fp32 reference.

Forward (logprob, entropy) and backward (grad hidden, grad weight) on small shapes through Triton's
CPU interpreter (and the compiled kernels on CUDA, `gpu`), ignored targets, logits of ~1e3, fp16 and
(GPU) bf16 inputs, vocabulary splits, hand-computed values, accuracy against float64, the library
formulation's GEMM count and the backend dispatch.
"""

import math

import pytest
import torch

from zrl.modeling.kernels import use_backend
from zrl.modeling.kernels.lm_logprobs import token_logprobs
from zrl.modeling.kernels.lm_logprobs.library import token_logprobs_library
from zrl.modeling.kernels.lm_logprobs.reference import token_logprobs_reference
from zrl.modeling.kernels.lm_logprobs.triton_kernel import TileConfig, token_logprobs_triton

# fp32: measured max abs differences over the shape grid and gradient modes below (CPU interpreter,
# 2026-11-21): logprob 2.9e-6 (values up to 18), entropy 1.8e-6 (up to 3.4), grad hidden 5.5e-6 (up to
# 10), grad weight 4.1e-6 (up to 8.5): fp32 sums over V and D in another order (the reference's own
# test vs a full log_softmax measured the same 5.5e-6). Tolerance ~2x, the relative term for GPU tiles.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def make_inputs(t, d, v, device, dtype=torch.float32, w_dtype=None, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t, d, generator=gen) * scale / math.sqrt(d) * 3).to(device, dtype)
    weight = torch.randn(v, d, generator=gen).to(device, w_dtype or dtype)
    targets = torch.randint(0, v, (t,), generator=gen).to(device)
    if t > 1:
        targets[1] = -100  # an ignored position in every multi-token case
    upstream = (torch.randn(t, generator=gen).to(device), torch.randn(t, generator=gen).to(device))
    return hidden, weight, targets, upstream


def run(fn, hidden, weight, targets, upstream, *, with_entropy=True, use_lp=True, use_ent=True,
        grad_h=True, grad_w=True):
    """(logprob, entropy, grad hidden, grad weight) of sum(lp g1) + sum(ent g2) through `fn`."""
    h = hidden.clone().requires_grad_(grad_h)
    w = weight.clone().requires_grad_(grad_w)
    lp, ent = fn(h, w, targets, with_entropy=with_entropy)
    loss = 0.0
    if use_lp:
        loss = loss + (lp * upstream[0]).sum()
    if use_ent:
        loss = loss + (ent * upstream[1]).sum()
    loss.backward()
    return lp.detach(), (None if ent is None else ent.detach()), h.grad, w.grad


def kernel(h, w, y, *, with_entropy):
    return token_logprobs(h, w, y, with_entropy=with_entropy)


def reference(h, w, y, *, with_entropy):
    lp, ent = token_logprobs_reference(h, w, y.to(torch.int64), chunk_tokens=7, with_entropy=with_entropy)
    return lp, (ent if with_entropy else None)


def library(h, w, y, *, with_entropy):
    lp, ent = token_logprobs_library(h, w, y.to(torch.int64), chunk_tokens=7, with_entropy=with_entropy)
    return lp, (ent if with_entropy else None)


def assert_all_close(got, want, **tol):
    for name, a, b in zip(("logprob", "entropy", "grad hidden", "grad weight"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("v", [10, 64, 100])
@pytest.mark.parametrize("d", [16, 48])
@pytest.mark.parametrize("t", [1, 9, 40])
def test_parity_forward_backward(device, triton_backend, t, d, v):
    inputs = make_inputs(t, d, v, device)
    assert_all_close(run(kernel, *inputs), run(reference, *inputs), **FP32_TOL)


@pytest.mark.parametrize("mode", [
    dict(with_entropy=False, use_ent=False),  # the trainer's policy loss without entropy
    dict(use_ent=False),  # entropy computed for monitoring, not in the loss
    dict(use_lp=False),  # only the entropy term sends gradients
    dict(grad_w=False),  # frozen head
    dict(grad_h=False),
], ids=["logprob-only", "entropy-unused", "entropy-only", "hidden-only", "weight-only"])
def test_gradient_modes(device, triton_backend, mode):
    inputs = make_inputs(40, 48, 100, device)
    assert_all_close(run(kernel, *inputs, **mode), run(reference, *inputs, **mode), **FP32_TOL)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_vocabulary_splits_agree_and_are_deterministic(device, splits):
    cfg = TileConfig(block_t=16, block_v=16, block_d=16, vocab_splits=splits)  # V = 100: 7 tiles

    def split_kernel(h, w, y, *, with_entropy):
        return token_logprobs_triton(h, w, y, with_entropy=with_entropy, config=cfg)

    inputs = make_inputs(20, 48, 100, device)
    got = run(split_kernel, *inputs)
    assert_all_close(got, run(reference, *inputs), **FP32_TOL)
    for a, b in zip(got, run(split_kernel, *inputs)):
        assert torch.equal(a, b)  # one writer per output element: no atomics, no run-to-run noise


def test_ignored_targets(device, triton_backend):
    hidden, weight, targets, upstream = make_inputs(9, 16, 64, device)
    targets[4:7] = torch.tensor([-1, -100, -5])
    lp, ent, grad_h, grad_w = run(kernel, hidden, weight, targets, upstream, use_ent=False)
    assert torch.all(lp[targets < 0] == 0) and torch.all(lp[targets >= 0] < 0)
    assert_all_close((lp, ent, grad_h, grad_w),
                     run(reference, hidden, weight, targets, upstream, use_ent=False), **FP32_TOL)
    # a loss on an ignored position alone sends nothing back
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    token_logprobs(h, w, targets)[0][5].backward()
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_all_targets_ignored(device, triton_backend):
    hidden, weight, _, upstream = make_inputs(9, 16, 64, device)
    targets = torch.full((9,), -100, device=device)
    lp, ent, grad_h, grad_w = run(kernel, hidden, weight, targets, upstream)
    assert torch.all(lp == 0)
    # the entropy is still defined for every position and carries the whole gradient
    assert_all_close((lp, ent, grad_h, grad_w), run(reference, hidden, weight, targets, upstream), **FP32_TOL)
    _, _, grad_h, grad_w = run(kernel, hidden, weight, targets, upstream, use_ent=False)
    assert grad_h.abs().max() == 0 and grad_w.abs().max() == 0


def test_large_logits(device, triton_backend, request):
    # logits up to ~3.4e3: exp() of them overflows fp32; the online max keeps every exp <= 1
    if device.type == "cuda":  # strict: passing there fails the test, so this mark goes when it is fixed
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "failed on an H200 (2026-11-27): the tensor cores' truncated fp32 accumulation (CUDA_BOUNDS) "
            "at logits of ~3e3; the kernel is not what CUDA runs (lm_logprobs: library)")))
    hidden, weight, targets, upstream = make_inputs(40, 48, 100, device, scale=300.0)
    got = run(kernel, hidden, weight, targets, upstream)
    assert all(torch.isfinite(x).all() for x in got)
    want = run(reference, hidden, weight, targets, upstream)
    # measured vs the reference: logprob 9.8e-4 on values up to 4.6e3 (2 fp32 ulps: inside the relative
    # term), grad hidden 4.8e-7, grad weight 6.1e-5 on values up to 920 (the hidden states are ~300x
    # larger here; 7e-8 of the largest gradient) -> atol 1e-4 for this test
    torch.testing.assert_close(got[0], want[0], **FP32_TOL)
    assert_all_close((None, None) + got[2:], (None, None) + want[2:], rtol=1e-5, atol=1e-4)
    # Against float64 the kernel's entropy is exact to 7.8e-8 (values ~6e-4, nearly one-hot rows) and
    # the reference's only to 5.7e-5: the reference forms lse - z_max, a cancellation at ~3e3, while the
    # kernel's log S - U / S has none. Logprob: kernel 4.1e-4 (fp32 logits of 3.4e3 carry ~2e-4).
    logits = hidden.double() @ weight.double().t()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1)
    exact_lp = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0].masked_fill(targets < 0, 0.0)
    torch.testing.assert_close(got[0].double(), exact_lp, rtol=0, atol=1e-3)
    torch.testing.assert_close(got[1].double(), -(logp.exp() * logp).sum(-1), rtol=0, atol=1e-6)


def test_hand_computed_values(device, triton_backend):
    # V = 2: logits (0, ln 3) -> p = (1/4, 3/4); logprob(1) = ln 3/4; entropy = ln 4 - 3/4 ln 3;
    # d logprob(1) / d z = onehot(1) - p = (-1/4, 1/4); d entropy / d z_j = -p_j (z_j - E_p[z]) with
    # E_p[z] = 3/4 ln 3: (3/16 ln 3, -3/16 ln 3).
    hidden = torch.zeros(1, 16, device=device)
    hidden[0, 0] = 1.0
    weight = torch.zeros(2, 16, device=device)
    weight[1, 0] = math.log(3.0)
    w = weight.clone().requires_grad_()
    lp, ent = token_logprobs(hidden, w, torch.tensor([1], device=device), with_entropy=True)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75)], device=device))
    torch.testing.assert_close(ent, torch.tensor([math.log(4.0) - 0.75 * math.log(3.0)], device=device))
    (lp.sum() + 2 * ent.sum()).backward()
    # d/dW_j = dL/dz_j * hidden: only column 0 of each row is non-zero
    dz = torch.tensor([-0.25 + 2 * 3 / 16 * math.log(3.0), 0.25 - 2 * 3 / 16 * math.log(3.0)], device=device)
    torch.testing.assert_close(w.grad[:, 0], dz)
    assert w.grad[:, 1:].abs().max() == 0


def test_uniform_logits_hand_values(device, triton_backend):
    # zero head: logprob = -ln V, entropy = ln V, d logprob / d W_j = (onehot_j - 1/V) hidden
    v, d = 100, 16
    hidden = torch.ones(2, d, device=device)
    weight = torch.zeros(v, d, device=device, requires_grad=True)
    lp, ent = token_logprobs(hidden, weight, torch.tensor([0, 99], device=device), with_entropy=True)
    torch.testing.assert_close(lp, torch.full((2,), -math.log(v), device=device))
    torch.testing.assert_close(ent, torch.full((2,), math.log(v), device=device))
    lp[1].backward()
    expected = -torch.ones(v, d, device=device) / v
    expected[99] += 1.0
    torch.testing.assert_close(weight.grad, expected)


def test_fp16_inputs(device, triton_backend):
    inputs = make_inputs(40, 48, 100, device, dtype=torch.float16)
    got = run(kernel, *inputs)
    assert got[2].dtype == torch.float16 and got[3].dtype == torch.float16
    # measured: logprob 1.9e-6, entropy 1.2e-6 (fp32 math on the same fp16 values); grad hidden 3.9e-3
    # on values up to 7.6 and grad weight 2.0e-3 on values up to 3: one fp16 ulp of the outputs (the
    # 16-bit path also rounds the logit gradients to fp16 before the two backward dots)
    assert_all_close(got[:2], run(reference, *inputs)[:2], **FP32_TOL)
    assert_all_close(got[2:], run(reference, *inputs)[2:], rtol=2e-3, atol=4e-3)


def test_fp32_hidden_with_bf16_weight(device, triton_backend):
    # the model's case: fp32 final hidden states, bf16 tied embedding; the kernel splits the hidden states
    # into bf16 parts (no fp32 copy of W); gradients come back as bf16 for the weight
    inputs = make_inputs(40, 48, 100, device, w_dtype=torch.bfloat16)
    got = run(kernel, *inputs)
    assert got[3].dtype == torch.bfloat16
    want = run(reference, *inputs)
    # measured: logprob 1.9e-6, entropy 1.7e-6, grad hidden 4.3e-6
    assert_all_close(got[:3], want[:3], **FP32_TOL)
    # The bf16 weight gradient rounds nearly the same sums to bf16 (the kernel's to 2^-16, "Precision" in
    # the README): where a sum sits on a rounding boundary the two round one bf16 step apart. Measured:
    # 7.8e-3 (one step at |g| ~ 1-2; the fp32 kernel before the split measured 2.4e-7 and 4.9e-4 on two
    # x86-64 CPUs); bf16 steps are 2^-8..2^-7 relative, so allow 2^-6.
    torch.testing.assert_close(got[3].float(), want[3].float(), rtol=2**-6, atol=FP32_TOL["atol"])


@pytest.mark.gpu
def test_bf16_inputs_gpu(triton_backend):
    # Not measured (no GPU in the session that wrote it): bf16 x bf16 products are exact in fp32, so the
    # forward matches the fp32 reference up to summation order (fp32 tolerance); the backward rounds the
    # logit gradients to bf16 (2^-9 relative) before the dots and returns bf16: a few bf16 ulps.
    inputs = make_inputs(300, 256, 1000, torch.device("cuda"), dtype=torch.bfloat16)
    want = run(reference, *inputs)
    for got in (run(kernel, *inputs), run(library, *inputs)):
        assert_all_close(got[:2], want[:2], rtol=1e-4, atol=1e-4)
        for a, b in zip(got[2:], want[2:]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def floor_keeping(hidden, weight, count: torch.Tensor) -> torch.Tensor:
    """[T] floors that keep each token's count[t] largest logits (0: none but the target, V: all),
    half-way between two logits so that both backends agree on the support."""
    z = (hidden.double() @ weight.double().t()).sort(dim=-1, descending=True).values  # [T, V]
    padded = torch.cat([z[:, :1] + 2, z, z[:, -1:] - 2], dim=-1)  # [T, V + 2]: above and below every logit
    i = count[:, None]
    return ((padded.gather(1, i) + padded.gather(1, i + 1)) / 2)[:, 0].float()


def with_floor(fn, floor):
    def call(h, w, y, *, with_entropy):
        if fn is kernel:
            return token_logprobs(h, w, y, with_entropy=with_entropy, logit_floor=floor)
        lp, ent = token_logprobs_reference(h, w, y.to(torch.int64), chunk_tokens=7, with_entropy=with_entropy,
                                           floor=floor)
        return lp, (ent if with_entropy else None)
    return call


def floor_case(device, t=40, v=100, seed=0):
    """Inputs with a floor keeping a random number of tokens per row, and rows keeping all (0), only the
    largest (2) and none but the target (3); targets are often below their floor."""
    hidden, weight, targets, upstream = make_inputs(t, 48, v, device, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    count = torch.randint(1, v, (t,), generator=gen)
    count[0], count[2], count[3] = v, 1, 0
    return hidden, weight, targets, upstream, floor_keeping(hidden.cpu(), weight.cpu(), count).to(device)


@pytest.mark.parametrize("mode", [dict(), dict(with_entropy=False, use_ent=False), dict(use_lp=False)],
                         ids=["logprob+entropy", "logprob-only", "entropy-only"])
def test_logit_floor_parity(device, triton_backend, mode):
    hidden, weight, targets, upstream, floor = floor_case(device)
    got = run(with_floor(kernel, floor), hidden, weight, targets, upstream, **mode)
    want = run(with_floor(reference, floor), hidden, weight, targets, upstream, **mode)
    # measured (CPU interpreter, logprob+entropy): logprob 2.4e-6 (values up to 16), entropy 1.1e-6, grad
    # hidden 4.8e-6, grad weight 1.6e-6: the same as without a floor
    assert_all_close(got, want, **FP32_TOL)


def test_logit_floor_reference_is_the_restricted_log_softmax():
    """The reference against a dense float64 softmax over {j : z_j >= floor} + the target."""
    hidden, weight, targets, upstream, floor = floor_case(torch.device("cpu"))
    lp, ent, grad_h, grad_w = run(with_floor(reference, floor), hidden, weight, targets, upstream)
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = h @ w.t()  # [T, V]
    keep = z.detach() >= floor.double()[:, None]
    rows = torch.arange(len(targets))[targets >= 0]
    keep[rows, targets[rows]] = True
    logp = torch.log_softmax(z.masked_fill(~keep, -math.inf), dim=-1)
    want_lp = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0].masked_fill(targets < 0, 0.0)
    want_ent = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    ((want_lp * upstream[0].double()).sum() + (want_ent * upstream[1].double()).sum()).backward()
    assert keep[0].all() and keep[2].sum() <= 2 and lp[3] == 0  # row 3: only its target, probability 1
    outside = z.detach().gather(1, targets.clamp_min(0)[:, None])[:, 0] < floor.double()
    assert outside[targets >= 0].sum() >= 5  # the forced target is exercised
    for name, a, b in (("logprob", lp, want_lp), ("entropy", ent, want_ent), ("grad hidden", grad_h, h.grad),
                       ("grad weight", grad_w, w.grad)):
        torch.testing.assert_close(a.double(), b, **FP32_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_logit_floor_of_minus_infinity_is_no_floor(device, triton_backend):
    hidden, weight, targets, upstream = make_inputs(20, 16, 64, device)
    floor = torch.full((20,), -math.inf, device=device)
    for fn in (kernel, reference):
        assert_all_close(run(with_floor(fn, floor), hidden, weight, targets, upstream),
                         run(fn, hidden, weight, targets, upstream), rtol=0, atol=0)


def test_dispatch_picks_the_backend(device):
    hidden, weight, targets, _ = make_inputs(9, 16, 64, device)
    h = hidden.requires_grad_()
    names = {}
    for backend in ("auto", "reference", "triton"):  # CPU "triton": the interpreter (set by conftest.py)
        with use_backend(backend):
            lp, ent = token_logprobs(h, weight, targets)
        assert ent is None
        names[backend] = type(lp.grad_fn).__name__
        if backend == "reference":
            lp_ref = lp
        else:
            torch.testing.assert_close(lp, token_logprobs_reference(h, weight, targets, chunk_tokens=None,
                                                                    with_entropy=False)[0], **FP32_TOL)
    assert names["reference"] == "_ChunkedTokenLogprobsBackward"
    assert names["triton"] == "_TritonTokenLogprobsBackward"
    # auto: the library formulation on CUDA (the reference's autograd function with other products)
    assert names["auto"] == names["reference"]
    assert lp_ref.dtype == torch.float32


def test_bad_inputs_raise():
    hidden, weight, targets, _ = make_inputs(9, 16, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="hidden must be"):
        token_logprobs(hidden[None], weight, targets)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="weight must be"):
        token_logprobs(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match="logit_floor must be"):
        token_logprobs(hidden, weight, targets, logit_floor=torch.zeros(8))


def _max_error_in_rows(got: torch.Tensor, exact_rows, rows: int, chunk: int = 16384) -> float:
    """max |got - exact| over [V, D] rows computed `chunk` rows at a time in float64 (a whole float64
    [V, D] at the ZAYA1 shape is 4.3 GB)."""
    return max((got[i:i + chunk].double() - exact_rows(i, i + chunk)).abs().max().item()
               for i in range(0, rows, chunk))


def accuracy_against_float64(device: torch.device, t: int, d: int, v: int) -> dict[str, tuple[float, float, float]]:
    """max |error| against float64 of (logprob, grad hidden, grad weight) for the fp32 reference and the
    kernel, fp32 hidden states (RMSNorm scale) and a bf16 weight giving logits ~ N(0, 16), as the model
    calls it."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(t, d, generator=gen)
    weight = (torch.randn(v, d, generator=gen) * 4 / math.sqrt(d)).bfloat16()
    targets = torch.randint(0, v, (t,), generator=gen)
    upstream = torch.randn(t, generator=gen)
    # float64 truth: logprob, and G = d loss / d z = g (onehot - p) for the gradients
    z = hidden.double() @ weight.double().t()  # [T, V]
    logp = torch.log_softmax(z, dim=-1)
    exact_lp = logp.gather(1, targets[:, None])[:, 0]
    grad_z = -logp.exp() * upstream.double()[:, None]
    grad_z[torch.arange(t), targets] += upstream.double()
    exact_dh = grad_z @ weight.double()

    def exact_dw(lo, hi):
        return grad_z[:, lo:hi].t() @ hidden.double()

    # The interpreter's tiles may hold 2^20 elements: a [2048, 512] weight tile.
    cfg = None if device.type == "cuda" else TileConfig(block_t=16, block_v=2048, block_d=512, vocab_splits=1)
    y = targets.to(device)
    errors = {}
    for name, fn in (("reference", lambda h, w: token_logprobs_reference(h, w, y, chunk_tokens=None,
                                                                         with_entropy=False)),
                     ("library", lambda h, w: token_logprobs_library(h, w, y, chunk_tokens=None, with_entropy=False)),
                     ("kernel", lambda h, w: token_logprobs_triton(h, w, y, with_entropy=False, config=cfg))):
        h, w = hidden.to(device, copy=True).requires_grad_(), weight.to(device, copy=True).requires_grad_()
        lp = fn(h, w)[0]
        (lp * upstream.to(device)).sum().backward()
        assert w.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.float32
        errors[name] = ((lp.cpu().double() - exact_lp).abs().max().item(),
                        (h.grad.cpu().double() - exact_dh).abs().max().item(),
                        _max_error_in_rows(w.grad.cpu(), exact_dw, v))
    return errors


# Hopper's tensor cores add the products inside a bf16 GEMM in fp32 with truncation rather than IEEE
# round-to-nearest, so on CUDA the exact parts' sums are not fp32 sums. Measured on an H200 (torch 2.11,
# 2026-11-27) at V = 262,272 against float64: logprob 3.71e-5 (library), 1.11e-4 (kernel) where the fp32
# reference is off by 2.03e-6 and a bf16 head by ~1.5e-2; grad hidden 2.63e-6 (kernel) vs 7.59e-7, the
# library's between 1e-6 and 1e-5 (the report kept its last digits only: "...665820395e-06"). Bounds:
# ~1.5x the measured values.
CUDA_BOUNDS = {"library": (6e-5, 1e-5), "kernel": (1.7e-4, 4e-6)}  # (logprob, grad hidden)


def test_fp32_level_accuracy(device):
    """fp32 hidden states, bf16 tied embedding: against float64, the kernel's and the library
    formulation's logprob, fp32 grad hidden and bf16 grad weight are no further off than the fp32
    reference's (fp32 logits from an fp32 copy of W, fp32 log-softmax) on CPU, and within CUDA_BOUNDS
    on CUDA. On CUDA at the ZAYA1-8B shape (V = 262,272, D = 2048); through the CPU interpreter at
    D = 2048 and 4 + 1/16 vocabulary tiles (the ZAYA1 shape takes ~10 minutes there; measured once,
    README "Tolerances")."""
    v = 262_272 if device.type == "cuda" else 4 * 2048 + 128
    errors = accuracy_against_float64(device, 8, 2048, v)
    summary = "; ".join(f"{name}: logprob {lp:.3g}, grad hidden {dh:.3g}, grad weight {dw:.3g}"
                        for name, (lp, dh, dw) in errors.items())  # short: pytest cuts long messages
    ref_lp, ref_dh, ref_dw = errors["reference"]
    # Measured (CPU interpreter, V = 8,320): logprob 2.31e-6 vs the reference's 2.12e-6 (values up to
    # ~20, where one fp32 ulp is 1.9e-6), grad hidden 1.755e-7 vs 1.743e-7, grad weight 7.7e-3 for both
    # (half a bf16 step of the largest entry). At V = 262,272 (interpreter, once): 2.01e-6 vs 2.68e-6,
    # 3.11e-7 vs 3.73e-7, 1.46e-2 for both. Both are fp32 sums in different orders, equally accurate:
    # each may come out ahead by a rounding, hence 1.5x; a kernel on bf16 logits (one part) would be off
    # by ~4e-2. The library formulation (the kernel's parts and orders as GEMMs; on CPU fp32 sums of the
    # exact part products), V = 8,320 on CPU: logprob 1.01e-6, grad hidden 2.07e-7, grad weight 7.7e-3.
    for name in ("library", "kernel"):
        lp, dh, dw = errors[name]
        if device.type == "cuda":
            assert lp <= CUDA_BOUNDS[name][0] and dh <= CUDA_BOUNDS[name][1], summary
        else:
            assert lp <= 1.5 * ref_lp and dh <= 1.5 * ref_dh, summary
        # the bf16 weight gradient: the reference's error is half a bf16 step of its largest entry; where
        # a sum sits on a rounding boundary the two may round one step apart (H200: equal, 1.46e-2)
        assert dw <= 3 * ref_dw, summary


@pytest.mark.parametrize("field, value", [("block_t", 8), ("block_v", 48), ("block_d", 0), ("vocab_splits", 0)])
def test_tiles_triton_cannot_compile_are_rejected(field, value):
    sizes = dict(block_t=16, block_v=32, block_d=16)
    with pytest.raises(ValueError, match=f"TileConfig.{field} must be"):
        TileConfig(**{**sizes, field: value})


# ---------------------------------------------------------------- the library formulation (library.py)

LIBRARY_CASES = {  # (make_inputs arguments, run modes, tolerance of the gradients)
    "fp32": (dict(), dict(), FP32_TOL),
    "fp32-logprob-only": (dict(), dict(with_entropy=False, use_ent=False), FP32_TOL),
    "fp32-entropy-only": (dict(), dict(use_lp=False), FP32_TOL),
    "fp32-frozen-head": (dict(), dict(grad_w=False), FP32_TOL),
    "fp32-large-logits": (dict(scale=300.0), dict(use_ent=False), dict(rtol=1e-5, atol=1e-4)),
    # the bf16 weight gradient rounds nearly the same sums to bf16: one bf16 step apart where a sum sits
    # on a rounding boundary, as for the kernel (test_fp32_hidden_with_bf16_weight)
    "bf16-weight": (dict(w_dtype=torch.bfloat16), dict(), dict(rtol=2**-6, atol=1e-5)),
    # one fp16 ulp of the outputs: the logit gradient is rounded to fp16 before its GEMMs, as the kernel's
    "fp16": (dict(dtype=torch.float16), dict(), dict(rtol=2e-3, atol=4e-3)),
}


@pytest.mark.parametrize("case", list(LIBRARY_CASES))
def test_library_matches_reference(device, case):
    make, mode, grad_tol = LIBRARY_CASES[case]
    hidden, weight, targets, upstream = make_inputs(40, 48, 100, device, **make)
    targets[4:7] = torch.tensor([-1, -100, -5])
    got, want = run(library, hidden, weight, targets, upstream, **mode), run(reference, hidden, weight, targets,
                                                                             upstream, **mode)
    assert_all_close(got[:2], want[:2], **FP32_TOL)  # the same fp32 log-softmax of fp32-level logits
    assert_all_close((None, None) + got[2:], (None, None) + want[2:], **grad_tol)


def test_library_with_a_logit_floor(device):
    hidden, weight, targets, upstream, floor = floor_case(device)
    got = run(lambda h, w, y, *, with_entropy: token_logprobs_library(
        h, w, y, chunk_tokens=7, with_entropy=with_entropy, floor=floor), hidden, weight, targets, upstream)
    assert_all_close(got, run(with_floor(reference, floor), hidden, weight, targets, upstream), **FP32_TOL)


@pytest.mark.parametrize("w_dtype, gemms", [(torch.bfloat16, (3, 3 + 3 + 1)), (torch.float32, (6, 6 + 6 + 1))])
def test_library_gemm_count(w_dtype, gemms):
    """GEMM launches per chunk (module docstring's table): fp32 hidden states with a bf16 weight (the
    model's case) 3 forward, 3 + 3 + 1 backward; an fp32 weight (3 parts) 6, 6 + 6 + 1."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGemms(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                self.count += 1
            return func(*args, **(kwargs or {}))

    hidden, weight, targets, upstream = make_inputs(8, 16, 64, torch.device("cpu"), w_dtype=w_dtype)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    with CountGemms() as forward:
        lp = token_logprobs_library(h, w, targets, chunk_tokens=None, with_entropy=False)[0]
    with CountGemms() as backward:
        (lp * upstream[0]).sum().backward()
    assert (forward.count, backward.count) == gemms
