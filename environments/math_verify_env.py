"""Math word problems from a local JSONL file, answers compared with `math-verify`.

Each line holds a problem and its reference answer (field names configurable). The file is read with
`datasets.load_dataset("json", ...)`, so any local JSON/JSONL layout `datasets` reads works. The
verifier parses the answer section of the response (after `</think>`, preferring `\\boxed{}`) and the
reference with math-verify, which normalises LaTeX, fractions, decimals and sets. Its signal-based
timeouts are turned off: verifiers may run outside the main thread; the pipeline enforces time limits.
"""

import random
from pathlib import Path

from zrl.env.base import Environment, extract_answer, in_split
from zrl.types import Message, Prompt, Split

DEFAULT_DATA = Path(__file__).parent / "data" / "math_sample.jsonl"
_INSTRUCTION = "Reason inside <think></think>, then give the final answer as \\boxed{...}."


class MathVerify(Environment):
    name = "math"
    description = "math problems from local JSONL, answers checked with math-verify"
    reward_type = "binary"

    def __init__(self, data_files: str | list[str] = str(DEFAULT_DATA), problem_key: str = "problem",
                 answer_key: str = "answer"):
        import datasets

        rows = datasets.load_dataset("json", data_files=data_files, split="train")
        missing = {problem_key, answer_key} - set(rows.column_names)
        if missing:
            raise ValueError(f"{data_files}: missing fields {sorted(missing)} (columns: {rows.column_names})")
        self.rows = [(str(r[problem_key]), str(r[answer_key])) for r in rows]
        self.data_source = f"{self.name}:{Path(str(data_files)).stem}"

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        pool = [row for row in self.rows if in_split(row[0], split)]
        if not pool:
            raise ValueError(f"no {split} problems in the data ({len(self.rows)} rows)")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        prompts = []
        for index in range(n):
            problem, answer = rng.choice(pool)
            prompts.append(Prompt(
                env=self.name, prompt_id=f"{self.name}:{split}:{seed}:{index}",
                messages=(Message("user", f"{problem}\n{_INSTRUCTION}"),), answer=answer,
                data_source=self.data_source, difficulty=difficulty))
        return prompts

    def verify(self, prompt: Prompt, response: str) -> float:
        from math_verify import parse, verify

        gold = parse(f"${prompt.answer}$", parsing_timeout=None)
        predicted = parse(f"${extract_answer(response)}$", parsing_timeout=None)
        return float(bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=None))
