"""The README's multi-turn example environment ("A multi-turn environment"), verbatim: a test checks that
the README's code block is this file's code."""

import random

from zrl.env import Episode, EpisodicEnvironment, Turn, extract_answer, in_split
from zrl.types import Message, Prompt


class Lookup(EpisodicEnvironment):
    name = "lookup"
    description = "ask the environment for a key's hidden value, then answer it (multi-turn)"
    reward_type = "binary"
    max_turns = 3  # policy messages per episode

    def sample(self, n, seed, split="train", difficulty=None):
        rng, prompts = random.Random(f"{seed}:{split}"), []
        while len(prompts) < n:  # a key is in one split only: held-out keys never reach training
            key, value = "".join(rng.choices("abcdefgh", k=3)), str(rng.randint(10, 99))
            if in_split(key, split):
                prompts.append(Prompt(env=self.name, prompt_id=f"{split}:{seed}:{len(prompts)}", answer=value,
                                      data_source=self.name, payload={"key": key},
                                      messages=(Message("user", f"What is the value of {key}? Ask: get {key}"),)))
        return prompts

    def episode(self, prompt):  # one conversation per sample
        return LookupEpisode(prompt.payload["key"], prompt.answer)

    def verify(self, prompt, response):  # a plain response, scored outside an episode
        return float(extract_answer(response) == prompt.answer)

    def demonstration(self, prompt):  # the transcript an sft stage trains on: ask, read the reply, answer
        return [{"role": "assistant", "content": f"</think>get {prompt.payload['key']}"},
                {"role": "user", "content": prompt.answer},
                {"role": "assistant", "content": f"</think>{prompt.answer}"}]


class LookupEpisode(Episode):
    def __init__(self, key, value):
        self.key, self.value = key, value

    def step(self, text):  # the policy's message -> the environment's reply, or the end and its reward
        answer = extract_answer(text)  # the text after </think>
        if answer.startswith("get "):  # a lookup: the value when the key is right
            reply = self.value if answer[len("get "):] == self.key else "unknown key"
            return Turn(messages=({"role": "user", "content": reply},))
        return Turn(done=True, reward=float(answer == self.value))
