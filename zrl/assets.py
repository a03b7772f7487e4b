"""Tiny, reproducible model assets for CPU tests and the demo: a tokenizer, and the writer of each model
family's tiny checkpoint.

Nothing is downloaded. The tokenizer is a byte-level BPE trained with the `tokenizers` library on a
small synthetic corpus generated from a fixed seed (digits, arithmetic, a few words), so any text
tokenizes and the same call always writes the same `tokenizer.json`. Its chat template opens the
assistant turn with `<think>`; the model reasons, closes `</think>`, then answers.

A family declares its tiny checkpoint (zrl.models.ModelFamily `tiny_config`, `new_tiny_model`:
transformers' own model class, so the checkpoint is in the Hugging Face layout the family's engine
loads); `write_tiny_checkpoint` writes it beside the tokenizer with a seeded initialisation, and
`get_family(model_type).build_tiny(dir, seed)` is the entry point (`zrl init-tiny-model --arch`,
`model.tiny_arch`). Nothing here names an architecture but `build_tiny_model`, MoE++'s shortcut.
"""

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def write_tiny_checkpoint(out_dir: str | Path, new_model: Callable[[dict[str, Any]], Any], fields: dict[str, Any],
                          *, seed: int, overrides: dict[str, Any]) -> Path:
    """Write the tiny tokenizer and a seeded tiny checkpoint into `out_dir`; returns the path.

    `new_model(hf_config)` is a family's `new_tiny_model`: transformers' own model for the HF config
    fields `fields` plus the tokenizer's vocabulary size and special token ids, built right after torch's
    generator is seeded with `seed` (the same seed and fields always write the same files). zrl_tiny.json
    records the seed and the `overrides` of the family's tiny_config.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, seed=seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<eos>", "<|im_end|>")]
    hf_config = dict(**fields, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids)
    torch.manual_seed(seed)
    new_model(hf_config).save_pretrained(str(out), safe_serialization=True)
    (out / "zrl_tiny.json").write_text(json.dumps({"seed": seed, "overrides": overrides}, sort_keys=True) + "\n")
    return out


def build_tiny_model(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """The tiny MoE++ (`zaya`) checkpoint, the default `model.tiny_arch`: its family's `build_tiny`."""
    from zrl.models import get_family

    return get_family("zaya").build_tiny(out_dir, seed, **overrides)


def is_checkpoint_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))
