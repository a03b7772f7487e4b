"""Environments that misbehave on purpose, for the fault tests (coin-flip rewards otherwise, so a
healthy tiny model gets mixed rewards and the buffer always has work)."""

import hashlib
import time

from coinflip_env import CoinFlip

from environments.behavioural import ChatRewardModel
from zrl.env.base import THINK_END

HANG_S = 3600.0


def _byte(text: str, index: int = 0) -> int:
    return hashlib.sha256(text.encode()).digest()[index]


class GarbageOrHang(CoinFlip):
    """The first response verified of one prompt in 8 hangs (a Python-level hang, like a stuck
    request: ~3% of calls at 4 samples per prompt); of the others, about 20% return a string and 10%
    None instead of a number. Which prompts hang depends on their ids only (fixed by the seeds)."""

    name = "garbage_or_hang"

    def __init__(self):
        self.seen: set[str] = set()

    def verify(self, prompt, response):
        first = prompt.prompt_id not in self.seen
        self.seen.add(prompt.prompt_id)
        if first and _byte(prompt.prompt_id) < 32:
            time.sleep(HANG_S)
        b = _byte(response, 1)
        if b < 51:
            return "yes"
        if b < 51 + 26:
            return None
        return super().verify(prompt, response)


class AlwaysRaises(CoinFlip):
    name = "always_raises"

    def verify(self, prompt, response):
        raise ConnectionError("reward service unreachable")


class StallingSource(CoinFlip):
    """A prompt source that serves 4 draws, then blocks (a dataset stream that stopped answering)."""

    name = "stalling_source"
    draws_served = 4

    def __init__(self):
        self.calls = 0

    def sample(self, n, seed, split="train", difficulty=None):
        self.calls += 1
        if self.calls > self.draws_served:
            time.sleep(HANG_S)
        return super().sample(n, seed, split, difficulty)


class ScoresEveryResponse(ChatRewardModel):
    """chat_reward_model scoring every response of the untrained tiny policy (which rarely closes its
    reasoning within a few tokens): each response is judged as if it were the answer, so every group
    reaches the reward-model actors."""

    name = "scores_every_response"

    def verify_group(self, prompt, responses):
        return super().verify_group(prompt, [f"{THINK_END}{r}" for r in responses])
