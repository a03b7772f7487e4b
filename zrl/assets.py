"""Tiny, reproducible model assets for CPU tests and the demo: a tokenizer, a `zaya`, a `qwen3_moe` and a
`glm4_moe` checkpoint.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the `tokenizers` library on a
small synthetic corpus generated from a fixed seed (digits, arithmetic, a few words), so any text
tokenizes and the same call always writes the same `tokenizer.json`. Its chat template opens the
assistant turn with `<think>`; the model reasons, closes `</think>`, then answers.

The checkpoint is written by transformers' own `ZayaConfig`/`ZayaForCausalLM` with a seeded
initialisation (key temperatures set to 1 instead of transformers' 0, so attention is not uniform at
the start): the Hugging Face `zaya` layout is the interchange format (zrl/moepp/README.md).
"""

import json
import random
from pathlib import Path

TINY_MODEL_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention backend supports head sizes from 32 up
    moe_intermediate_size=128,
    num_experts=4,
    num_experts_per_tok=1,
    router_hidden_size=32,
    max_position_embeddings=1024,
    cca_time0=2,
    cca_time1=2,
    tie_word_embeddings=True,
)
TINY_VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]
# Reasoning delimiters are added tokens but not "special": decoding keeps them (vLLM and transformers
# skip special tokens when detokenizing), so a verifier sees where the reasoning ends.
REASONING_TOKENS = ["<think>", "</think>"]
# The assistant turn starts inside the reasoning section; `</think>` separates reasoning from the answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
_WORDS = ("what is the sum of and plus minus times equals answer think step first then so result number "
          "reverse string letters count how many compute solve question final is it yes no").split()


def _synthetic_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    corpus = []
    for _ in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 8)))
        letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        corpus.append(f"{words} {a} {op} {b} = {eval(f'{a}{op}{b}')} {letters} {letters[::-1]}")
    return corpus


def build_tokenizer(out_dir: str | Path, vocab_size: int = TINY_VOCAB_SIZE, seed: int = 0):
    """Train the tiny byte-level BPE tokenizer and save it as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the tiny tokenizer and a seeded tiny `zaya` checkpoint into `out_dir`; returns the path.

    `overrides` change fields of TINY_MODEL_CONFIG (e.g. num_hidden_layers=4).
    """
    import torch
    from transformers import ZayaConfig, ZayaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed=seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<|im_end|>")]
    config = ZayaConfig(
        **{**TINY_MODEL_CONFIG, **overrides}, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids)
    torch.manual_seed(seed)
    model = ZayaForCausalLM(config)
    with torch.no_grad():
        # transformers initialises the per-KV-head key temperature to 0, i.e. uniform attention until
        # it is learned; the tiny demo model must learn in minutes, so it starts at 1.
        for name, param in model.named_parameters():
            if name.endswith("qk_norm.temp"):
                param.fill_(1.0)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "zrl_tiny.json").write_text(json.dumps({"seed": seed, "overrides": overrides}, sort_keys=True) + "\n")
    return out


TINY_QWEN3_MOE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,  # the dense layers' MLP width
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention backend supports head sizes from 32 up
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[1],  # one dense layer between two sparse ones
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build_tiny_qwen3_moe(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the tiny tokenizer and a seeded tiny `qwen3_moe` checkpoint into `out_dir`; returns the path.

    Written by transformers' own `Qwen3MoeConfig`/`Qwen3MoeForCausalLM` (random initialisation, seeded;
    transformers 5.19 saves the experts one by one, the Hub's layout). `overrides` change fields of
    TINY_QWEN3_MOE_CONFIG.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed=seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<|im_end|>")]
    config = Qwen3MoeConfig(
        **{**TINY_QWEN3_MOE_CONFIG, **overrides}, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids)
    torch.manual_seed(seed)
    Qwen3MoeForCausalLM(config).save_pretrained(str(out), safe_serialization=True)
    (out / "zrl_tiny.json").write_text(json.dumps({"seed": seed, "overrides": overrides}, sort_keys=True) + "\n")
    return out


TINY_GLM4_MOE_CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,  # the dense first layer's MLP width
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention backend supports head sizes from 32 up
    partial_rotary_factor=0.5,  # GLM-4.5's: RoPE on the first half of each head
    attention_bias=True,
    use_qk_norm=False,  # as GLM-4.5-Air
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,  # group-limited routing: the best 2 of 4 groups of 2 experts
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    first_k_dense_replace=1,  # one dense layer before two sparse ones
    num_nextn_predict_layers=0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def build_tiny_glm4_moe(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Write the tiny tokenizer and a seeded tiny `glm4_moe` checkpoint into `out_dir`; returns the path.

    Written by transformers' own `Glm4MoeConfig`/`Glm4MoeForCausalLM` (random initialisation, seeded,
    correction biases 0 as at the start of pre-training; experts saved one by one, the Hub's layout).
    `overrides` change fields of TINY_GLM4_MOE_CONFIG.
    """
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed=seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<|im_end|>")]
    config = Glm4MoeConfig(
        **{**TINY_GLM4_MOE_CONFIG, **overrides}, vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids)
    torch.manual_seed(seed)
    Glm4MoeForCausalLM(config).save_pretrained(str(out), safe_serialization=True)
    (out / "zrl_tiny.json").write_text(json.dumps({"seed": seed, "overrides": overrides}, sort_keys=True) + "\n")
    return out


# The tiny models zrl builds, by config.json model_type (`zrl init-tiny-model --arch`, `model.tiny_arch`):
# the builder, and the config whose max_position_embeddings preflight reads before the model exists.
TINY_BUILDERS = {"zaya": build_tiny_model, "qwen3_moe": build_tiny_qwen3_moe, "glm4_moe": build_tiny_glm4_moe}
TINY_CONFIGS = {"zaya": TINY_MODEL_CONFIG, "qwen3_moe": TINY_QWEN3_MOE_CONFIG, "glm4_moe": TINY_GLM4_MOE_CONFIG}


def is_checkpoint_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
