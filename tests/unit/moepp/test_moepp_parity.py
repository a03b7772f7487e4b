"""Exactness against transformers' ZayaForCausalLM (fp32), and the bf16 mode with its FP32 op set."""

import pytest
import torch

from moepp_testlib import ours_from_reference, random_reference, relative_error
from zrl.moepp import cca
from zrl.moepp.kernels.cca import cca_precondition
from zrl.modeling.precision import FP32_OPS, Fp32Op

# Tiny configs that move every part: GQA/MQA, attention biases (value bias at document starts),
# untied head, other conv kernel sizes, full/quarter RoPE, more experts. skip_bias (the skip class's
# balancing bias) is raised from -1 so that some tokens take the skip expert.
CONFIGS = {
    "gqa": dict(seed=0, skip_bias=0.0),
    "mqa_bias_untied": dict(seed=1, skip_bias=0.0, num_key_value_heads=1, attention_bias=True,
                            tie_word_embeddings=False),
    "kernels_3_1_fullrope_8experts": dict(
        seed=2, skip_bias=0.05, cca_time0=3, cca_time1=1, num_experts=8, num_hidden_layers=4,
        rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}),
    "kernels_1_3_quarter_rope": dict(
        seed=3, skip_bias=0.1, cca_time0=1, cca_time1=3, num_attention_heads=8, num_key_value_heads=2,
        head_dim=8, rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 100.0,
                                                "partial_rotary_factor": 0.25}}),
}
# Measured max relative error (max|ours - ref| / max|ref|) of the logits over these configs: 4.3e-7.
LOGIT_RTOL = 1e-5
# Measured max relative error of parameter gradients: 4.3e-6 over these configs (6.0e-6 seen on other
# seeds; fp32 sums in a different order); 2e-5 leaves room for BLAS differences between machines.
GRAD_RTOL = 2e-5


def tokens(seed, shape, vocab=96):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name):
    ref = random_reference(**CONFIGS[name])
    ours = ours_from_reference(ref)
    ids = tokens(CONFIGS[name]["seed"], (2, 29))
    with torch.no_grad():
        expected = ref(ids).logits
        out = ours(ids)
    assert out.logits.dtype == torch.float32 and out.logits.shape == expected.shape
    assert relative_error(out.logits, expected) < LOGIT_RTOL
    counts = out.routing.expert_counts  # [L, E + 1]
    assert counts[:, -1].sum() > 0, "no token took the skip expert: the config does not test it"
    assert counts[:, :-1].sum() > 0


@pytest.mark.parametrize("name", ["gqa", "mqa_bias_untied"])
def test_gradients_match_transformers(name):
    ref = random_reference(**CONFIGS[name])
    ours = ours_from_reference(ref)
    ids = tokens(7, (2, 19))
    weights = torch.randn(2, 19, 96, generator=torch.Generator().manual_seed(8))
    (ref(ids).logits * weights).sum().backward()
    (ours(ids).logits * weights).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name_, p in ours.named_parameters():
        expected = ref_params[name_ if name_ == "lm_head.weight" else "model." + name_].grad
        if expected.abs().max() == 0:
            # Experts nobody used: the reference computes expert 0 on skip tokens with weight 0.
            assert p.grad is None or p.grad.abs().max() == 0, name_
            continue
        assert relative_error(p.grad, expected) < GRAD_RTOL, name_


def test_fp32_op_set_is_the_documented_one():
    assert {op.value for op in FP32_OPS} == {"lm_head", "logprob", "cca_state", "qk_mean", "qk_norm", "rmsnorm",
                                               "router_softmax", "residual"}
    assert FP32_OPS == frozenset(Fp32Op)


def test_bf16_mode_keeps_fp32_ops(monkeypatch):
    ref = random_reference(**CONFIGS["gqa"])
    fp32 = ours_from_reference(ref)
    bf16 = ours_from_reference(ref).to(torch.bfloat16)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    assert all(layer.mlp.gate.balancing_biases.dtype == torch.float32 for layer in bf16.layers)
    assert torch.equal(bf16.layers[1].mlp.gate.balancing_biases, fp32.layers[1].mlp.gate.balancing_biases)

    seen = {}

    def record(layer_idx):
        def hook(module, args, output):
            x, routing = output
            seen[layer_idx] = (x.dtype, routing.gate.dtype, routing.state.dtype)
        return hook

    for i, layer in enumerate(bf16.layers):
        layer.register_forward_hook(record(i))
    q_dtypes = []

    def recording_precondition(*args, **kwargs):
        q, k = cca_precondition(*args, **kwargs)
        q_dtypes.append(q.dtype)
        return q, k

    monkeypatch.setattr(cca, "cca_precondition", recording_precondition)

    ids = tokens(0, (2, 29))
    with torch.no_grad():
        expected = fp32(ids)
        # Pin the fp32 model's routing so the comparison measures rounding, not flipped experts.
        out = bf16(ids, routing_replay=expected.routing.chosen_ids)
    assert out.logits.dtype == torch.float32
    # residual stream fp32, gate (router softmax) fp32, router latent in the compute dtype
    assert set(seen.values()) == {(torch.float32, torch.float32, torch.bfloat16)}
    assert q_dtypes == [torch.float32] * (2 * len(bf16.layers))  # every layer of both models
    # bf16 rounding through 3-4 random layers: measured 0.8e-2 .. 1.4e-2 relative on the logits.
    assert relative_error(out.logits, expected.logits) < 5e-2


def test_initial_values_match_reference():
    ref = random_reference(**CONFIGS["mqa_bias_untied"])
    torch.manual_seed(0)
    ref_fresh = type(ref)(ref.config)  # transformers' own initialisation
    ours = type(ours_from_reference(ref))(ours_from_reference(ref).config)
    ref_state = {k: v for k, v in ref_fresh.state_dict().items() if "rotary_emb" not in k}
    for name, value in ours.state_dict().items():
        expected = ref_state["model." + name if name != "lm_head.weight" else name]
        if value.dim() <= 1 and "bias" not in name.rsplit(".", 1)[-1] or name.endswith("balancing_biases"):
            assert torch.equal(value, expected), name  # deterministic: ones, zeros, -1 for the skip class
        elif value.dim() >= 2 and "conv" not in name and value.numel() >= 1000:
            assert abs(value.std().item() - 0.02) < 0.002, name  # N(0, 0.02), sampled
