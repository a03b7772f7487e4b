"""Synthetic, reproducible TrainBatches and SFT examples for trainer tests, benchmarks and smoke runs.

Random token ids with variable prompt and response lengths, two policy versions inside some
rollouts, non-zero advantages, and a routing record that is non-trivial for router replay:
- with a `model`, behaviour logprobs and routing come from that model's own forward (what a rollout
  engine running the same weights records), then a fraction `flip_fraction` of the recorded (token,
  layer) entries is moved to other classes (every id of the entry shifted by the same amount modulo
  the C count classes, a skip class included where the family has one, so k ids stay distinct) and
  the logprobs get Gaussian noise, so the trust region, the mismatch statistics and the replay
  disagreement all see something;
- without one, logprobs are log U(0.02, 1) and each (token, layer) entry is k distinct classes drawn
  uniformly from the C.
Records are [T, L * k] (the model's `ModelShape`). The last row of every routing record is 255 (the
last sampled token never went through the model); entries the model leaves unrecorded (dense layers)
stay 255.
"""

from __future__ import annotations

import numpy as np
import torch

from zrl.models import ModelShape
from zrl.trainer.batch import SFTExample
from zrl.types import NO_ROUTE, Prompt, Rollout, RolloutGroup, TrainBatch, Verification


def synthetic_train_batch(*, vocab_size: int, shape: ModelShape, num_groups: int, group_size: int,
                          prompt_tokens: tuple[int, int] = (3, 12), response_tokens: tuple[int, int] = (1, 24),
                          trainer_step: int = 0, seed: int = 0, model: torch.nn.Module | None = None,
                          flip_fraction: float = 0.25, logprob_noise: float = 0.05,
                          empty_responses: int = 0) -> TrainBatch:
    """A TrainBatch of `num_groups` x `group_size` rollouts; `empty_responses` of them have R = 0."""
    rng = np.random.default_rng(seed)
    groups = []
    empty_left = empty_responses
    for g in range(num_groups):
        prompt = rng.integers(3, vocab_size, size=int(rng.integers(*prompt_tokens, endpoint=True)), dtype=np.int32)
        rollouts = []
        for _ in range(group_size):
            length = 0 if empty_left > 0 else int(rng.integers(*response_tokens, endpoint=True))
            empty_left -= length == 0
            tokens = rng.integers(3, vocab_size, size=length, dtype=np.int32)
            logprobs, routing = _record(prompt, tokens, shape, rng, model, flip_fraction, logprob_noise)
            if trainer_step > 0 and length > 1 and rng.random() < 0.5:
                segments = ((0, trainer_step - 1), (length // 2, trainer_step))  # weight sync mid-rollout
            else:
                segments = ((0, trainer_step),)
            rollouts.append(Rollout(prompt_ids=prompt, token_ids=tokens, logprobs=logprobs, routing=routing,
                                    version_segments=segments, finish_reason="stop"))
        advantages = rng.normal(size=group_size)
        rewards = (advantages > 0).astype(np.float64)
        groups.append(RolloutGroup(
            group_id=f"synthetic-{seed}-{g}",
            prompt=Prompt(env="synthetic", prompt_id=f"p{g}", messages=(), answer="", data_source="synthetic"),
            rollouts=tuple(rollouts), verifications=tuple(Verification(reward=float(r)) for r in rewards),
            rewards=rewards, length_bonuses=np.zeros(group_size), advantages=advantages,
            canary_flags=np.zeros(group_size, dtype=bool)))
    return TrainBatch(groups=tuple(groups), trainer_step=trainer_step)


def _record(prompt: np.ndarray, tokens: np.ndarray, shape: ModelShape, rng: np.random.Generator,
            model: torch.nn.Module | None, flip_fraction: float, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """(behaviour logprobs [Tr] float32, routing [Tp + Tr, L * k] uint8) of one rollout."""
    total = len(prompt) + len(tokens)
    layers, k, classes = shape.num_layers, shape.experts_per_token, shape.count_classes
    if model is None:
        logprobs = np.log(rng.uniform(0.02, 1.0, size=len(tokens))).astype(np.float32)
        if k == 1:
            routing = rng.integers(0, classes, size=(total, layers)).astype(np.uint8)
        else:  # k distinct classes per (token, layer)
            routing = rng.random(size=(total, layers, classes)).argsort(axis=-1)[..., :k]
            routing = routing.reshape(total, shape.routing_width).astype(np.uint8)
    else:
        full = torch.from_numpy(np.concatenate([prompt, tokens]).astype(np.int64))
        with torch.no_grad():
            out = model.token_logprobs(full[:-1], full[1:]) if total > 1 else None
        routing = np.full((total, shape.routing_width), NO_ROUTE, dtype=np.uint8)
        logprobs = np.zeros(len(tokens), dtype=np.float32)
        if out is not None:
            routing[:-1] = out.routing.native_ids.numpy()
            lp = out.logprobs.numpy()[len(prompt) - 1:]
            logprobs = np.minimum(lp + noise * rng.normal(size=lp.shape), 0.0).astype(np.float32)
        entries = routing[:-1].reshape(total - 1, layers, k)  # [T - 1, L, k] view
        flips = (rng.random(size=entries.shape[:2]) < flip_fraction) & (entries != NO_ROUTE).all(axis=-1)
        shift = rng.integers(1, classes, size=flips.shape)
        shifted = (entries.astype(np.int64) + shift[..., None]) % classes
        entries[:] = np.where(flips[..., None], shifted, entries)
    routing[-1] = NO_ROUTE
    return logprobs, routing


def synthetic_sft_examples(*, vocab_size: int, num_examples: int, prompt_tokens: tuple[int, int] = (3, 12),
                           response_tokens: tuple[int, int] = (1, 24), seed: int = 0) -> list[SFTExample]:
    rng = np.random.default_rng(seed)
    return [SFTExample(
        prompt_ids=rng.integers(3, vocab_size, size=int(rng.integers(*prompt_tokens, endpoint=True)), dtype=np.int32),
        token_ids=rng.integers(3, vocab_size, size=int(rng.integers(*response_tokens, endpoint=True)), dtype=np.int32))
        for _ in range(num_examples)]
