"""The model contract's registry and its two families: resolution from tiny checkpoints, the HF names
weight sync and export send, the routing layout, routing statistics and the planner's FLOP model."""

import json

import pytest
import torch
from safetensors import safe_open

from zrl.models import (ROUTING_CAPTURE_KINDS, family_of, family_of_checkpoint, get_family, model_type_of, register,
                        registered_types)
from zrl.moepp.config import zaya1_8b_config
from zrl.trainer.export import iter_full_tensors, weight_specs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {model_type: get_family(model_type).build_tiny(root / model_type) for model_type in ("zaya", "qwen3_moe")}


def checkpoint_keys(path) -> set[str]:
    keys = set()
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def test_unknown_model_type_is_one_line_listing_the_registered_ones():
    with pytest.raises(ValueError, match=r"^model_type 'llama' is not supported; registered: glm4_moe, qwen3_moe, zaya$"):
        get_family("llama")
    with pytest.raises(ValueError, match="no model_type"):
        model_type_of({"architectures": ["X"]})
    assert registered_types() == ["glm4_moe", "qwen3_moe", "zaya"]


def test_a_duplicate_registration_raises():
    with pytest.raises(ValueError, match="'zaya' is already registered"):
        register("zaya", "somewhere:Else")


@pytest.mark.parametrize("model_type, architecture, width", [("zaya", "ZayaForCausalLM", 2),  # L = 2, top-1
                                                             ("qwen3_moe", "Qwen3MoeForCausalLM", 3 * 2)])  # L * k
def test_each_family_resolves_from_its_checkpoint(checkpoints, model_type, architecture, width):
    path = checkpoints[model_type]
    family = family_of_checkpoint(path)
    assert family is get_family(model_type) and family.model_type == model_type
    raw = json.loads((path / "config.json").read_text())
    assert family.vllm_architecture == architecture == raw["architectures"][0]
    assert family.routing_capture in ROUTING_CAPTURE_KINDS
    config = family.read_config(path)
    shape = family.shape(config)
    assert shape.routing_width == width and shape.vocab_size == raw["vocab_size"]
    with torch.device("meta"):
        model = family.build(config)
    assert family_of(model) is family
    assert family.fsdp_units(model) == list(model.layers)
    # the state dict loads into the model the family builds, with exactly its names and shapes
    state = family.load_state_dict(path, dtype=torch.float32)
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("model_type", ["zaya", "qwen3_moe"])
def test_weight_sync_names_are_the_checkpoint_keys(checkpoints, model_type):
    """What the trainer streams to the engines (and `weight_specs` announces) is the HF files' layout:
    for Qwen3-MoE the fused expert tensors go out as per-expert matrices."""
    path = checkpoints[model_type]
    family = get_family(model_type)
    model = family.build(family.read_config(path))
    model.load_state_dict(family.load_state_dict(path, dtype=torch.float32))
    sent = list(iter_full_tensors(model, torch.bfloat16))
    assert {k for k, _ in sent} == checkpoint_keys(path)
    assert weight_specs(model, torch.bfloat16) == [(k, tuple(t.shape), t.dtype) for k, t in sent]
    with safe_open(next(path.glob("*.safetensors")), framework="pt") as f:
        for key, tensor in sent:
            if key in f.keys():
                torch.testing.assert_close(tensor, f.get_tensor(key).to(tensor.dtype), rtol=0, atol=0)


def test_routing_metrics_per_family():
    # MoE++: [L, E + 1] with the skip class last
    zaya = get_family("zaya").routing_metrics(torch.tensor([[1, 1, 0], [2, 0, 2]]))
    assert zaya == pytest.approx({"routing/load_entropy_mean": 0.5, "routing/load_max": 1.0,
                                  "routing/skip_frac_mean": 0.25})
    # Qwen3-MoE: [L, E], no skip class; the dense layer's row (0s) is not a layer with a load
    qwen = get_family("qwen3_moe").routing_metrics(torch.tensor([[2, 2, 2, 2], [0, 0, 0, 0], [4, 0, 0, 0]]))
    assert qwen == pytest.approx({"routing/load_entropy_mean": 0.5, "routing/load_max": 1.0})


def test_flop_models_reproduce_the_published_parameter_counts():
    # ZAYA1-8B: 0.754B active non-embedding, the planner's default 0.76B (bench/results/plan_zaya1.md)
    zaya = get_family("zaya").flop_model(zaya1_8b_config())
    assert zaya.active_params == pytest.approx(0.76e9, rel=0.01)  # counted 0.7536e9
    assert (zaya.num_layers, zaya.attention_dim) == (40, 8 * 128)
    # Qwen3-30B-A3B (its config.json on the Hub): 30.5B total, 3.3B activated counting the embedding and
    # the untied LM head, which the FLOP model leaves out of active_params
    family = get_family("qwen3_moe")
    config = family.parse_config(dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
        max_position_embeddings=40960))
    qwen = family.flop_model(config)
    embedding = 2 * 151936 * 2048
    assert qwen.total_params == pytest.approx(30.5e9, rel=0.005)  # counted 30.53e9
    assert qwen.active_params + embedding == pytest.approx(3.3e9, rel=0.02)  # counted 3.35e9
    assert family.shape(config).routing_width == 48 * 8 and qwen.attention_dim == 32 * 128


def test_router_bias_update_is_refused_without_balancing_biases(checkpoints):
    family = get_family("qwen3_moe")
    with torch.device("meta"):
        model = family.build(family.read_config(checkpoints["qwen3_moe"]))
    with pytest.raises(ValueError, match="algorithm.router_bias_update: qwen3_moe models have no router"):
        family.bias_balancer(model, lr=1e-3)
