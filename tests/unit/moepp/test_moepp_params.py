"""Optimizer parameter grouping and parameter accounting (tiny models and the 8B config on meta)."""

import torch
from transformers import ZayaConfig, ZayaForCausalLM

from moepp_testlib import config_of, random_reference
from zrl.moepp.config import zaya1_8b_config
from zrl.moepp.model import MoEPPForCausalLM
from zrl.modeling.params import count_parameters, optimizer_param_groups


def test_groups_cover_every_parameter_once():
    for tied in (True, False):
        model = MoEPPForCausalLM(config_of(random_reference(tie_word_embeddings=tied)))
        groups = optimizer_param_groups(model)
        names = list(groups["muon"]) + list(groups["adamw"])
        assert sorted(names) == sorted(n for n, _ in model.named_parameters())
        assert len(names) == len(set(names))
        ids = [id(p) for g in groups.values() for p in g.values()]
        assert len(ids) == len(set(ids))


def test_group_membership():
    model = MoEPPForCausalLM(config_of(random_reference(tie_word_embeddings=False, attention_bias=True)))
    groups = optimizer_param_groups(model)
    muon, adamw = set(groups["muon"]), set(groups["adamw"])
    layer = "layers.1."
    for name in ("self_attn.qkv_proj.q_proj.weight", "self_attn.qkv_proj.k_proj.weight",
                 "self_attn.qkv_proj.v_proj_current.weight", "self_attn.qkv_proj.v_proj_delayed.weight",
                 "self_attn.o_proj.weight", "mlp.gate.down_proj.weight", "mlp.gate.router_mlp.fc1.weight",
                 "mlp.gate.router_mlp.fc2.weight", "mlp.gate.router_mlp.out_proj.weight",
                 "mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        assert layer + name in muon, name
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "input_hidden_states_scale",
                 layer + "self_attn.qkv_proj.conv_qk_depthwise.weight", layer + "self_attn.qkv_proj.conv_qk_grouped.weight",
                 layer + "self_attn.qkv_proj.q_proj.bias", layer + "self_attn.qk_norm.temp",
                 layer + "mlp.gate.router_states_scale", layer + "mlp.gate.down_proj.bias",
                 layer + "mlp.gate.router_mlp.norm.weight", layer + "post_mlp_residual_scale.residual_bias"):
        assert name in adamw, name
    # matrices in Muon (the 3-D expert tensors count as E matrices); conv kernels are 3-D but AdamW
    assert all(p.dim() in (2, 3) for p in groups["muon"].values())
    assert all(p.dim() == 1 or "conv" in n or n in ("embed_tokens.weight", "lm_head.weight")
               for n, p in groups["adamw"].items())


def hand_count_8b() -> dict[str, int]:
    """ZAYA1-8B parameters from the architecture alone (ZAYA1-8B report Table I numbers)."""
    d, layers, hq, hk, hd, e, f, r, v = 2048, 40, 8, 2, 128, 16, 2048, 256, 262_272
    conv_c = (hq + hk) * hd
    attention = (d * hq * hd + d * hk * hd + 2 * d * hk * hd // 2 + hq * hd * d  # q, k, v halves, o
                 + conv_c * 2 + conv_c  # depthwise kernel 2 + bias
                 + conv_c * (conv_c // (hq + hk)) * 2 + conv_c  # grouped kernel 2 + bias
                 + hk)  # key temperatures
    router = (d * r + r) + r + 2 * (r * r + r) + r * (e + 1) + r  # down, norm, fc1, fc2, out, EDA scale
    experts = e * (2 * f * d + d * f)
    norms_and_scales = 2 * d + 2 * 4 * d
    per_layer = attention + router + experts + norms_and_scales
    total = v * d + 2 * d + layers * per_layer + d - r  # embedding, input scale/bias, final norm; no EDA in layer 0
    return {"total": total, "embedding": v * d, "expert": layers * experts}


def test_8b_parameter_counts_on_meta():
    with torch.device("meta"):
        model = MoEPPForCausalLM(zaya1_8b_config())
    counts = count_parameters(model)
    hand = hand_count_8b()
    assert (counts.total, counts.embedding, counts.expert) == (hand["total"], hand["embedding"], hand["expert"])
    with torch.device("meta"):
        reference = ZayaForCausalLM(ZayaConfig())
    assert counts.total == sum(p.numel() for p in reference.parameters())
    # The ZAYA1-8B report (Table I) and the AMD platform paper count without the (tied) embedding: 8.3-8.4B total, 0.76B active
    # ("0.7B active, 8B total" rounded). Measured: 8,303,355,728 total and 753,608,528 active.
    assert counts.non_embedding == 8_303_355_728 and counts.active_non_embedding == 753_608_528
    assert 8.25e9 < counts.non_embedding < 8.45e9
    assert 0.745e9 < counts.active_non_embedding < 0.765e9
    assert counts.total == 8_840_488_784  # with the 537M-parameter embedding
    assert counts.active == counts.total - counts.expert * 15 // 16
