"""Chunked fp32 LM-head log-probabilities and entropy vs the full log_softmax (values and gradients).

These run the model's entry point with the default backend (the reference on CPU); the Triton
kernel's parity with it is tested in zrl/modeling/kernels/lm_logprobs/test_lm_logprobs.py.
"""

import math

import pytest
import torch

from moepp_testlib import ours_from_reference, random_reference
from zrl.modeling.kernels.lm_logprobs import token_logprobs
from zrl.modeling.logprobs import chunked_token_logprobs, default_chunk_tokens

T, D, V = 11, 8, 37


def inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, D, generator=gen) * 2).to(dtype).requires_grad_()
    weight = torch.randn(V, D, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[3] = -100  # no target here
    return hidden, weight, targets


def full_reference(hidden, weight, targets):
    logp = torch.log_softmax(hidden.float() @ weight.float().t(), dim=-1)  # [T, V]
    lp = logp.gather(1, targets.clamp_min(0)[:, None])[:, 0].masked_fill(targets < 0, 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("chunk", [1, 3, T, 64])
def test_values_and_gradients_match_full_log_softmax(chunk):
    h1, w1, y = inputs()
    h2, w2, _ = inputs()
    lp, ent = chunked_token_logprobs(h1, w1, y, chunk_tokens=chunk, with_entropy=True)
    lp_ref, ent_ref = full_reference(h2, w2, y)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-6, atol=1e-6)
    gen = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()
    # measured max abs differences 5.5e-6 (hidden grads up to 3.4) and 1.5e-5 (weight grads up to 5.4):
    # fp32 sums over V and T in another order
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)


def test_ignored_targets_give_zero_and_no_gradient():
    hidden, weight, targets = inputs()
    lp, _ = chunked_token_logprobs(hidden, weight, targets, chunk_tokens=4)
    assert lp[3] == 0
    lp[3].backward()
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_uniform_logits_hand_values():
    # A zero head gives uniform logits: logprob = -ln V, entropy = ln V; d logprob / d logits = onehot - 1/V.
    hidden = torch.ones(2, D, requires_grad=True)
    weight = torch.zeros(V, D, requires_grad=True)
    lp, ent = chunked_token_logprobs(hidden, weight, torch.tensor([0, 5]), chunk_tokens=1, with_entropy=True)
    torch.testing.assert_close(lp, torch.full((2,), -math.log(V)))
    torch.testing.assert_close(ent, torch.full((2,), math.log(V)))
    lp[1].backward()
    expected = -torch.ones(V, D) / V  # d lp / d W[j] = (onehot_j - 1/V) * hidden
    expected[5] += 1.0
    torch.testing.assert_close(weight.grad, expected)
    assert hidden.grad.abs().max() == 0  # the weight is zero


def test_bf16_inputs_computed_in_fp32():
    h, w, y = inputs(torch.bfloat16)
    lp, _ = chunked_token_logprobs(h, w, y, chunk_tokens=4)
    assert lp.dtype == torch.float32
    lp_ref, _ = full_reference(h, w, y)  # fp32 math on the same bf16 values
    torch.testing.assert_close(lp, lp_ref, rtol=1e-6, atol=1e-6)
    lp.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_model_entry_point_is_the_kernel_dispatcher():
    # one implementation: without a sampling distribution the model's op is the dispatcher of
    # zrl.modeling.kernels.lm_logprobs, unchanged (the sampling distributions: test_moepp_sampling_logprobs.py)
    h, w, y = inputs()
    ours, theirs = chunked_token_logprobs(h, w, y, with_entropy=True), token_logprobs(h, w, y, with_entropy=True)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b) and type(a.grad_fn) is type(b.grad_fn)


def test_default_chunk_keeps_logits_block_small():
    assert default_chunk_tokens(262_272) == 255  # 255 x 262272 x 4 bytes < 256 MiB
    assert default_chunk_tokens(96) > 100_000


def test_model_token_logprobs_equal_full_logits():
    m = ours_from_reference(random_reference(seed=6, skip_bias=0.0))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, 9), generator=gen)
    targets = torch.randint(0, 96, (2, 9), generator=gen)
    targets[:, -1] = -1
    out = m.token_logprobs(ids, targets, with_entropy=True, chunk_tokens=5)
    assert out.logprobs.shape == (2, 9) and out.entropy.shape == (2, 9)
    logp = torch.log_softmax(m(ids).logits, dim=-1)
    expected = logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0].masked_fill(targets < 0, 0.0)
    torch.testing.assert_close(out.logprobs, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.entropy, -(logp.exp() * logp).sum(-1), rtol=1e-6, atol=1e-6)
    through_forward = m(ids, targets=targets, with_entropy=True, chunk_tokens=5)
    assert torch.equal(through_forward.logprobs, out.logprobs) and torch.equal(through_forward.entropy, out.entropy)
    with pytest.raises(ValueError, match="targets shape"):
        m.token_logprobs(ids, targets[0])
