"""Typed records that cross stage boundaries (DESIGN.md "Types"): frozen, no dict bags.

`Prompt` flows from an environment's prompt source to the rollout workers; `Rollout` from a rollout
worker (tokens, behaviour logprobs, routing record, per-token policy versions) to verification and the
buffer; `Verification` from an environment's verifier to the buffer.
"""

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import numpy as np

RewardType = Literal["binary", "continuous"]
Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Message:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class Prompt:
    """One task instance. `payload` belongs to the environment that made it and is opaque to zrl."""

    env: str                       # registry name of the environment
    prompt_id: str                 # stable across runs for the same (env, seed, index)
    messages: tuple[Message, ...]
    answer: str                    # reference answer, or "" when the verifier needs none
    data_source: str               # key of the running max solve rate (length reward gate)
    difficulty: float | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)

    def chat(self) -> list[dict[str, str]]:
        """The messages in the form tokenizers' chat templates take."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True)
class Verification:
    reward: float
    error: str | None = None       # set when the verifier raised or timed out (reward is then 0)
    metadata: Mapping[str, Any] = field(default_factory=dict)


NO_ROUTE = 255  # routing-record value for "no record": the trainer routes that token natively


@dataclass(frozen=True, eq=False)
class Rollout:
    """One sampled response, as the rollout engine produced it.

    `routing` holds the expert id the engine chose in every MoE layer for every prompt and response
    token ([P + R, L] uint8; the skip expert is id E; NO_ROUTE where there is no record, e.g. the last
    sampled token, which never went through the model). `version_segments` are (response token index,
    policy version) pairs in increasing index order: token t was sampled by the version of the last
    segment starting at or before t. The first segment starts at 0.
    """

    prompt_ids: np.ndarray            # [P] int32
    token_ids: np.ndarray             # [R] int32
    logprobs: np.ndarray              # [R] float32, behaviour logprobs of the sampled tokens
    routing: np.ndarray | None        # [P + R, L] uint8
    version_segments: tuple[tuple[int, int], ...]
    finish_reason: str                # "stop" | "length" | "abort"
    text: str = ""                    # decoded response, what the verifier reads

    def __post_init__(self):
        r = len(self.token_ids)
        if len(self.logprobs) != r:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {r} response tokens")
        if self.routing is not None and self.routing.shape[0] != len(self.prompt_ids) + r:
            raise ValueError(f"routing has {self.routing.shape[0]} rows for {len(self.prompt_ids) + r} tokens")
        starts = [s for s, _ in self.version_segments]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"version_segments must start at token 0 and increase: {self.version_segments}")

    def token_versions(self) -> np.ndarray:
        """[R] int64 policy version of every response token."""
        versions = np.empty(len(self.token_ids), dtype=np.int64)
        bounds = [s for s, _ in self.version_segments[1:]] + [len(self.token_ids)]
        for (start, version), end in zip(self.version_segments, bounds):
            versions[start:end] = version
        return versions

    @property
    def min_version(self) -> int:
        """The oldest policy version that produced a response token (staleness is measured from it)."""
        covered = [v for s, v in self.version_segments if s < len(self.token_ids)]
        return min(covered) if covered else self.version_segments[0][1]
