"""Exactness against transformers' Glm4MoeForCausalLM (fp32): a packed multi-document stream vs each
document run alone by transformers; logits, log-probs, the routers' grouped top-k and gradients."""

import pytest
import torch

from glm4_moe_testlib import VOCAB, next_token_targets, ours_from_reference, packed_documents, random_reference
from zrl.types import NO_ROUTE

# Tiny configs that move every part (every one with random correction biases and shared experts):
# - grouped: group-limited top-2 (4 groups of 2, the best 2 kept), q/k norm, attention biases, half
#   the head rotated, routed scaling 2.5, one dense first layer;
# - dense2: two dense first layers, no q/k norm, a quarter of the head rotated, two shared experts,
#   un-normalised top-3 in one group, a tied head;
# - groups_full_rope: every layer sparse, 2 groups of 4 with one kept, top-3, full RoPE with q/k norm.
CONFIGS = {
    "grouped_qknorm_bias_dense1": dict(seed=0, n_group=4, topk_group=2, use_qk_norm=True, attention_bias=True,
                                       partial_rotary_factor=0.5, routed_scaling_factor=2.5),
    "dense2_no_qknorm_quarter_rope_tied": dict(seed=1, first_k_dense_replace=2, num_hidden_layers=4,
                                               partial_rotary_factor=0.25, n_shared_experts=2, num_experts_per_tok=3,
                                               norm_topk_prob=False, tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
    "groups_full_rope_all_sparse": dict(seed=2, first_k_dense_replace=0, n_group=2, topk_group=1,
                                        num_experts_per_tok=3, partial_rotary_factor=1.0, use_qk_norm=True,
                                        num_key_value_heads=1),
}
LENGTHS = [11, 3, 17, 1, 9]  # a one-token document, and two of equal length
# Measured max |ours - transformers| over these configs: see the README's table (2026-11-28, CPU,
# torch 2.13). Bound: 1e-5 absolute on logits and log-probs.
ATOL = 1e-5
GRAD_RTOL = 1e-5


def reference_per_document(ref, docs):
    """transformers' logits of each document alone ([T, V] concatenated) and its routers' top-k per layer."""
    topk: dict[int, list[torch.Tensor]] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: topk.setdefault(i, []).append(out[2]))
             for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "gate")
             and not hasattr(layer.mlp, "gate_proj")]
    with torch.no_grad():
        logits = torch.cat([ref(doc[None]).logits[0] for doc in docs])
    for hook in hooks:
        hook.remove()
    return logits, {i: torch.cat(ids) for i, ids in topk.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_stream_matches_transformers_per_document(name):
    ref = random_reference(**CONFIGS[name])
    ours = ours_from_reference(ref)
    docs, ids, cu = packed_documents(CONFIGS[name]["seed"], LENGTHS)
    expected, expected_topk = reference_per_document(ref, docs)
    targets = next_token_targets(docs)
    with torch.no_grad():
        out = ours(ids, cu_seqlens=cu)
        lp = ours.token_logprobs(ids, targets, cu_seqlens=cu)
    assert out.logits.dtype == torch.float32 and out.logits.shape == expected.shape
    assert (out.logits - expected).abs().max() <= ATOL
    has_target = targets >= 0
    expected_lp = torch.log_softmax(expected, dim=-1).gather(1, targets.clamp_min(0)[:, None])[:, 0]
    assert (lp.logprobs[has_target] - expected_lp[has_target]).abs().max() <= ATOL
    assert torch.equal(lp.logprobs[~has_target], torch.zeros(int((~has_target).sum())))

    config = ours.config
    k = config.num_experts_per_tok
    assert out.routing.chosen_ids.shape == (ids.numel(), config.num_hidden_layers * k)
    native = out.routing.native_ids.long().view(ids.numel(), config.num_hidden_layers, k)
    assert sorted(expected_topk) == list(config.moe_layers)
    for layer_idx, ref_topk in expected_topk.items():
        assert torch.equal(native[:, layer_idx].sort(dim=-1).values, ref_topk.sort(dim=-1).values)
    dense = [i for i in range(config.num_hidden_layers) if i not in config.moe_layers]
    assert (native[:, dense] == NO_ROUTE).all()
    counts = out.routing.expert_counts  # [L, E]
    assert counts.shape == (config.num_hidden_layers, config.n_routed_experts)
    assert counts[dense].sum() == 0


def test_group_limit_and_bias_change_the_choice():
    """The configs test what they claim: the correction bias and the group limit each change some choices."""
    ref = random_reference(**CONFIGS["grouped_qknorm_bias_dense1"])
    ours = ours_from_reference(ref)
    _, ids, cu = packed_documents(0, LENGTHS)
    with torch.no_grad():
        base = ours(ids, cu_seqlens=cu).routing.native_ids
        router = ours.layers[1].mlp.gate
        bias = router.e_score_correction_bias.clone()
        router.e_score_correction_bias.zero_()
        unbiased = ours(ids, cu_seqlens=cu).routing.native_ids
        router.e_score_correction_bias.copy_(bias)
        router.topk_group = router.n_group
        ungrouped = ours(ids, cu_seqlens=cu).routing.native_ids
    k = ours.config.num_experts_per_tok
    layer1 = slice(k, 2 * k)
    assert not torch.equal(base[:, layer1], unbiased[:, layer1])
    assert not torch.equal(base[:, layer1], ungrouped[:, layer1])


@pytest.mark.parametrize("name", ["grouped_qknorm_bias_dense1", "dense2_no_qknorm_quarter_rope_tied"])
def test_gradients_match_transformers(name):
    ref = random_reference(**CONFIGS[name])
    ours = ours_from_reference(ref)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 13), generator=gen)
    weights = torch.randn(2, 13, VOCAB, generator=gen)
    (ref(ids).logits * weights).sum().backward()
    (ours(ids).logits * weights).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name_, p in ours.named_parameters():
        expected = ref_params[name_ if name_ == "lm_head.weight" else "model." + name_].grad
        if expected.abs().max() == 0:  # an expert no token chose
            assert p.grad is None or p.grad.abs().max() == 0, name_
            continue
        error = float((p.grad - expected).abs().max() / expected.abs().max())
        assert error < GRAD_RTOL, (name_, error)


def test_bf16_mode_keeps_fp32_residual_router_bias_and_head():
    ref = random_reference(**CONFIGS["grouped_qknorm_bias_dense1"])
    fp32 = ours_from_reference(ref)
    bf16 = ours_from_reference(ref).to(torch.bfloat16)
    assert bf16.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(bf16.layers[1].mlp.gate.e_score_correction_bias, fp32.layers[1].mlp.gate.e_score_correction_bias)
    seen = []
    bf16.layers[1].register_forward_hook(lambda module, args, output: seen.append(
        (output[0].dtype, output[1].weights.dtype)))
    docs, ids, cu = packed_documents(3, LENGTHS)
    with torch.no_grad():
        expected = fp32(ids, cu_seqlens=cu)
        out = bf16(ids, cu_seqlens=cu, routing_replay=expected.routing.chosen_ids)
    assert seen == [(torch.float32, torch.float32)]
    assert out.logits.dtype == torch.float32
    assert float((out.logits - expected.logits).abs().max() / expected.logits.abs().max()) < 5e-2
