"""Synthetic integer arithmetic with tunable difficulty: the task the tiny CPU demo learns.

A problem is `a op b` with 0 <= a, b <= bound and op in `ops`; bound = max_operand * 2**difficulty,
so difficulty 0 is the configured range and each unit doubles it. The reward is 1 when the answer
section (after `</think>`) is exactly the integer result. Demonstrations show the computation in the
reasoning section, then the answer, so an `sft` stage can teach the format.
"""

import random

from zrl.env.base import THINK_END, Environment, extract_answer, in_split
from zrl.types import Message, Prompt, Split

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class Arithmetic(Environment):
    name = "arithmetic"
    description = "integer a+b / a-b / a*b with tunable operand range (learnable by the tiny CPU model)"
    reward_type = "binary"
    difficulty_levels = (0, 20)  # the operand bound doubles per level

    def __init__(self, max_operand: int = 20, ops: str = "+-"):
        unknown = set(ops) - set(_OPS)
        if not ops or unknown:
            raise ValueError(f"ops must be a non-empty string of {''.join(_OPS)}; got {ops!r}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1; got {max_operand}")
        self.max_operand = max_operand
        self.ops = ops

    def bound(self, difficulty: float | None) -> int:
        return max(1, round(self.max_operand * 2 ** (difficulty or 0.0)))

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        rng = random.Random(f"{self.name}:{seed}:{split}")
        bound = self.bound(difficulty)
        prompts = []
        for _ in range(1000 * (n + 10)):
            if len(prompts) == n:
                break
            a, b, op = rng.randint(0, bound), rng.randint(0, bound), rng.choice(self.ops)
            expression = f"{a} {op} {b}"
            if not in_split(expression, split):
                continue
            prompts.append(Prompt(
                env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{len(prompts)}",
                messages=(Message("user", f"What is {expression}?"),),
                answer=str(_OPS[op](a, b)), data_source=f"{self.name}:{op}", difficulty=difficulty,
                payload={"expression": expression}))
        if len(prompts) < n:
            raise ValueError(f"operand bound {bound} leaves too few {split} problems; raise max_operand")
        return prompts

    def verify(self, prompt: Prompt, response: str) -> float:
        return float(extract_answer(response) == prompt.answer)

    def demonstration(self, prompt: Prompt) -> str:
        return f"{prompt.payload['expression']} = {prompt.answer}\n{THINK_END}\n{prompt.answer}"
