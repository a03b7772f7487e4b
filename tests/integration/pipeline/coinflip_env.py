"""A test environment whose reward is a deterministic coin flip of the response text.

An untrained tiny model gets mixed rewards from it (about half its samples score 1), so every group
carries policy-gradient signal and the pipeline's buffer always has work to release.
"""

import hashlib

from zrl.env import Environment
from zrl.types import Message, Prompt


class CoinFlip(Environment):
    name = "coinflip"
    description = "reward = parity of a hash of the response (test only)"
    reward_type = "binary"

    def sample(self, n, seed, split="train", difficulty=None):
        return [Prompt(env=self.name, prompt_id=f"coin:{split}:{seed}:{i}", answer="", data_source=self.name,
                       messages=(Message("user", f"Say anything, number {seed % 997 + i}."),)) for i in range(n)]

    def verify(self, prompt, response):
        return float(hashlib.sha256(response.encode()).digest()[0] % 2)
