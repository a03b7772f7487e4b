"""Behavioural RL environments: responses scored by the recipe's reward model, the instruction-following
ones gated by instruction checks.

- `chat_reward_model`: the reward is the reward model's normalised score (zrl/reward_model.py: a
  sigmoid of the raw score, in (0, 1)).
- `simple_instruction_following` / `hard_instruction_following`: the prompt's verifiable instructions
  (environments/instructions.py, IFEval's strict checks) are checked first; a response that fails any
  of them gets 0, one that follows all of them gets the reward model's normalised score (the gate).
Rewards are continuous, so stages train them with GRPO (std-normalised advantages); recipe validation
rejects MaxRL (binary rewards only) and a GRPO stage with the length reward on.

What is judged is the answer section, the text after the last `</think>`: reasoning is neither checked
nor shown to the reward model. A response without `</think>` (its reasoning never closed, usually cut at
the token limit) gets 0 and costs no scoring. Each group's gated-in answers go to the reward model in one
batch (`verify_group`). Metadata: `reason` ("scored", "instructions not followed", "unfinished
reasoning"), counted by the pipeline as verify/<env>/<reason>; `rm_score` (the raw score, when scored);
`instructions_followed` (instruction-following environments: the fraction of the prompt's instructions
the answer follows).

The reward model: inside a run the environment reaches the recipe's scoring actors by name (they are
started with the cascade); anywhere else (`zrl eval`, tests) the caller hands it a client with
`use_reward_model`.

Prompts come from a JSONL file (`prompts_path`: for `chat_reward_model` one {"prompt": text} or
{"messages": [{"role", "content"}, ...]} per line; for the instruction-following ones IFEval/IFBench's
format) split into train/eval by each line's text, or by default from the synthetic generator over the
tiny task "Repeat the word w." (environments/instructions.py) so the tiny model has data. Synthetic
prompts have demonstrations for SFT warm starts: the reasoning spells the word, the answer is the word
made to follow the prompt's instructions, and a deterministic `closing_fraction` of them closes with the
courtesy sentence the tiny reward model prefers (zrl.reward_model.COURTESY), so a warm-started policy
sometimes says it and RL has something to reinforce.
"""

import hashlib
import random
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import replace

from environments.instructions import (IFPrompt, Instruction, check, follow, jsonl_objects, read_prompts,
                                       synthetic_prompts)
from zrl.env.base import THINK_END, Environment, in_split
from zrl.types import Message, Prompt, Split, Verification

ROLES = ("system", "user", "assistant")


class RewardModelEnvironment(Environment):
    """Base class: `gate` decides which answers the reward model scores; the rest get 0."""

    reward_type = "continuous"
    uses_reward_model = True  # the cascade starts the recipe's reward-model actors for stages that list one

    def __init__(self, prompts_path: str | None = None, closing_fraction: float = 0.0):
        if not 0.0 <= closing_fraction <= 1.0:
            raise ValueError(f"closing_fraction must be in [0, 1], got {closing_fraction!r}")
        self.closing_fraction = closing_fraction
        self.file_prompts = None if prompts_path is None else self.read(prompts_path)  # bad files fail here
        self._client = None

    @abstractmethod
    def read(self, path: str) -> list[Prompt]:
        """The prompts of a `prompts_path` file (format per environment; errors name the line and field)."""

    @abstractmethod
    def synthetic(self, n: int, seed: int, split: Split) -> list[Prompt]:
        """`n` synthetic prompts over the tiny task (used when no `prompts_path` is given)."""

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        if self.file_prompts is None:
            return self.synthetic(n, seed, split)
        return _draw(self.name, self.file_prompts, n, seed, split)

    def use_reward_model(self, client) -> None:
        """Score with `client` (a zrl.reward_model.RewardModelClient) instead of the run's actors."""
        self._client = client

    @property
    def client(self):
        if self._client is None:
            from zrl.reward_model import RewardModelClient

            self._client = RewardModelClient()
        return self._client

    def gate(self, prompt: Prompt, answer: str) -> tuple[bool, dict]:
        """Whether `answer` may be scored, and metadata about the decision. No gate by default."""
        return True, {}

    def verify(self, prompt: Prompt, response: str) -> Verification:
        return self.verify_group(prompt, [response])[0]

    def verify_group(self, prompt: Prompt, responses: Sequence[str]) -> list[Verification]:
        results: list[Verification | None] = [None] * len(responses)
        scored: list[tuple[int, str, dict]] = []
        for i, response in enumerate(responses):
            if THINK_END not in response:
                results[i] = Verification(0.0, metadata={"reason": "unfinished reasoning"})
                continue
            answer = response.rsplit(THINK_END, 1)[1].strip()
            passed, metadata = self.gate(prompt, answer)
            if passed:
                scored.append((i, answer, metadata))
            else:
                results[i] = Verification(0.0, metadata={"reason": "instructions not followed", **metadata})
        if scored:
            outcomes = self.client.score([(prompt.messages, answer) for _, answer, _ in scored])
            for (i, _, metadata), (score, reward) in zip(scored, outcomes, strict=True):
                results[i] = Verification(reward, metadata={"reason": "scored", "rm_score": score, **metadata})
        return results

    def _closes_politely(self, prompt: Prompt) -> bool:
        """Whether the prompt's demonstration ends with the courtesy sentence (deterministic per prompt)."""
        bucket = int.from_bytes(hashlib.sha256(prompt.prompt_id.encode()).digest()[:8], "little") / 2**64
        return bucket < self.closing_fraction

    def demonstration(self, prompt: Prompt) -> str | None:
        """Synthetic prompts only: the word spelled in the reasoning, then the word (with the courtesy
        sentence for `closing_fraction` of prompts) made to follow the prompt's instructions."""
        word = prompt.payload.get("word")
        if word is None:
            return None
        from zrl.reward_model import COURTESY

        base = f"{word}\n{COURTESY}" if self._closes_politely(prompt) else word
        answer = follow(base, instructions_of(prompt), prompt.messages[-1].content)
        return None if answer is None else f"{' '.join(word)}\n{THINK_END}\n{answer}"


class ChatRewardModel(RewardModelEnvironment):
    name = "chat_reward_model"
    description = "chat prompts scored by the recipe's reward model (continuous reward)"

    def read(self, path: str) -> list[Prompt]:
        return _read_chat_prompts(path)

    def synthetic(self, n: int, seed: int, split: Split) -> list[Prompt]:
        from environments.strings import StringTask

        return [_restamped(p, self.name) for p in StringTask(tasks="copy").sample(n, seed, split)]


class InstructionFollowing(RewardModelEnvironment):
    """The prompt's instructions gate the reward model's score (see the module docstring)."""

    level = "simple"

    def gate(self, prompt: Prompt, answer: str) -> tuple[bool, dict]:
        followed = check(answer, if_prompt(prompt))
        return all(followed), {"instructions_followed": sum(followed) / len(followed)}

    def read(self, path: str) -> list[Prompt]:
        return [_to_prompt(self.name, p, p.key) for p in read_prompts(path)]

    def synthetic(self, n: int, seed: int, split: Split) -> list[Prompt]:
        made = synthetic_prompts(n, seed, self.level, split)
        return [_to_prompt(self.name, p, f"{self.name}:{split}:{seed}:{i}") for i, p in enumerate(made)]


class SimpleInstructionFollowing(InstructionFollowing):
    name = "simple_instruction_following"
    description = "one verifiable instruction gates a reward-model score (continuous reward)"
    level = "simple"


class HardInstructionFollowing(InstructionFollowing):
    name = "hard_instruction_following"
    description = "several verifiable instructions gate a reward-model score (continuous reward)"
    level = "hard"


def instructions_of(prompt: Prompt) -> list[Instruction]:
    """The verifiable instructions a prompt of these environments carries (none for chat prompts)."""
    return [Instruction(i["id"], i["kwargs"]) for i in prompt.payload.get("instructions", ())]


def if_prompt(prompt: Prompt) -> IFPrompt:
    """The prompt as environments/instructions.py checks it."""
    return IFPrompt(key=prompt.prompt_id, prompt=prompt.messages[-1].content,
                    instructions=tuple(instructions_of(prompt)))


def _to_prompt(env: str, p: IFPrompt, prompt_id: str) -> Prompt:
    payload = {"instructions": [{"id": i.id, "kwargs": i.kwargs} for i in p.instructions]}
    if p.base_answer is not None:
        payload["word"] = p.base_answer
    return Prompt(env=env, prompt_id=prompt_id, messages=(Message("user", p.prompt),), answer="", data_source=env,
                  payload=payload)


def _restamped(p: Prompt, env: str) -> Prompt:
    return replace(p, env=env, prompt_id=p.prompt_id.replace(p.env, env, 1), answer="", data_source=env,
                   payload={"word": p.payload["word"]})


def _draw(env: str, prompts: list[Prompt], n: int, seed: int, split: Split) -> list[Prompt]:
    """`n` prompts drawn (seeded, with replacement) from the file's `split` part; each gets its own id."""
    part = [p for p in prompts if in_split(p.messages[-1].content, split)]
    if not part:
        raise ValueError(f"prompts_path has no {split} prompts (about a fifth of the lines, by their text, are eval)")
    rng = random.Random(f"{env}:{seed}:{split}")
    return [replace(rng.choice(part), prompt_id=f"{env}:{split}:{seed}:{index}") for index in range(n)]


def _read_chat_prompts(path: str) -> list[Prompt]:
    """{"prompt": text} or {"messages": [{"role", "content"}, ...]} per line; errors name file:line and field."""
    prompts = []
    for where, number, row in jsonl_objects(path, "`prompt` or `messages`"):
        if isinstance(row.get("prompt"), str) and row["prompt"].strip():
            messages = (Message("user", row["prompt"]),)
        elif isinstance(row.get("messages"), list) and row["messages"]:
            if not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                       for m in row["messages"]):
                raise ValueError(f"{where}: messages: each needs a role in {list(ROLES)} and a string content")
            messages = tuple(Message(m["role"], m["content"]) for m in row["messages"])
        else:
            raise ValueError(f"{where}: prompt: a non-empty string `prompt` or list `messages` is required")
        prompts.append(Prompt(env="chat_reward_model", prompt_id=f"chat_reward_model:{path}:{number}",
                              messages=messages, answer="", data_source="chat_reward_model"))
    return prompts
