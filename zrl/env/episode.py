"""Multi-turn environments: an episode alternates the policy's message and the environment's reply.

An `EpisodicEnvironment` is an `Environment` that opens one `Episode` per sample (`episode(prompt)`). The
policy's message goes to `Episode.step(text)`, which returns a `Turn`: the environment's reply as chat
messages (a tool's output, a user simulator's message, feedback), whether the episode is over, and the
reward when it is (a turn may carry one earlier; the episode's reward is the last one given). The loop
that drives episodes on a rollout engine is zrl/env/episodes.py; it ends an episode itself at the
environment's `max_turns`, at the response token budget or at the context length, with the reason recorded.

The single-turn `Environment` is unchanged: an episodic environment is the one that overrides `episode`.
Its `verify` scores a finished transcript for callers outside an episode (evaluation of a plain
response); the loop takes the episode's own reward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from zrl.env.base import Environment
from zrl.types import Prompt


@dataclass(frozen=True)
class Turn:
    """The environment's answer to one policy message."""

    messages: tuple[Mapping[str, str], ...] = ()  # chat messages appended before the policy's next turn
    done: bool = False
    reward: float | None = None                   # in [0, 1]; required when done
    tool_calls: int = 0                           # tools the policy's message called
    tool_errors: int = 0                          # of those, the calls that failed (their error went back as text)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.done and self.reward is None:
            raise ValueError("a Turn that ends the episode needs a reward")
        if self.reward is not None and not 0.0 <= float(self.reward) <= 1.0:
            raise ValueError(f"Turn.reward must be in [0, 1], got {self.reward!r}")
        object.__setattr__(self, "messages", tuple(self.messages))


class Episode(ABC):
    """One sample's conversation with the environment; used from one thread at a time."""

    @abstractmethod
    def step(self, text: str) -> Turn:
        """The environment's answer to the policy's message `text` (the generated text of that turn)."""

    def close(self) -> None:
        """Release what the episode holds (a sandbox, a connection); called once, however it ended."""


class EpisodicEnvironment(Environment):
    # Policy messages per episode at most. A subclass may take it as an option (skyrl_gym's `max_turns`);
    # otherwise it is fixed, and a recipe option of that name is refused like any unknown option.
    max_turns: ClassVar[int] = 4

    @abstractmethod
    def episode(self, prompt: Prompt) -> Episode:
        """A new episode on `prompt` (whose messages open the conversation)."""


def transcript_problem(demonstration) -> str | None:
    """Why a multi-turn demonstration (`Environment.demonstration` returning messages) cannot be trained on,
    or None: it is a list of {"role", "content"} messages with string values that starts and ends with the
    assistant's (the policy's turns; the other roles are the environment's replies)."""
    if not isinstance(demonstration, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in demonstration):
        return 'a multi-turn demonstration is a list of {"role": str, "content": str} messages'
    roles = [m["role"] for m in demonstration]
    if not roles or roles[0] != "assistant" or roles[-1] != "assistant":
        return f"a multi-turn demonstration starts and ends with an assistant message, got roles {roles}"
    return None


__all__ = ["Episode", "EpisodicEnvironment", "Turn", "transcript_problem"]
