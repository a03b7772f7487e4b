"""GLM-4.5 checkpoints: the tiny model `zrl init-tiny-model --arch glm4_moe` builds, export that
transformers loads back, multi-token-prediction layers skipped, what the config refuses, and the
GLM-4.5-Air parameter counts the recipe and the plan quote."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeForCausalLM

from glm4_moe_testlib import next_token_targets, packed_documents
from zrl.assets import is_checkpoint_dir
from zrl.glm4_moe.config import Glm4MoEConfig
from zrl.modeling.config import ConfigError
from zrl.models import family_of_checkpoint, get_family

AIR = dict(  # zai-org/GLM-4.5-Air's config.json (recipes/glm-4.5-air.yaml)
    architectures=["Glm4MoeForCausalLM"], attention_bias=True, attention_dropout=0.0, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338], head_dim=128, hidden_act="silu", hidden_size=4096,
    partial_rotary_factor=0.5, initializer_range=0.02, intermediate_size=10944, max_position_embeddings=131072,
    model_type="glm4_moe", moe_intermediate_size=1408, norm_topk_prob=True, num_attention_heads=96, n_group=1,
    topk_group=1, n_routed_experts=128, n_shared_experts=1, routed_scaling_factor=1.0, num_experts_per_tok=8,
    first_k_dense_replace=1, num_hidden_layers=46, num_key_value_heads=8, num_nextn_predict_layers=1,
    rms_norm_eps=1e-05, rope_scaling=None, rope_theta=1000000, tie_word_embeddings=False, torch_dtype="bfloat16",
    transformers_version="4.54.0", use_cache=True, use_qk_norm=False, vocab_size=151552)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return get_family("glm4_moe").build_tiny(tmp_path_factory.mktemp("tiny-glm4-moe"), seed=0)


def _logprobs(model, docs):
    ids, cu = torch.cat(docs), [0]
    for d in docs:
        cu.append(cu[-1] + len(d))
    with torch.no_grad():
        return model.token_logprobs(ids, next_token_targets(docs), cu_seqlens=cu).logprobs


def test_tiny_checkpoint_loads_and_matches_transformers(tiny_dir):
    assert is_checkpoint_dir(tiny_dir) and (tiny_dir / "tokenizer.json").is_file()
    family = family_of_checkpoint(tiny_dir)
    ours = family.load_model(tiny_dir, dtype=torch.float32).eval()
    ref = Glm4MoeForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    config = ours.config
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.moe_layers) == (8, 2, 4, (1, 2))
    assert config.rotary_dim == 16 and family.shape(config).routing_width == 6
    docs, _, _ = packed_documents(1, [9, 4, 12])
    targets = next_token_targets(docs)
    with torch.no_grad():
        expected = torch.cat([ref(d[None]).logits[0] for d in docs])
    expected_lp = torch.log_softmax(expected, -1).gather(1, targets.clamp_min(0)[:, None])[:, 0]
    has_target = targets >= 0
    assert (_logprobs(ours, docs)[has_target] - expected_lp[has_target]).abs().max() <= 1e-5


def test_export_loads_back_into_transformers(tiny_dir, tmp_path):
    family = get_family("glm4_moe")
    ours = family.load_model(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    family.save_hf_checkpoint(ours.state_dict(), tmp_path, config=ours.config, dtype=torch.bfloat16)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32  # kept fp32
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved  # one matrix per expert, the Hub's layout
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 0
    ref = Glm4MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    torch.testing.assert_close(ref.model.layers[1].mlp.gate.e_score_correction_bias, torch.linspace(-0.1, 0.1, 8))
    assert Glm4MoEConfig.from_pretrained_dir(tmp_path) == ours.config


def test_multi_token_prediction_layers_are_skipped(tiny_dir, tmp_path):
    """A checkpoint with an MTP layer after the decoder (as the Hub's GLM-4.5 files) loads the same model."""
    tensors = load_file(tiny_dir / "model.safetensors")
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.2.")}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **mtp}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    family = get_family("glm4_moe")
    with_mtp, plain = family.load_model(tmp_path, dtype=torch.float32), family.load_model(tiny_dir, dtype=torch.float32)
    assert with_mtp.config == plain.config and len(with_mtp.layers) == 3
    docs, _, _ = packed_documents(2, [7, 5])
    assert torch.equal(_logprobs(with_mtp, docs), _logprobs(plain, docs))


@pytest.mark.parametrize("change, key", [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 2}, "topk_group"),
    ({"first_k_dense_replace": 46}, "first_k_dense_replace"),
    ({"partial_rotary_factor": 39 / 128}, "partial_rotary_factor"),  # an odd number of rotated channels
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor"),
    ({"n_routed_experts": 256, "num_local_experts": 256}, "n_routed_experts"),
    ({"sliding_window": 4096}, "sliding_window"),
])
def test_config_refuses_what_it_cannot_run_naming_the_key(change, key):
    with pytest.raises(ConfigError, match=key):
        Glm4MoEConfig.from_hf_dict({**AIR, **change})


def test_air_parameter_counts():
    family = get_family("glm4_moe")
    config = family.parse_config(AIR)
    assert Glm4MoEConfig.from_hf_dict(config.to_hf_dict()) == config
    flops = family.flop_model(config)
    assert (flops.total_params, flops.active_params) == (106_852_245_504, 12_182_609_920)
    assert (flops.num_layers, flops.attention_dim) == (46, 12288)
    shape = family.shape(config)
    assert (shape.num_experts, shape.experts_per_token, shape.routing_width, shape.skip_class) == (128, 8, 368, False)
