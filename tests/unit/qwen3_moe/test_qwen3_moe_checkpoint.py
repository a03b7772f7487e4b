"""Loading qwen3_moe checkpoints (per-expert and fused expert layouts) and config validation."""

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeForCausalLM

from qwen3_moe_testlib import next_token_targets, packed_documents
from zrl.assets import is_checkpoint_dir
from zrl.modeling.config import ConfigError
from zrl.models import get_family
from zrl.qwen3_moe import Qwen3MoEConfig, load_hf_checkpoint, save_hf_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return get_family("qwen3_moe").build_tiny(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


def test_tiny_checkpoint_loads_and_matches_transformers(tiny_dir):
    assert is_checkpoint_dir(tiny_dir) and (tiny_dir / "tokenizer.json").is_file()
    ours = load_hf_checkpoint(tiny_dir).eval()
    ref = Qwen3MoeForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    config = ours.config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_layers) == (8, 2, (0, 2))
    assert config.routing_width == 6 and config.vocab_size == ref.config.vocab_size
    docs, ids, cu = packed_documents(1, [9, 4, 12])
    targets = next_token_targets(docs)
    with torch.no_grad():
        expected = torch.cat([ref(d[None]).logits[0] for d in docs])
        out = ours.token_logprobs(ids, targets, cu_seqlens=cu)
    has_target = targets >= 0
    expected_lp = torch.log_softmax(expected, -1).gather(1, targets.clamp_min(0)[:, None])[:, 0]
    # measured 4.8e-7 (logits 3.1e-7; the N(0, 0.02) initial weights give |logits| < 1)
    assert (out.logprobs[has_target] - expected_lp[has_target]).abs().max() <= 1e-5
    assert out.routing.chosen_ids.shape == (ids.numel(), 6)


def test_fused_expert_layout_loads_the_same(tiny_dir, tmp_path):
    ref = Qwen3MoeForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}  # in-memory: fused gate_up_proj
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    fused, per_expert = load_hf_checkpoint(tmp_path), load_hf_checkpoint(tiny_dir)
    for name, value in per_expert.state_dict().items():
        assert torch.equal(fused.state_dict()[name], value), name


def test_missing_expert_is_reported(tiny_dir, tmp_path):
    from safetensors import safe_open

    with safe_open(tiny_dir / "model.safetensors", "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(KeyError, match=r"layers\.2\.mlp\.experts\.<e>\.up_proj.*found \[0, 1, 2, 3, 4, 6, 7\]"):
        load_hf_checkpoint(tmp_path)


def hub_style_config(**changes):
    """A Qwen3-30B-A3B-style config.json as the Hub has it (legacy rope_theta, num_experts)."""
    raw = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
               intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
               head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
               rope_theta=1000000.0, rope_scaling=None, hidden_act="silu", attention_dropout=0.0,
               attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=48,
               tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
    raw.update(changes)
    return raw


def test_hub_config_parses():
    config = Qwen3MoEConfig.from_hf_dict(hub_style_config())
    assert config.rope_theta == 1e6 and config.num_experts == 128 and config.routing_width == 48 * 8
    assert len(config.moe_layers) == 48 and config.norm_topk_prob


def test_transformers_written_config_parses():
    """transformers 5 writes `num_local_experts` and nested `rope_parameters`."""
    raw = {k: v for k, v in get_family("qwen3_moe").tiny_config.items() if k != "num_experts"}
    raw.update(model_type="qwen3_moe", vocab_size=100, num_local_experts=8,
               rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    config = Qwen3MoEConfig.from_hf_dict(raw)
    assert config.num_experts == 8 and config.rope_theta == 5e5 and config.moe_layers == (0, 2)


@pytest.mark.parametrize("changes, message", [
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_theta=None, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_type='yarn'"),
    (dict(shared_expert_intermediate_size=512), "shared_expert_intermediate_size"),
    (dict(num_experts=256), "num_experts must be <= 255"),
    (dict(num_experts_per_tok=200), "exceeds num_experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_only_layers=list(range(48))), "no sparse layer"),
    (dict(model_type="qwen2_moe"), "model_type"),
    (dict(some_new_switch=True), "unsupported config key"),
])
def test_unsupported_configs_are_rejected(changes, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3MoEConfig.from_hf_dict(hub_style_config(**changes))


@pytest.mark.parametrize("max_shard_bytes", [None, 20_000])
def test_save_round_trips_through_transformers_and_back(tiny_dir, tmp_path, max_shard_bytes):
    ours = load_hf_checkpoint(tiny_dir)
    with torch.no_grad():
        for p in ours.parameters():  # moved away from the file's values, so a stale read would show
            p.add_(0.01)
    save_hf_checkpoint(ours, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_bytes is not None)
    back = load_hf_checkpoint(tmp_path)
    assert back.config == ours.config
    for name, value in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    ref = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for key, value in ref.state_dict().items():  # transformers fuses the per-expert files on load
        assert torch.equal(value, ours.state_dict()[key.removeprefix("model.")]), key


def test_config_round_trips():
    config = Qwen3MoEConfig.from_hf_dict(hub_style_config(mlp_only_layers=[3], decoder_sparse_step=2))
    assert Qwen3MoEConfig.from_hf_dict(config.to_hf_dict()) == config
