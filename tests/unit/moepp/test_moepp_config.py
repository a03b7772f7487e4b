"""MoEPPConfig: parsing HF zaya configs, round trips, rejection of unsupported settings."""

import json
import subprocess
import sys

import pytest
from transformers import ZayaConfig

from moepp_testlib import zaya_config
from zrl.modeling.config import ConfigError
from zrl.moepp.config import MoEPPConfig, zaya1_8b_config


def hf_dict(**overrides) -> dict:
    return zaya_config(**overrides).to_diff_dict()


def test_parses_what_transformers_saves(tmp_path):
    zaya_config(num_experts=8, cca_time0=3, attention_bias=True, tie_word_embeddings=False).save_pretrained(tmp_path)
    cfg = MoEPPConfig.from_pretrained_dir(tmp_path)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.cca_time0, cfg.cca_time1) == (64, 3, 8, 3, 2)
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (5_000_000.0, 0.5, 8)
    assert (cfg.num_router_classes, cfg.skip_expert_id, cfg.num_key_value_groups) == (9, 8, 2)
    assert cfg.passthrough["bos_token_id"] == 1


def test_round_trip_through_transformers(tmp_path):
    raw = hf_dict()
    raw["rope_parameters"] = {"hybrid": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}}
    cfg = MoEPPConfig.from_hf_dict(raw)
    assert cfg.rope_theta == 1e4 and cfg.rotary_dim == 4
    assert MoEPPConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    cfg.save_json(tmp_path)
    hf = ZayaConfig.from_pretrained(tmp_path)
    assert hf.rope_parameters["hybrid"]["rope_theta"] == 1e4
    assert (hf.hidden_size, hf.num_experts, hf.head_dim, hf.layer_types) == (64, 4, 16, ["hybrid"] * 3)
    assert MoEPPConfig.from_hf_dict(hf.to_diff_dict()) == cfg


def test_legacy_flat_rope_keys_and_missing_head_dim():
    raw = hf_dict()
    del raw["rope_parameters"], raw["head_dim"]
    raw.update(rope_theta=10_000.0, partial_rotary_factor=1.0)
    cfg = MoEPPConfig.from_hf_dict(raw)
    assert (cfg.rope_theta, cfg.head_dim, cfg.rotary_dim) == (10_000.0, 16, 16)  # head_dim = 64 / 4


def test_8b_preset_matches_transformers_defaults():
    # to_dict() also carries the generic PreTrainedConfig keys (id2label, return_dict, ...).
    assert MoEPPConfig.from_hf_dict(ZayaConfig().to_dict()) == zaya1_8b_config()


@pytest.mark.parametrize("change, key", [
    ({"num_experts_per_tok": 2}, "num_experts_per_tok"),
    ({"layer_types": ["hybrid", "hybrid_sliding", "hybrid"], "sliding_window": None}, "layer_types[1]"),
    ({"layer_types": ["hybrid", "mamba", "hybrid"]}, "layer_types[1]"),
    ({"layer_types": ["hybrid"]}, "layer_types"),
    ({"sliding_window": 128}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"lm_head_bias": True}, "lm_head_bias"),
    ({"rope_parameters": {"hybrid": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}}, "rope_type"),
    ({"rope_parameters": {"hybrid": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}}, "factor"),
    ({"rope_parameters": {"hybrid_sliding": {"rope_theta": 1e4}}}, "hybrid"),
    ({"rope_scaling": {"type": "linear"}}, "rope_scaling"),
    ({"model_type": "llama"}, "model_type"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"num_experts": 255}, "num_experts"),
    ({"num_experts": 0}, "num_experts"),
    ({"hidden_size": True}, "hidden_size"),
    ({"rope_parameters": {"hybrid": {"partial_rotary_factor": 0.0625}}}, "partial_rotary_factor"),  # 1 channel
    ({"rope_parameters": {"hybrid": {"partial_rotary_factor": 1.5}}}, "partial_rotary_factor"),
    ({"pad_token_id": 96}, "pad_token_id"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"mystery_switch": 1}, "mystery_switch"),
])
def test_rejects_unsupported_with_the_key_named(change, key):
    raw = hf_dict()
    raw.update(change)
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        MoEPPConfig.from_hf_dict(raw)


def test_missing_key_named():
    raw = hf_dict()
    del raw["router_hidden_size"]
    with pytest.raises(ConfigError, match="router_hidden_size"):
        MoEPPConfig.from_hf_dict(raw)


def test_unknown_keys_ignored_when_not_strict(caplog):
    raw = hf_dict() | {"mystery_switch": 1}
    cfg = MoEPPConfig.from_hf_dict(raw, strict=False)
    assert cfg == MoEPPConfig.from_hf_dict(hf_dict())
    assert "mystery_switch" in caplog.text


def test_passthrough_written_back():
    raw = hf_dict() | {"max_position_embeddings": 4096}
    out = MoEPPConfig.from_hf_dict(raw).to_hf_dict()
    assert out["max_position_embeddings"] == 4096 and out["eos_token_id"] == 2
    json.dumps(out)  # serialisable


def test_config_module_does_not_import_torch():
    code = "import sys, zrl.moepp.config; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
