"""Exactness against transformers' Qwen3MoeForCausalLM (fp32): a packed multi-document stream vs each
document run alone by transformers; logits, log-probs, the routers' top-k and gradients."""

import pytest
import torch

from qwen3_moe_testlib import VOCAB, next_token_targets, ours_from_reference, packed_documents, random_reference
from zrl.types import NO_ROUTE

# Tiny configs that move every part: GQA with a dense middle layer and renormalised top-2; MQA with
# attention biases, a tied head and un-normalised top-4 on every second layer; MHA top-1.
CONFIGS = {
    "gqa_top2_norm_dense1": dict(seed=0, mlp_only_layers=[1]),
    "mqa_bias_tied_top4_step2": dict(seed=1, num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True,
                                     num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2,
                                     num_hidden_layers=4, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": 100.0}),
    "mha_top1": dict(seed=2, num_key_value_heads=4, num_experts_per_tok=1, norm_topk_prob=False, head_dim=32),
}
LENGTHS = [11, 3, 17, 1, 9]  # a one-token document, and two of equal length
# Measured max |ours - transformers| over these configs (max |logit| 3.4 .. 4.6): 2.7e-6 on the logits,
# 9.5e-7 on the log-probs (2026-11-27, CPU, torch 2.13). Bound: 1e-5 absolute on both.
ATOL = 1e-5
# Measured max relative gradient error (max |g - g_ref| / max |g_ref| per parameter) over the two configs:
# 7.1e-7 (fp32 sums in another order).
GRAD_RTOL = 1e-5


def reference_per_document(ref, docs):
    """transformers' logits of each document alone ([T, V] concatenated) and its routers' top-k per layer."""
    logits, topk = [], []
    with torch.no_grad():
        for doc in docs:
            out = ref(doc[None], output_router_logits=True)
            logits.append(out.logits[0])
            k = ref.config.num_experts_per_tok
            topk.append([torch.softmax(r.float(), dim=-1).topk(k, dim=-1).indices for r in out.router_logits])
    return torch.cat(logits), [torch.cat([t[i] for t in topk]) for i in range(len(topk[0]))]


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

    # the record: [T, L * k] uint8, layer l at columns l*k .. l*k + k - 1, the routers' own top-k there
    config = ours.config
    k = config.num_experts_per_tok
    assert out.routing.chosen_ids.shape == (ids.numel(), config.num_hidden_layers * k)
    assert out.routing.chosen_ids.dtype == torch.uint8
    native = out.routing.native_ids.long().view(ids.numel(), config.num_hidden_layers, k)
    assert len(expected_topk) == len(config.moe_layers)
    for layer_idx, ref_topk in zip(config.moe_layers, expected_topk):
        assert torch.equal(native[:, layer_idx].sort(dim=-1).values, ref_topk.sort(dim=-1).values)
    dense = [i for i in range(config.num_hidden_layers) if i not in config.moe_layers]
    assert (native[:, dense] == NO_ROUTE).all()
    counts = out.routing.expert_counts  # [L, E]
    assert counts.shape == (config.num_hidden_layers, config.num_experts)
    assert counts[list(config.moe_layers)].sum(dim=1).tolist() == [ids.numel() * k] * len(config.moe_layers)
    assert counts[dense].sum() == 0


@pytest.mark.parametrize("name", ["gqa_top2_norm_dense1", "mqa_bias_tied_top4_step2"])
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


def test_bf16_mode_keeps_fp32_residual_router_and_head():
    ref = random_reference(**CONFIGS["gqa_top2_norm_dense1"])
    fp32 = ours_from_reference(ref)
    bf16 = ours_from_reference(ref).to(torch.bfloat16)
    seen = []
    bf16.layers[0].register_forward_hook(lambda module, args, output: seen.append(
        (output[0].dtype, output[1].weights.dtype)))
    docs, ids, cu = packed_documents(3, LENGTHS)
    with torch.no_grad():
        expected = fp32(ids, cu_seqlens=cu)
        # the fp32 model's experts pinned, so the comparison measures rounding, not flipped experts
        out = bf16(ids, cu_seqlens=cu, routing_replay=expected.routing.chosen_ids)
    assert seen == [(torch.float32, torch.float32)]  # residual stream and router weights stay fp32
    assert out.logits.dtype == torch.float32
    # bf16 rounding through 3 random layers: measured 2.3e-2 relative on the logits
    assert float((out.logits - expected.logits).abs().max() / expected.logits.abs().max()) < 5e-2
