"""The environment plugin API: subclass `Environment`, set a name, write `sample` and `verify`.

Contract (docs/design.md "Contracts"):
- `sample(n, seed, split, difficulty)` is deterministic in its arguments, so a run can resume and an
  evaluation set is fixed by its seed. `split="eval"` draws from problems kept out of `split="train"`.
- `verify(prompt, response)` returns a reward in [0, 1] (binary for `reward_type = "binary"`) or a
  `Verification` with metadata. An exception is not fatal to a run: `safe_verify` turns it into
  reward 0 with the error recorded, and the pipeline counts it.
- `demonstration(prompt)` optionally returns a reference response (reasoning, `</think>`, answer);
  environments that have one can feed `sft` stages.
Constructor keyword arguments are the recipe's per-environment `options`.
"""

import hashlib
import re
from abc import ABC, abstractmethod
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

    @abstractmethod
    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        """`n` prompts, deterministic in (n, seed, split, difficulty)."""

    @abstractmethod
    def verify(self, prompt: Prompt, response: str) -> float | Verification:
        """The reward of `response` (the generated text after the prompt) for `prompt`."""

    def demonstration(self, prompt: Prompt) -> str | None:
        """A reference response for supervised warm starts, or None when the environment has none."""
        return None


def safe_verify(env: Environment, prompt: Prompt, response: str) -> Verification:
    """Run a verifier so that its failure costs one reward, not the run."""
    try:
        result = env.verify(prompt, response)
    except Exception as exc:  # a user's verifier may raise anything; the pipeline counts `error`
        return Verification(reward=0.0, error=f"{type(exc).__name__}: {exc}")
    verification = result if isinstance(result, Verification) else Verification(reward=float(result))
    if not 0.0 <= verification.reward <= 1.0:
        return Verification(reward=0.0, error=f"reward {verification.reward!r} outside [0, 1]")
    if env.reward_type == "binary" and verification.reward not in (0.0, 1.0):
        return Verification(reward=0.0, error=f"binary environment returned reward {verification.reward!r}")
    return verification
