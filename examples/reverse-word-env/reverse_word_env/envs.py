"""The README's example environment ("Add your environment in 20 lines"), verbatim: a test checks that
the README's code block is this file's code."""

import random

from zrl.env import Environment, extract_answer, in_split
from zrl.types import Message, Prompt


class ReverseWord(Environment):
    name = "reverse_word"
    description = "reverse a random lowercase word"
    reward_type = "binary"  # MaxRL needs binary rewards; the recipe check reads this

    def sample(self, n, seed, split="train", difficulty=None):
        rng, words = random.Random(f"{seed}:{split}"), []
        while len(words) < n:  # a word is in one split only: held-out words never reach training
            word = "".join(rng.choices("abcdefgh", k=rng.randint(3, 6)))
            if in_split(word, split):
                words.append(word)
        return [Prompt(env=self.name, prompt_id=f"{split}:{seed}:{i}", answer=w[::-1], data_source=self.name,
                       messages=(Message("user", f"Reverse the word {w}."),)) for i, w in enumerate(words)]

    def verify(self, prompt, response):
        return float(extract_answer(response) == prompt.answer)  # the text after </think>

    def demonstration(self, prompt):  # a reference response (reasoning, </think>, answer): feeds sft stages
        return f"{' '.join(prompt.answer)}\n</think>\n{prompt.answer}"
