"""Hugging Face checkpoint interchange: save -> transformers load, transformers save -> our load, shards."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import ZayaForCausalLM

from moepp_testlib import ours_from_reference, random_reference, relative_error
from zrl.modeling.hf_io import INDEX_FILE, SINGLE_FILE
from zrl.moepp.checkpoint import load_hf_checkpoint, save_hf_checkpoint

SKIP_BIAS = 0.05  # not the -1.0 that transformers writes back on load


def ids():
    return torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(0))


def assert_same_tensors(ours, ref):
    ref_state = {k: v for k, v in ref.state_dict().items() if "rotary_emb" not in k}
    if ours.lm_head is None:
        ref_state.pop("lm_head.weight")
    ours_state = {("" if k == "lm_head.weight" else "model.") + k: v for k, v in ours.state_dict().items()}
    assert ours_state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert ours_state[key].dtype == value.dtype and torch.equal(ours_state[key], value), key


@pytest.mark.parametrize("tied", [True, False])
def test_save_then_transformers_load(tmp_path, tied):
    ours = ours_from_reference(random_reference(seed=1, skip_bias=SKIP_BIAS, tie_word_embeddings=tied))
    save_hf_checkpoint(ours, tmp_path)
    with safe_open(tmp_path / SINGLE_FILE, framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)  # a tied head is not duplicated
    loaded = ZayaForCausalLM.from_pretrained(tmp_path).eval()
    # The trap (transformers 5.19): from_pretrained resets the skip-class balancing bias to -1.0.
    for ref_layer, layer in zip(loaded.model.layers, ours.layers):
        assert ref_layer.mlp.gate.balancing_biases[-1] == -1.0
        assert layer.mlp.gate.balancing_biases[-1] == SKIP_BIAS
        ref_layer.mlp.gate.balancing_biases.copy_(layer.mlp.gate.balancing_biases)  # undo it, then compare
    assert_same_tensors(ours, loaded)
    with torch.no_grad():
        assert relative_error(ours(ids()).logits, loaded(ids()).logits) < 1e-5  # measured 4.5e-7


def test_transformers_save_then_our_load_keeps_every_bias(tmp_path):
    ref = random_reference(seed=2, skip_bias=SKIP_BIAS, attention_bias=True)
    ref.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    assert_same_tensors(ours, ref)
    assert all(layer.mlp.gate.balancing_biases[-1] == SKIP_BIAS for layer in ours.layers)
    assert all(p.requires_grad for p in ours.parameters())
    with torch.no_grad():
        assert relative_error(ours(ids()).logits, ref(ids()).logits) < 1e-5


def test_sharded_checkpoints_both_ways(tmp_path):
    ref = random_reference(seed=3, skip_bias=SKIP_BIAS)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / INDEX_FILE).exists() and not (tmp_path / "hf" / SINGLE_FILE).exists()
    ours = load_hf_checkpoint(tmp_path / "hf")
    assert_same_tensors(ours, ref)

    save_hf_checkpoint(ours, tmp_path / "ours", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "ours" / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and all((tmp_path / "ours" / s).exists() for s in shards)
    reloaded = load_hf_checkpoint(tmp_path / "ours")
    assert_same_tensors(reloaded, ref)
    hf_reloaded = ZayaForCausalLM.from_pretrained(tmp_path / "ours")
    for ref_layer, layer in zip(hf_reloaded.model.layers, ours.layers):
        ref_layer.mlp.gate.balancing_biases.copy_(layer.mlp.gate.balancing_biases)
    assert_same_tensors(ours, hf_reloaded)


def test_bf16_save_and_load_keep_biases_fp32(tmp_path):
    ours = ours_from_reference(random_reference(seed=4, skip_bias=SKIP_BIAS))
    save_hf_checkpoint(ours, tmp_path, dtype=torch.bfloat16)
    tensors = load_file(tmp_path / SINGLE_FILE)
    assert tensors["model.layers.0.mlp.gate.balancing_biases"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    loaded = load_hf_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.layers[2].mlp.gate.balancing_biases, ours.layers[2].mlp.gate.balancing_biases)


def rewrite(path, edit):
    tensors = load_file(path / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, error, match", [
    (lambda t: t.pop("model.layers.1.self_attn.qk_norm.temp"), KeyError, "missing.*qk_norm.temp"),
    (lambda t: t.update(extra=torch.zeros(1)), KeyError, "unexpected checkpoint key 'extra'"),
    (lambda t: t.update({"model.layers.0.extra": torch.zeros(1)}), KeyError, "unexpected.*layers.0.extra"),
    (lambda t: t.update({"model.norm.weight": torch.ones(3)}), ValueError, "model.norm.weight has shape"),
    (lambda t: t.update({"lm_head.weight": torch.ones(96, 64)}), ValueError, "differs"),
])
def test_load_rejects_mismatched_checkpoints(tmp_path, edit, error, match):
    save_hf_checkpoint(ours_from_reference(random_reference(seed=5)), tmp_path)
    rewrite(tmp_path, edit)
    with pytest.raises(error, match=match):
        load_hf_checkpoint(tmp_path)


def test_tied_head_stored_anyway_is_accepted(tmp_path):
    ours = ours_from_reference(random_reference(seed=5))
    save_hf_checkpoint(ours, tmp_path)
    rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert torch.equal(load_hf_checkpoint(tmp_path).embed_tokens.weight, ours.embed_tokens.weight)


def test_missing_files(tmp_path):
    save_hf_checkpoint(ours_from_reference(random_reference(seed=5)), tmp_path)
    (tmp_path / SINGLE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)
