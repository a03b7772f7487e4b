"""reasoning-gym procedural tasks (offline), scored by each task's own `score_answer`.

Options: `tasks` — a list of reasoning-gym dataset names, or a mapping name → that dataset's config
keyword arguments (e.g. `{chain_sum: {min_terms: 2, max_terms: 3}}`). Prompts are drawn round-robin
from a per-task generator seeded by (seed, task); `split="eval"` keeps the problems whose question text
falls in the held-out hash bucket. reasoning-gym may give partial credit (e.g. a format score); this
environment is binary: reward 1 only for a full score.
"""

import reasoning_gym

from zrl.env.base import Environment, extract_answer, in_split
from zrl.types import Message, Prompt, Split

DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "letter_counting", "spell_backward", "word_sorting")
_INSTRUCTION = "Reason inside <think></think>, then give only the final answer."


class ReasoningGym(Environment):
    name = "reasoning_gym"
    description = "reasoning-gym procedural puzzles (offline) with the package's own scorers"
    reward_type = "binary"

    def __init__(self, tasks: list[str] | dict[str, dict] = DEFAULT_TASKS):
        self.tasks = {t: {} for t in tasks} if not isinstance(tasks, dict) else {t: dict(c or {}) for t, c in tasks.items()}
        if not self.tasks:
            raise ValueError("tasks must name at least one reasoning-gym dataset")
        unknown = sorted(set(self.tasks) - set(reasoning_gym.factory.DATASETS))
        if unknown:
            raise ValueError(f"unknown reasoning-gym tasks {unknown}")
        self._scorers = {}

    def _dataset(self, task: str, size: int, seed: int):
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **self.tasks[task])

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        names = sorted(self.tasks)
        per_task = -(-n // len(names))
        pools = {}
        for k, task in enumerate(names):
            # Oversample so the held-out filter still leaves enough; eval keeps ~20% of problems.
            size = 8 * per_task if split == "eval" else 2 * per_task
            dataset = self._dataset(task, size, seed * 1000 + k)
            pools[task] = [entry for entry in dataset if in_split(entry["question"], split)]
        prompts = []
        for index in range(n):
            task = names[index % len(names)]
            pool = pools[task]
            if not pool:
                raise ValueError(f"reasoning-gym task {task!r} produced no {split} problems for seed {seed}")
            entry = pool[(index // len(names)) % len(pool)]
            prompts.append(Prompt(
                env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{index}",
                messages=(Message("user", f"{entry['question']}\n{_INSTRUCTION}"),),
                answer=str(entry["answer"]), data_source=f"{self.name}:{task}", difficulty=difficulty,
                payload={"task": task, "entry": entry}))
        return prompts

    def verify(self, prompt: Prompt, response: str) -> float:
        task = prompt.payload["task"]
        if task not in self._scorers:
            self._scorers[task] = self._dataset(task, 1, 0)
        score = self._scorers[task].score_answer(answer=extract_answer(response), entry=prompt.payload["entry"])
        return float(score >= 1.0)
