"""Reference computations for the serving tests: zrl.moepp's model on the tokens vLLM produced."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from serving.engine import SampleOutput

# Engine shape used by the tests: a small token budget forces chunked prefill and mixes prefill
# chunks with decodes in one step; few sequences force queueing (continuous batching); few KV blocks
# force preemption and recomputation.
ENGINE_KWARGS = dict(max_model_len=160, max_num_seqs=6, max_num_batched_tokens=32, block_size=32,
                     num_gpu_blocks_override=12)
# Prompt lengths: single-token, shorter and longer than the convolution history, several chunks long.
PROMPT_LENGTHS = (1, 2, 3, 9, 17, 40, 61)


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 500, size=n).tolist() for n in lengths]


@dataclasses.dataclass(frozen=True)
class ReferencePass:
    logits: torch.Tensor  # [Tp + Tr, V] fp32, logits predicting the token after each position
    native: np.ndarray  # [Tp + Tr, L] uint8, the reference routers' choices


@torch.no_grad()
def reference_pass(model, sample: SampleOutput) -> ReferencePass:
    ids = torch.from_numpy(np.concatenate([sample.prompt_ids, sample.token_ids]))
    out = model(ids[None])
    return ReferencePass(logits=out.logits[0].float(), native=out.routing.native_ids.numpy())


def generated_logits(ref: ReferencePass, sample: SampleOutput) -> torch.Tensor:
    """[T, V]: the reference logits from which each generated token was sampled."""
    p, t = len(sample.prompt_ids), len(sample.token_ids)
    return ref.logits[p - 1: p - 1 + t]


def sampled_logprobs(logits: torch.Tensor, tokens: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[torch.arange(len(tokens)), torch.from_numpy(tokens)].numpy()


def k3_kl(behaviour: np.ndarray, target: np.ndarray) -> float:
    """k3 estimate of KL(behaviour || target) from samples of the behaviour policy: E[(r - 1) - log r]."""
    log_ratio = target.astype(np.float64) - behaviour.astype(np.float64)
    return float(np.mean(np.expm1(log_ratio) - log_ratio))
