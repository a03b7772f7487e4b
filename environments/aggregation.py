"""Aggregation prompts: train a policy for Markovian RSA on any verifiable environment.

A problem of the wrapped environment is shown with C candidate solutions, each cut to its *tail* (the
last `tail_tokens` tokens of its reasoning section, or with `hybrid` a finished candidate's answer
section), in the same template and chat form that test-time Markovian RSA builds (serving/rsa.py,
`AGGREGATION_TEMPLATE`), and the response is scored by the wrapped environment's verifier on the
original problem: the policy is rewarded for one correct solution, whatever the candidates said.

The candidates come from a rollouts file of stored solutions:
- **self-aggregation**: a checkpoint's own samples, written by
  `zrl eval CHECKPOINT --env NAME --split train --samples K --save-rollouts FILE` (e.g. from the
  previous stage's export);
- **expert-aggregation**: solutions from any other source (a stronger model, a dataset) in the same schema.

Rollouts file (JSONL, one problem per line):

    {"prompt": {"prompt_id": "...", "messages": [{"role": "user", "content": "..."}], "answer": "...",
                "data_source": "...", "difficulty": null, "payload": {}},
     "responses": ["reasoning </think> answer", ...],     # at least num_aggregated
     "rewards": [1.0, 0.0, ...]}                           # optional: the wrapped verifier's rewards

`prompt` is the wrapped environment's `Prompt` (its verifier reads `answer` and `payload`). Problems are
split into train and eval by prompt id. Draw i of `sample(n, seed, split)` takes a problem and C distinct
responses of it with a generator seeded by (seed, split). `demonstration` (for `sft` stages) is a stored
response that the verifier rewards, else the wrapped environment's own demonstration of the problem.
Tails are cut in the tokens of `tokenizer` (the policy's) and decoded back to text for the message.

Each aggregation entry is its own stage entry, so its rewards are reported apart from the plain
problems' (`reward/<key>`); prompts carry `data_source` "aggregation:<the problem's data source>".
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from zrl.env.base import THINK_END, Environment, in_split, safe_verify
from zrl.types import Message, Prompt, Split, Verification


@dataclasses.dataclass(frozen=True)
class StoredProblem:
    prompt: Prompt
    responses: tuple[str, ...]
    rewards: tuple[float, ...] | None


def read_rollouts(path: Path, min_responses: int) -> list[StoredProblem]:
    """The problems of a rollouts file; a malformed line is a ValueError naming the line and the field."""
    problems = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
                p = row["prompt"]
                prompt = Prompt(env=str(p.get("env", "")), prompt_id=str(p["prompt_id"]),
                                messages=tuple(Message(m["role"], m["content"]) for m in p["messages"]),
                                answer=str(p.get("answer", "")), data_source=str(p.get("data_source", "")),
                                difficulty=p.get("difficulty"), payload=p.get("payload") or {})
                responses = tuple(str(r) for r in row["responses"])
                rewards = tuple(float(r) for r in row["rewards"]) if row.get("rewards") is not None else None
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where}: not a rollouts row ({type(exc).__name__}: {exc})") from None
            if len(responses) < min_responses:
                raise ValueError(f"{where}: responses has {len(responses)}, fewer than num_aggregated "
                                 f"({min_responses})")
            if rewards is not None and len(rewards) != len(responses):
                raise ValueError(f"{where}: rewards has {len(rewards)} entries for {len(responses)} responses")
            if not any(m.role == "user" for m in prompt.messages):
                raise ValueError(f"{where}: prompt.messages has no user message")
            problems.append(StoredProblem(prompt, responses, rewards))
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems


class Aggregation(Environment):
    name = "aggregation"
    description = "a wrapped environment's problems with C candidate solution tails (Markovian RSA training)"

    def __init__(self, env: str, rollouts: str, tokenizer: str, env_options: dict | None = None,
                 num_aggregated: int = 4, tail_tokens: int = 256, hybrid: bool = False):
        if num_aggregated < 1 or tail_tokens < 1:
            raise ValueError(f"num_aggregated and tail_tokens must be >= 1 (got {num_aggregated}, {tail_tokens})")
        for option, path in (("rollouts", Path(rollouts)), ("tokenizer", Path(tokenizer))):
            if not path.exists():
                raise FileNotFoundError(f"{option}: {path} does not exist")
        # Imported after the checks above: transformers' AutoTokenizer costs ~3 s of imports, which a recipe
        # whose files are missing (`zrl validate` on a machine without the data) need not pay.
        from transformers import AutoTokenizer

        from serving.rsa import AGGREGATION_TEMPLATE, CANDIDATE_TEMPLATE, AggregationPrompter
        from zrl.config.schema import EnvironmentSpec
        from zrl.prompts import build_environment

        self.inner = build_environment(EnvironmentSpec(name=env, options=env_options or {}))
        if getattr(self.inner, "uses_reward_model", False):
            raise ValueError(f"{env!r} scores with a reward model; aggregation needs a verifiable environment")
        self.reward_type = self.inner.reward_type
        self.num_aggregated, self.tail_tokens, self.hybrid = num_aggregated, tail_tokens, hybrid
        self.prompter = AggregationPrompter(AutoTokenizer.from_pretrained(tokenizer))
        self.template, self.candidate_template = AGGREGATION_TEMPLATE, CANDIDATE_TEMPLATE
        self.problems = read_rollouts(Path(rollouts), num_aggregated)

    def tail(self, response: str) -> str:
        """What a stored response forwards: its reasoning's last `tail_tokens` tokens (with `hybrid`, the
        answer section of a response that closed its reasoning), as text."""
        tokenizer = self.prompter.tokenizer
        ids = tokenizer.encode(response, add_special_tokens=False)
        finish = "stop" if THINK_END in response else "length"
        return tokenizer.decode(self.prompter.tail(ids, finish, self.tail_tokens, self.hybrid))

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        pool = [i for i, p in enumerate(self.problems) if in_split(p.prompt.prompt_id, split)]
        if not pool:
            raise ValueError(f"no {split} problems among the {len(self.problems)} of the rollouts file")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        prompts = []
        for k in range(n):
            index = rng.choice(pool)
            problem = self.problems[index]
            picks = rng.sample(range(len(problem.responses)), self.num_aggregated)
            candidates = "".join(self.candidate_template.format(number=j + 1, tail=self.tail(problem.responses[i]))
                                 for j, i in enumerate(picks))
            messages = list(problem.prompt.messages)
            last_user = max(i for i, m in enumerate(messages) if m.role == "user")
            content = self.template.format(problem=messages[last_user].content, count=len(picks),
                                           candidates=candidates)
            messages[last_user] = Message("user", content)
            prompts.append(Prompt(env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{k}", messages=tuple(messages),
                                  answer=problem.prompt.answer, data_source=f"aggregation:{problem.prompt.data_source}",
                                  payload={"problem": index, "prompt_id": problem.prompt.prompt_id,
                                           "candidates": picks}))
        return prompts

    def original(self, prompt: Prompt) -> Prompt:
        """The wrapped environment's prompt that an aggregation prompt shows."""
        problem = self.problems[prompt.payload["problem"]]
        if problem.prompt.prompt_id != prompt.payload["prompt_id"]:
            raise ValueError(f"{prompt.prompt_id!r} was drawn from another rollouts file")
        return problem.prompt

    def verify(self, prompt: Prompt, response: str) -> float | Verification:
        return self.inner.verify(self.original(prompt), response)

    def verify_group(self, prompt: Prompt, responses) -> list[float | Verification]:
        return list(self.inner.verify_group(self.original(prompt), responses))

    def demonstration(self, prompt: Prompt) -> str | None:
        original = self.original(prompt)
        index = prompt.payload["problem"]
        problem = self.problems[index]
        if problem.rewards is None:  # verified once per problem (an SFT stage asks for every example)
            self.problems[index] = problem = dataclasses.replace(
                problem, rewards=tuple(safe_verify(self.inner, original, r).reward for r in problem.responses))
        rewards = problem.rewards
        correct = [r for r, reward in zip(problem.responses, rewards) if reward >= 0.5]
        return correct[0] if correct else self.inner.demonstration(original)
