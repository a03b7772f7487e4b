"""Synthetic string tasks with tunable difficulty: copy or reverse a random lowercase word.

A problem is a word of `min_letters`..`max_letters` letters drawn from the first `alphabet_size`
letters; difficulty d adds round(2 * d) letters to both bounds. `copy` asks for the word itself
(an attention look-up a tiny model generalises to unseen words), `reverse` for its letters reversed.
The reward is 1 when the answer section (after `</think>`) is exactly the expected string.
Demonstrations spell the word in the reasoning section, then answer.
"""

import random
import string

from zrl.env.base import THINK_END, Environment, extract_answer, in_split
from zrl.types import Message, Prompt, Split

_TASKS = {"copy": ("Repeat the word {w}.", lambda w: w), "reverse": ("Reverse the word {w}.", lambda w: w[::-1])}


class StringTask(Environment):
    name = "strings"
    description = "copy or reverse a random word (tunable length; generalises to unseen words)"
    reward_type = "binary"
    difficulty_levels = (0, 20)  # +2 letters per level

    def __init__(self, tasks: str | list[str] = "copy", min_letters: int = 3, max_letters: int = 5,
                 alphabet_size: int = 8):
        self.tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        unknown = sorted(set(self.tasks) - set(_TASKS))
        if not self.tasks or unknown:
            raise ValueError(f"tasks must be among {sorted(_TASKS)}; got {tasks!r}")
        if not 1 <= min_letters <= max_letters or not 2 <= alphabet_size <= 26:
            raise ValueError("need 1 <= min_letters <= max_letters and 2 <= alphabet_size <= 26")
        self.min_letters, self.max_letters = min_letters, max_letters
        self.alphabet = string.ascii_lowercase[:alphabet_size]

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        rng = random.Random(f"{self.name}:{seed}:{split}")
        extra = round(2 * (difficulty or 0.0))
        prompts = []
        for _ in range(1000 * (n + 10)):
            if len(prompts) == n:
                break
            word = "".join(rng.choices(self.alphabet, k=rng.randint(self.min_letters + extra, self.max_letters + extra)))
            task = rng.choice(self.tasks)
            if not in_split(f"{task}:{word}", split):
                continue
            template, solve = _TASKS[task]
            prompts.append(Prompt(
                env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{len(prompts)}",
                messages=(Message("user", template.format(w=word)),), answer=solve(word),
                data_source=f"{self.name}:{task}", difficulty=difficulty, payload={"word": word, "task": task}))
        if len(prompts) < n:
            raise ValueError(f"too few {split} words of {self.min_letters}-{self.max_letters} letters")
        return prompts

    def verify(self, prompt: Prompt, response: str) -> float:
        return float(extract_answer(response) == prompt.answer)

    def demonstration(self, prompt: Prompt) -> str:
        spelled = " ".join(prompt.payload["word"])
        return f"{spelled}\n{THINK_END}\n{prompt.answer}"
