"""The environment plugin API: subclass `Environment`, set a name, write `sample` and `verify`.

Contract (docs/design.md "Contracts"):
- `sample(n, seed, split, difficulty)` is deterministic in its arguments, so a run can resume and an
  evaluation set is fixed by its seed. `split="eval"` draws from problems kept out of `split="train"`.
  A `sample` that raises or returns anything but `n` prompts stops the stage (`EnvironmentFault`).
- `verify(prompt, response)` returns a reward in [0, 1] (binary for `reward_type = "binary"`) or a
  `Verification` with metadata. A string `metadata["reason"]` (why the response earned what it did:
  "passed", "no code block", ...) is counted: metric `verify/<env key>/<reason>`, the fraction of the
  environment's rollouts in the window. An exception is not fatal to a run: `safe_verify` turns it into
  reward 0 with the error recorded, and the pipeline counts it; so is a result that is not a number.
  The pipeline calls `verify` in a worker thread (zrl/pipeline/verifier.py) and scores a call that runs
  past the stage's `verifier_timeout_s` 0, so a verifier must not rely on signals (they work in the
  main thread only) and needs no timeout of its own.
- `verify_group(prompt, responses)` optionally scores a whole group in one call (one reward or
  `Verification` per response, in order): environments whose scorer batches (a reward model) override
  it; the default calls `verify` per response. The pipeline then times the group's call as a whole
  (`verifier_timeout_s` per response) and `safe_verify_group` applies `safe_verify`'s rules to each result;
  a group call that raises costs the group's rewards.
- `demonstration(prompt)` optionally returns a reference response (reasoning, `</think>`, answer), or
  for a multi-turn environment the transcript as chat messages;
  environments that have one can feed `sft` stages.
Constructor keyword arguments are the recipe's per-environment `options`.
"""

import dataclasses
import hashlib
import re
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from zrl.types import Prompt, RewardType, Split, Verification

THINK_END = "</think>"
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def extract_answer(response: str) -> str:
    """The answer section of a response: the text after the last `</think>` (the whole response when
    there is none), narrowed to the last `\\boxed{...}` when one is present; stripped."""
    answer = response.rsplit(THINK_END, 1)[-1]
    boxed = _BOXED.findall(answer)
    return (boxed[-1] if boxed else answer).strip()


def in_split(key: str, split: Split, eval_fraction: float = 0.2) -> bool:
    """Deterministic train/eval partition of problems by a stable key (the problem's text)."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") / 2**64
    return (bucket < eval_fraction) == (split == "eval")


class Environment(ABC):
    name: ClassVar[str]
    description: ClassVar[str] = ""
    reward_type: ClassVar[RewardType] = "binary"
    # (lowest, highest) integer level `sample(difficulty=...)` takes; None: it takes no difficulty (a
    # recipe that sets one for it is an error). Adaptive difficulty schedules within these levels.
    difficulty_levels: ClassVar[tuple[int, int] | None] = None

    @abstractmethod
    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        """`n` prompts, deterministic in (n, seed, split, difficulty). An environment with
        `curriculum_tasks()` also takes a mapping task -> level: draw only from those tasks, each at its level.
        A rollout worker calls it on its background draw thread (one call at a time), while `metrics()`
        may be read from the worker's main thread."""

    @abstractmethod
    def verify(self, prompt: Prompt, response: str) -> float | Verification:
        """The reward of `response` (the generated text after the prompt) for `prompt`."""

    def verify_group(self, prompt: Prompt, responses: Sequence[str]) -> Sequence[float | Verification]:
        """The rewards of a group's `responses`, in order (override to batch; see the module docstring)."""
        return [self.verify(prompt, response) for response in responses]

    def demonstration(self, prompt: Prompt) -> str | list[dict[str, str]] | None:
        """A reference response for supervised warm starts, or None when the environment has none. A
        multi-turn environment may return the transcript as chat messages: the assistant messages are
        the policy's turns (trained), the others the environment's replies (context)."""
        return None

    def curriculum_tasks(self) -> tuple[str, ...] | None:
        """The tasks that each get their own difficulty scheduler under `difficulty: adaptive` (e.g. the
        generators of a many-task environment), or None: one scheduler for the whole environment."""
        return None

    def metrics(self) -> dict[str, float]:
        """The environment's own counters since construction (e.g. problems whose generation failed), by
        name. A stage logs those of its rollout workers' instances, which draw the prompts, as
        `env/<key>/<name>` summed over the workers."""
        return {}


class EnvironmentFault(RuntimeError):
    """An environment broke its contract in a way that stops the stage (its `sample` raised or returned
    something other than the prompts asked for). The message is one line naming the environment's key
    in the stage and what went wrong; the stage loop reports it as the reason the stage stopped."""


def safe_verify(env: Environment, prompt: Prompt, response: str) -> Verification:
    """Run a verifier so that its failure costs one reward, not the run.

    Whatever `verify` does -- raise, return a non-number, a reward outside [0, 1], or a non-binary reward
    from a binary environment -- the result is reward 0 with `error` saying what came back. A reward is
    a number: a value `float()` converts through its own `__float__` (int, float, NumPy scalars, a
    one-element tensor), so True and False are accepted as 1.0 and 0.0 (a binary verifier may return
    `response == answer`); a string is rejected even where `float()` would parse it. NaN and infinities
    are outside [0, 1]. The returned reward is a plain float.
    """
    try:
        result = env.verify(prompt, response)
    except Exception as exc:  # a user's verifier may raise anything; the pipeline counts `error`
        return Verification(reward=0.0, error=f"{type(exc).__name__}: {exc}")
    return _checked(env, result)


def verifies_groups(env: Environment) -> bool:
    """Whether the environment scores groups itself (overrides `verify_group`)."""
    return type(env).verify_group is not Environment.verify_group


def safe_verify_group(env: Environment, prompt: Prompt, responses: Sequence[str]) -> tuple[Verification, ...]:
    """`verify_group` under `safe_verify`'s rules: each result is checked as `safe_verify` checks one; a call
    that raises, or returns a number of results other than one per response, costs every response its
    reward (reward 0, `error` saying why)."""
    try:
        results = list(env.verify_group(prompt, responses))
    except Exception as exc:  # a scorer's failure (a dead reward-model actor, ...) costs this group
        return tuple(Verification(reward=0.0, error=f"{type(exc).__name__}: {exc}") for _ in responses)
    if len(results) != len(responses):
        error = f"verify_group returned {len(results)} results for {len(responses)} responses"
        return tuple(Verification(reward=0.0, error=error) for _ in responses)
    return tuple(_checked(env, result) for result in results)


def _checked(env: Environment, result) -> Verification:
    """A verifier's result as a Verification whose reward obeys the contract (`safe_verify`)."""
    verification = result if isinstance(result, Verification) else Verification(reward=result)
    reward = _as_reward(verification.reward)
    if reward is None:
        returned = "a Verification with reward " if isinstance(result, Verification) else ""
        value = verification.reward
        return Verification(reward=0.0, error=f"verify returned {returned}{reprlib.repr(value)} "
                                              f"({type(value).__name__}), not a number")
    if not 0.0 <= reward <= 1.0:
        return Verification(reward=0.0, error=f"reward {reward!r} outside [0, 1]")
    if env.reward_type == "binary" and reward not in (0.0, 1.0):
        return Verification(reward=0.0, error=f"binary environment returned reward {reward!r}")
    return dataclasses.replace(verification, reward=reward)


def _as_reward(value) -> float | None:
    """`value` as a float, or None when it is not a number (see `safe_verify`)."""
    if not hasattr(type(value), "__float__"):  # str, None, list, dict: float() would parse a str, not convert it
        return None
    try:
        return float(value)
    except (TypeError, ValueError):  # e.g. an array of several elements
        return None
