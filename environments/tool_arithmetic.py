"""Multiplication with a Python tool (`tool_arithmetic`): a multi-turn episode in which the policy may run
code in the sandbox (zrl/env/tools.py) before it answers.

A problem is `a * b` with both operands of exactly `digits` digits; the reward is 1 when the answer of the
policy's final message (the text after its `</think>`) is exactly the product. An episode: a message
with tool calls gets the tools' replies (the episode goes on); the first message without one is the final
answer and ends it. Problems are split into train and eval by their expression (zrl.env.base.in_split).

Options:
    digits  digits of each operand (default 3: 100 .. 999)
    limits  zrl.sandbox.Limits fields for the tool's sandboxes, e.g. {wall_s: 5}
The demonstration is the two-turn transcript: call `print(a*b)`, read the product, answer it.
"""

import random
from collections.abc import Mapping

from environments.code_problems import LazySandbox
from zrl.env.base import THINK_END, extract_answer, in_split
from zrl.env.episode import Episode, EpisodicEnvironment, Turn
from zrl.env.tools import TOOL_ROLE, PythonTool, Toolbox, tool_call_text
from zrl.types import Message, Prompt, Split

# Kept short: the tiny model's tokenizer (zrl/assets.py) spends 61 tokens on the call format alone.
INSTRUCTION = ('You may call <tool_call>{"name":"python","arguments":{"code":"..."}}</tool_call>. '
               f"Final answer after {THINK_END}.")


class ToolArithmetic(EpisodicEnvironment):
    name = "tool_arithmetic"
    description = "multiply two multi-digit numbers, with a sandboxed Python tool (multi-turn)"
    reward_type = "binary"

    def __init__(self, digits: int = 3, limits: Mapping | None = None):
        if digits < 1:
            raise ValueError(f"digits must be >= 1; got {digits}")
        self.digits = digits
        self.toolbox = Toolbox([PythonTool(LazySandbox(limits).get())])

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        rng = random.Random(f"{self.name}:{seed}:{split}")
        low, high = 10 ** (self.digits - 1), 10 ** self.digits - 1
        prompts = []
        for _ in range(1000 * (n + 10)):
            if len(prompts) == n:
                break
            a, b = rng.randint(low, high), rng.randint(low, high)
            expression = f"{a} * {b}"
            if not in_split(expression, split):
                continue
            prompts.append(Prompt(
                env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{len(prompts)}",
                messages=(Message("user", f"What is {expression}? {INSTRUCTION}"),), answer=str(a * b),
                data_source=self.name, difficulty=difficulty, payload={"a": a, "b": b}))
        if len(prompts) < n:
            raise ValueError(f"digits={self.digits} leaves too few {split} problems; raise digits")
        return prompts

    def episode(self, prompt: Prompt) -> Episode:
        return _Episode(self.toolbox, prompt.answer)

    def verify(self, prompt: Prompt, response: str) -> float:
        return float(extract_answer(response) == prompt.answer)

    def demonstration(self, prompt: Prompt) -> list[dict[str, str]]:
        a, b = prompt.payload["a"], prompt.payload["b"]
        return [{"role": "assistant", "content": THINK_END + tool_call_text("python", {"code": f"print({a}*{b})"})},
                {"role": TOOL_ROLE, "content": f"{a * b}\n"},  # what the tool replies: print's output
                {"role": "assistant", "content": THINK_END + prompt.answer}]


class _Episode(Episode):
    def __init__(self, toolbox: Toolbox, answer: str):
        self.toolbox = toolbox
        self.answer = answer

    def step(self, text: str) -> Turn:
        replies = self.toolbox.reply(text)
        if replies.calls:
            return Turn(messages=replies.messages, tool_calls=replies.calls, tool_errors=replies.errors)
        return Turn(done=True, reward=float(extract_answer(text) == self.answer))
