"""Tiny CPU assets: the tokenizer and checkpoint are reproducible and load in transformers."""

import hashlib

import pytest
import torch

from zrl.assets import CHAT_TEMPLATE, build_tiny_model, build_tokenizer, is_checkpoint_dir
from zrl.models import get_family


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tokenizer_is_reproducible_and_byte_level(tmp_path):
    a = build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    assert digest(tmp_path / "a" / "tokenizer.json") == digest(tmp_path / "b" / "tokenizer.json")
    text = "what is 17 + 25? ünïcødé ✓"
    assert a.decode(a(text, add_special_tokens=False).input_ids) == text
    assert a.unk_token_id is None  # byte-level: nothing maps to an unknown token


def test_chat_template_opens_the_reasoning_section(tmp_path):
    tok = build_tokenizer(tmp_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<bos><|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids("<think>") in ids and "</think>" in tok.get_vocab()
    # Decoding keeps the reasoning delimiters (verifiers split on `</think>`) but drops turn markers.
    reply = tok("1 + 1 = 2\n</think>\n2<|im_end|>", add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids("</think>") in reply
    assert tok.decode(reply, skip_special_tokens=True) == "1 + 1 = 2\n</think>\n2"
    assert "<think>" in CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_tiny_checkpoint_loads_in_transformers_and_is_seeded(tiny, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert is_checkpoint_dir(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = model.config
    assert cfg.model_type == "zaya" and cfg.vocab_size == len(tok)
    tiny_config = get_family("zaya").tiny_config
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_hidden_layers) == (
        tiny_config["hidden_size"], tiny_config["num_experts"], tiny_config["num_hidden_layers"])
    assert cfg.eos_token_id == [tok.convert_tokens_to_ids("<eos>"), tok.convert_tokens_to_ids("<|im_end|>")]
    logits = model(torch.tensor([[1, 5, 9, 300]])).logits
    assert logits.shape == (1, 4, len(tok)) and torch.isfinite(logits).all()
    again = build_tiny_model(tmp_path / "again")
    assert digest(again / "model.safetensors") == digest(tiny / "model.safetensors")
