"""Reward-model scoring throughput (zrl/reward_model.py): conversations/s at batch sizes 1, 8 and 32, with
the transformers backend and vLLM's pooling runner, in one process and one run.

Conversations are the tiny RM's held-out preference pairs (about 60 tokens each); `--context-tokens N`
puts a system message of about N tokens in front of each (a long chat prompt). Each configuration scores
the same conversations for `--seconds`. Printed ratios: each batch size against batch size 1 of the same
backend, and vLLM against transformers at the same batch size. The transformers backend is measured
first: a vLLM engine pins the process's intra-op thread count for everything after it.

Usage: .venv/bin/python bench/reward_model_throughput.py [--path DIR] [--seconds 10] [--dtype float32]
       [--context-tokens 0] [--backends transformers,vllm]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time

import torch

from zrl.config.schema import RewardModelSpec
from zrl.reward_model import RewardModel, preference_pair, prepare_reward_model
from zrl.types import Message

BATCH_SIZES = (1, 8, 32)


def workload(n: int, context_tokens: int, tokenizer) -> list:
    rng = random.Random("bench")
    phrase = "Some context words. "
    repeats = context_tokens // len(tokenizer(phrase, add_special_tokens=False)["input_ids"])
    context = (Message("system", phrase * repeats),) if repeats else ()
    out = []
    while len(out) < n:
        messages, chosen, rejected = preference_pair(rng, "eval")
        out += [(context + messages, chosen), (context + messages, rejected)]
    return out[:n]


def rate(model: RewardModel, conversations: list, seconds: float) -> float:
    """Conversations scored per second, whole passes over `conversations` for at least `seconds`."""
    model.scores(conversations[:model.spec.batch_size])  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        model.scores(conversations)
        done += len(conversations)
    return done / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="RM checkpoint (default: build the tiny RM in a temporary directory)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--context-tokens", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--backends", default="transformers,vllm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = args.path or str(prepare_reward_model(RewardModelSpec(path=f"{scratch}/tiny-rm",
                                                                     build_tiny_if_missing=True)))
        probe = RewardModel(RewardModelSpec(path=path, dtype=args.dtype, max_tokens=2048))
        conversations = workload(args.conversations, args.context_tokens, probe.tokenizer)
        tokens = sum(len(probe.tokens(c)) for c in conversations) / len(conversations)
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
              f"{torch.get_num_threads()}, {args.dtype}, {len(conversations)} conversations of {tokens:.0f} "
              f"tokens on average, {time.strftime('%Y-%m-%d')}")
        print(f"{'backend':<13} {'batch':>5} {'conv/s':>9} {'vs batch 1':>11} {'vs transformers':>16}")
        measured: dict[tuple[str, int], float] = {}
        models = []  # kept alive: a dropped in-process vLLM engine tears down state the next one uses
        for backend in args.backends.split(","):
            for batch_size in BATCH_SIZES:
                spec = RewardModelSpec(path=path, backend=backend, dtype=args.dtype, batch_size=batch_size,
                                       max_tokens=2048)
                models.append(RewardModel(spec))
                measured[backend, batch_size] = r = rate(models[-1], conversations, args.seconds)
                base = measured.get(("transformers", batch_size))
                versus = f"{r / base:.2f}x" if base and backend != "transformers" else "-"
                print(f"{backend:<13} {batch_size:>5} {r:>9.1f} {r / measured[backend, 1]:>10.2f}x {versus:>16}",
                      flush=True)


if __name__ == "__main__":
    main()
