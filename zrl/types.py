"""Typed records that cross stage boundaries (DESIGN.md "Types"): frozen, no dict bags.

`Prompt` flows from an environment's prompt source to the rollout workers; `Verification` from an
environment's verifier to the buffer. Rollout-side records (tokens, logprobs, routing, versions) join
them as the pipeline lands.
"""

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

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
