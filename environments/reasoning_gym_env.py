"""reasoning-gym procedural tasks (offline), scored by each task's own `score_answer`.

Options: `tasks` — a list of reasoning-gym dataset names, or a mapping name → that dataset's config
keyword arguments (e.g. `{chain_sum: {min_terms: 2, max_terms: 3}}`). Prompts are drawn round-robin
over the tasks, starting at the task the seed picks (so draws of one prompt, as a mixture makes them,
visit every task), from a per-task generator seeded by (seed, task); `split="eval"` keeps the problems
whose question text falls in the held-out hash bucket, and a generator that yields too few of the split
is asked for more (a draw of one problem lands in the other split one time in five). reasoning-gym may
give partial credit (e.g. a format score); this environment is binary: reward 1 only for a full score.
"""

import reasoning_gym

from zrl.env.base import Environment, extract_answer, in_split
from zrl.types import Message, Prompt, Split

DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "letter_counting", "spell_backward", "word_sorting")
MAX_DOUBLINGS = 6  # a task's generator is asked for up to 64x the problems a draw needs
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

    def _pool(self, task: str, count: int, seed: int, split: Split) -> list[dict]:
        """At least `count` problems of `split` from the task's generator seeded `seed`, fewer only when
        it repeats itself; the generator is asked for 2x `count` (8x for eval, which keeps ~20%), then
        for twice as many until enough are in the split."""
        size = (8 if split == "eval" else 2) * count
        for _ in range(MAX_DOUBLINGS + 1):
            pool = [entry for entry in self._dataset(task, size, seed) if in_split(entry["question"], split)]
            if len(pool) >= count:
                break
            size *= 2
        if not pool:
            raise ValueError(f"reasoning-gym task {task!r} produced no {split} problems for seed {seed} "
                             f"among {size} generated")
        return pool

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        names = sorted(self.tasks)
        order = [names[(seed + index) % len(names)] for index in range(n)]
        pools = {task: self._pool(task, order.count(task), seed * 1000 + names.index(task), split)
                 for task in dict.fromkeys(order)}
        taken = dict.fromkeys(pools, 0)
        prompts = []
        for index, task in enumerate(order):
            pool = pools[task]
            entry = pool[taken[task] % len(pool)]
            taken[task] += 1
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
