"""Workload models of a cluster plan: how long responses are, how fast a rollout engine decodes, how
long a trainer step and a weight sync take.

Every model is a frozen dataclass with its units in its field names; `Workload` bundles them with the
loop's round length. Constructors state where numbers come from: `ResponseLengths.from_median_p90`
(a published length distribution), `DecodeModel` (a decode-step time model of continuous batching),
`TrainerModel.from_mfu` (model FLOPs at a stated MFU) or `.from_tokens_per_s` (a measured rate).

Invariants: every time is in seconds and every rate positive; sampled response lengths lie in
[1, max_response_tokens] (a response that would be longer is cut there, as the engine does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

Z90 = 1.2815515655446004  # the standard normal's 90th percentile


@dataclass(frozen=True)
class ResponseLengths:
    """Lognormal response lengths in tokens, cut at `max_response_tokens`."""

    median_tokens: float
    sigma: float                      # of log(length)
    max_response_tokens: int

    def __post_init__(self):
        if not self.median_tokens >= 1:
            raise ValueError(f"median_tokens must be >= 1, got {self.median_tokens}")
        if not self.sigma >= 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")
        if self.max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {self.max_response_tokens}")

    @classmethod
    def from_median_p90(cls, median_tokens: float, p90_tokens: float, max_response_tokens: int) -> ResponseLengths:
        if not p90_tokens >= median_tokens:
            raise ValueError(f"p90_tokens ({p90_tokens}) must be >= median_tokens ({median_tokens})")
        return cls(median_tokens, math.log(p90_tokens / median_tokens) / Z90, max_response_tokens)

    @classmethod
    def from_mean_std(cls, mean_tokens: float, std_tokens: float, max_response_tokens: int) -> ResponseLengths:
        """The lognormal with this mean and standard deviation (moment matching)."""
        if not mean_tokens >= 1:
            raise ValueError(f"mean_tokens must be >= 1, got {mean_tokens}")
        sigma2 = math.log1p((std_tokens / mean_tokens) ** 2)
        return cls(mean_tokens / math.exp(sigma2 / 2), math.sqrt(sigma2), max_response_tokens)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n] int64 lengths."""
        lengths = np.rint(rng.lognormal(math.log(self.median_tokens), self.sigma, n))
        return np.clip(lengths, 1, self.max_response_tokens).astype(np.int64)


@dataclass(frozen=True)
class DecodeModel:
    """The decode-time model of one rollout worker's engine (continuous batching; not the engine itself,
    serving.engine): a decode step advances every running sequence by one token and takes
    step_s + per_sequence_s * N + per_kv_token_s * K seconds (N running sequences, K tokens in their
    KV caches). Decode tokens/s = N / step time: it saturates in N (at 1 /
    per_sequence_s) and falls as contexts grow. The first two terms are the weight reads and the
    per-sequence compute of a memory-bound decode; the last is the attention's KV reads.
    At most `max_running_sequences` decode at once (vLLM's max_num_seqs; zrl's rollout worker sets
    256): beyond it the engine's tokens/s is that of the cap, shared by all (processor sharing; vLLM
    runs the first ones first, which ends sequences in a different order at the same total rate)."""

    step_s: float
    per_sequence_s: float
    per_kv_token_s: float = 0.0
    max_running_sequences: int = 256

    def __post_init__(self):
        if min(self.step_s, self.per_sequence_s, self.per_kv_token_s) < 0 or self.step_s + self.per_sequence_s <= 0:
            raise ValueError(f"rollout engine times must be >= 0 and step_s + per_sequence_s > 0: {self}")
        if self.max_running_sequences < 1:
            raise ValueError(f"max_running_sequences must be >= 1, got {self.max_running_sequences}")

    def seconds_per_token(self, sequences: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
        """Seconds for each of `sequences` running sequences (KV tokens `kv_tokens` in all) to decode
        one more token."""
        running = np.minimum(sequences, self.max_running_sequences)
        share = sequences / np.maximum(running, 1)
        step = self.step_s + self.per_sequence_s * running + self.per_kv_token_s * kv_tokens / share
        return step * share

    def tokens_per_s(self, sequences: int, kv_tokens: float = 0.0) -> float:
        return float(sequences / self.seconds_per_token(np.array([sequences]), np.array([kv_tokens]))[0])


@dataclass(frozen=True)
class TrainerModel:
    """Seconds per trainer step for a batch of sequences of T_i tokens (prompt + response):
    overhead_s + sum(T_i) / tokens_per_s + attention_s_per_token2 * sum(T_i^2)."""

    tokens_per_s: float
    overhead_s: float = 0.0
    attention_s_per_token2: float = 0.0

    def __post_init__(self):
        if not self.tokens_per_s > 0 or self.overhead_s < 0 or self.attention_s_per_token2 < 0:
            raise ValueError(f"trainer model: tokens_per_s must be > 0 and the other terms >= 0: {self}")

    @classmethod
    def from_mfu(cls, *, mfu: float, peak_flops: float, gpus: int, active_params: float, layers: int,
                 attention_dim: int, overhead_s: float = 0.0) -> TrainerModel:
        """Training FLOPs per sequence of T tokens: 6 * active_params * T (dense forward and backward)
        plus 6 * layers * attention_dim * T^2 (causal QK^T and AV, forward and backward), delivered at
        mfu * peak_flops per GPU."""
        if not 0 < mfu <= 1 or gpus < 1:
            raise ValueError(f"mfu must be in (0, 1] and gpus >= 1, got mfu={mfu}, gpus={gpus}")
        flops_per_s = mfu * peak_flops * gpus
        return cls(tokens_per_s=flops_per_s / (6 * active_params), overhead_s=overhead_s,
                   attention_s_per_token2=6 * layers * attention_dim / flops_per_s)

    def step_s(self, sequence_tokens: np.ndarray) -> float:
        t = np.asarray(sequence_tokens, dtype=np.float64)
        return self.overhead_s + float(t.sum()) / self.tokens_per_s + self.attention_s_per_token2 * float((t * t).sum())


@dataclass(frozen=True)
class Workload:
    """What the simulated cluster does per unit of work. `sync_s`: one weight sync (trainer rank 0 to
    every worker, once all are ready); `zero_signal_fraction`: groups whose rewards are all equal (the
    buffer drops them); `round_s`: a rollout worker's round (zrl.pipeline.rollout_worker)."""

    lengths: ResponseLengths
    engine: DecodeModel
    trainer: TrainerModel
    prompt_tokens: int = 512
    sync_s: float = 0.0
    zero_signal_fraction: float = 0.0
    round_s: float = 0.5
    notes: dict = field(default_factory=dict, compare=False)   # where the numbers came from, for reports

    def __post_init__(self):
        if self.prompt_tokens < 0 or self.sync_s < 0 or not self.round_s > 0:
            raise ValueError(f"workload: prompt_tokens and sync_s must be >= 0, round_s > 0: {self}")
        if not 0 <= self.zero_signal_fraction < 1:
            raise ValueError(f"zero_signal_fraction must be in [0, 1), got {self.zero_signal_fraction}")
