"""Auxiliary code-reasoning tasks made from the same problems as `code` (`code_auxiliary`), binary rewards.

Families (option `families`: {name: weight}, or a list of names for equal weights; default all):
- output_prediction (CodeI/O): given the reference solution and a test's input, predict the output.
  Answer: function problems, the returned value as a Python literal, after `</think>` (a fenced block
  is accepted too); it is parsed and its repr must equal the repr of the reference's result, so layout
  and quotes do not matter but 1, 1.0 and True differ ("wrong type" when the types differ). stdio
  problems, the printed output in a fenced block, equal after `normalise_output` (line endings,
  trailing whitespace per line and trailing blank lines dropped).
- input_prediction (CodeI/O): given the reference solution and a test's output, propose an input on
  which the reference produces that output (compared as a test compares: `==` of values, or normalised
  standard output). Answer: function problems, the call `f(<literal arguments>)`; stdio problems, the
  standard input in a fenced block.
- reconstruction (CodeARC): given the input/output description and some of the tests (option
  `examples`, default 3; at least one test stays hidden), write the program; the reward is decided by
  the hidden tests (and `check`). Answer: the code in a ```python fenced block.
- falsification: given the statement and a rejected solution, propose an input on which it disagrees
  with the reference (a different result, an exception or a timeout). Answer as in input_prediction.
Proposed inputs must be valid: function arguments are Python literals, as many as the function takes,
each of a type the problem's tests pass in that position; stdio inputs must pass the problem's
validator when it has one; and the reference solution must run on the input without failing.

Problems are split into train and eval by their statement (zrl.env.base.in_split), as in `code`.
`Verification.metadata` holds the family and the reason: "passed", or "empty answer", "no code block",
"syntax error", "missing function", "not a literal", "wrong type", "not a call", "invalid input",
"wrong answer", "no disagreement", "runtime error", "timeout", "output limit", "sandbox lost".
Malformed answers earn 0 with their reason; they never raise.
"""

import ast
import random
from collections.abc import Mapping, Sequence

from environments.code_driver import literal, parse_arguments
from environments.code_env import DEFAULT_PROBLEMS, ANSWER_INSTRUCTION, fenced_program
from environments.code_problems import (CodeProblem, LazySandbox, Verdict, canonical, defines, extract_code,
                                        extract_text, judge, load_problems, normalise_output, run_calls, same_value)
from zrl.env.base import THINK_END, Environment, in_split
from zrl.types import Message, Prompt, Split, Verification

FAMILIES = ("output_prediction", "input_prediction", "reconstruction", "falsification")
_THINK = "Reason inside <think></think>, then give"


def _eligible(family: str, problem: CodeProblem) -> bool:
    if family == "reconstruction":
        return len(problem.tests) >= 2  # one shown, one hidden at least
    return bool(problem.tests) and (family != "falsification" or bool(problem.rejected))


def _fence(text: str) -> str:
    return f"```\n{text.rstrip()}\n```"


class CodeAuxiliary(Environment):
    name = "code_auxiliary"
    description = "CodeI/O output/input prediction, CodeARC reconstruction and falsification on code problems"
    reward_type = "binary"

    def __init__(self, problems: str | list[str] = DEFAULT_PROBLEMS,
                 families: Mapping[str, float] | Sequence[str] = FAMILIES, examples: int = 3,
                 limits: Mapping | None = None):
        weights = dict(families) if isinstance(families, Mapping) else {f: 1.0 for f in families}
        unknown = sorted(set(weights) - set(FAMILIES))
        if unknown or not weights or any(w < 0 for w in weights.values()) or not sum(weights.values()) > 0:
            raise ValueError(f"families: {{name: weight >= 0}} over {list(FAMILIES)} with a positive weight; "
                             f"got {families!r}")
        if examples < 1:
            raise ValueError(f"examples must be at least 1, got {examples}")
        self.weights = {f: float(w) for f, w in weights.items() if w > 0}
        self.examples = examples
        self.problems = load_problems(problems)
        self.sandbox = LazySandbox(limits)

    # ---- prompts ------------------------------------------------------------------------------------

    def sample(self, n: int, seed: int, split: Split = "train", difficulty: float | None = None) -> list[Prompt]:
        pools = {family: [pid for pid, (p, _) in self.problems.items() if _eligible(family, p)
                          and in_split(p.statement, split)] for family in self.weights}
        empty = [family for family, pool in pools.items() if not pool]
        if empty:
            raise ValueError(f"no {split} problems for the families {empty} among the {len(self.problems)} loaded")
        rng = random.Random(f"{self.name}:{seed}:{split}")
        families, weights = list(self.weights), list(self.weights.values())
        prompts = []
        for index in range(n):
            family = rng.choices(families, weights)[0]
            problem = self.problems[rng.choice(pools[family])][0]
            test, rejected = rng.randrange(len(problem.tests)), rng.randrange(max(1, len(problem.rejected)))
            prompts.append(self.task(family, problem.id, test, rejected,
                                     prompt_id=f"{self.name}:{split}:{seed}:{index}", difficulty=difficulty))
        return prompts

    def task(self, family: str, problem_id: str, test: int = 0, rejected: int = 0, prompt_id: str | None = None,
             difficulty: float | None = None) -> Prompt:
        """The prompt of one task: `test` picks the test (reconstruction: the first shown one), `rejected`
        the rejected solution (falsification)."""
        problem = self.problems[problem_id][0]
        if not _eligible(family, problem):
            raise ValueError(f"problem {problem_id!r} has no {family} task")
        text = getattr(self, f"_{family}_text")(problem, test, rejected)
        answer = problem.tests[test].output if family == "output_prediction" else ""
        return Prompt(env=self.name, prompt_id=prompt_id or f"{self.name}:{family}:{problem_id}:{test}:{rejected}",
                      messages=(Message("user", text),), answer=answer, data_source=f"{self.name}:{family}",
                      difficulty=difficulty,
                      payload={"family": family, "problem": problem_id, "test": test, "rejected": rejected})

    def _output_prediction_text(self, problem: CodeProblem, test: int, _) -> str:
        case = problem.tests[test]
        if problem.style == "function":
            return (f"Here is a Python function.\n\n```python\n{problem.accepted[0].rstrip()}\n```\n\nWhat does "
                    f"`{problem.entry_point}({case.input})` return? {_THINK} only the returned value as a Python "
                    "literal (as repr() prints it).")
        return (f"Here is a Python program.\n\n```python\n{problem.accepted[0].rstrip()}\n```\n\nWhat does it "
                f"print on this standard input?\n\n{_fence(case.input)}\n\n{_THINK} the exact output in one ``` "
                "fenced block.")

    def _input_prediction_text(self, problem: CodeProblem, test: int, _) -> str:
        case = problem.tests[test]
        code = f"```python\n{problem.accepted[0].rstrip()}\n```"
        if problem.style == "function":
            return (f"Here is a Python function.\n\n{code}\n\nGive a call of `{problem.entry_point}` that returns "
                    f"`{case.output}`. {_THINK} only the call, `{problem.entry_point}(...)`, with every argument a "
                    "Python literal of a type the function takes.")
        return (f"Here is a Python program.\n\n{code}\n\n{self._input_format(problem)}Give a standard input on "
                f"which it prints exactly:\n\n{_fence(case.output)}\n\n{_THINK} the input in one ``` fenced block.")

    def _reconstruction_text(self, problem: CodeProblem, test: int, _) -> str:
        shown = [problem.tests[i] for i in self._shown(problem, test)]
        if problem.style == "function":
            examples = "\n".join(f"{problem.entry_point}({t.input}) == {t.output}" for t in shown)
            specs = "".join(f"{label}: {text}\n" for label, text in (("Parameters", problem.input_spec),
                                                                      ("Returns", problem.output_spec)) if text)
            return (f"Write a Python function `{problem.entry_point}` that behaves as these examples show.\n"
                    f"{specs}\n```python\n{examples}\n```\n\nHidden tests will call it on other inputs. "
                    f"{ANSWER_INSTRUCTION}")
        examples = "\n\n".join(f"Input:\n{_fence(t.input)}\nOutput:\n{_fence(t.output)}" for t in shown)
        return (f"Write a Python program that reads standard input and writes standard output as these "
                f"examples show.\n{self._input_format(problem)}\n{examples}\n\nHidden tests will run it on "
                f"other inputs. {ANSWER_INSTRUCTION}")

    def _falsification_text(self, problem: CodeProblem, _, rejected: int) -> str:
        wrong = f"```python\n{problem.rejected[rejected].rstrip()}\n```"
        if problem.style == "function":
            return (f"{problem.statement}\n\nThis implementation is wrong:\n\n{wrong}\n\nGive a call of "
                    f"`{problem.entry_point}` on which it does not return what a correct implementation returns "
                    f"(or fails). {_THINK} only the call, `{problem.entry_point}(...)`, with every argument a Python "
                    "literal of a type the function takes.")
        return (f"{problem.statement}\n\n{self._input_format(problem)}This program is wrong:\n\n{wrong}\n\nGive a "
                "valid input on which its output differs from a correct program's (or it fails). "
                f"{_THINK} the input in one ``` fenced block.")

    @staticmethod
    def _input_format(problem: CodeProblem) -> str:
        specs = [f"{label} format: {text}\n" for label, text in (("Input", problem.input_spec),
                                                                ("Output", problem.output_spec)) if text]
        return "".join(specs) + ("\n" if specs else "")

    def _shown(self, problem: CodeProblem, test: int) -> list[int]:
        """Reconstruction's shown tests: `examples` of them from `test` on, never all."""
        n = len(problem.tests)
        return [(test + j) % n for j in range(min(self.examples, n - 1))]

    def demonstration(self, prompt: Prompt) -> str | None:
        family, (problem, _) = prompt.payload["family"], self.problems[prompt.payload["problem"]]
        case = problem.tests[prompt.payload["test"]]
        if family == "output_prediction":
            return f"{THINK_END}\n{case.output if problem.style == 'function' else _fence(case.output)}"
        if family == "input_prediction":
            return f"{THINK_END}\n" + (f"{problem.entry_point}({case.input})" if problem.style == "function"
                                       else _fence(case.input))
        if family == "reconstruction":
            return fenced_program(problem.accepted[0])
        return None  # falsification: which input shows the bug is known only by running it

    # ---- verification -------------------------------------------------------------------------------

    def verify(self, prompt: Prompt, response: str) -> Verification:
        family, problem = prompt.payload["family"], self.problems[prompt.payload["problem"]][0]
        verdict = getattr(self, f"_verify_{family}")(problem, prompt.payload, response)
        return verdict.verification(family=family)

    def _verify_output_prediction(self, problem: CodeProblem, payload: Mapping, response: str) -> Verdict:
        answer, want = extract_text(response), problem.tests[payload["test"]].output
        if answer.reason:
            return Verdict(answer.reason)
        if problem.style == "stdio":
            return Verdict("passed" if normalise_output(answer.text) == normalise_output(want) else "wrong answer")
        try:
            got = literal(answer.text)
        except ValueError as exc:
            return Verdict("not a literal", str(exc))
        if type(got) is not type(literal(want)):
            return Verdict("wrong type", f"{type(got).__name__}, not {type(literal(want)).__name__}")
        return Verdict("passed" if repr(got) == canonical(want) else "wrong answer")

    def _verify_input_prediction(self, problem: CodeProblem, payload: Mapping, response: str) -> Verdict:
        proposed = self._proposed_input(problem, response)
        if isinstance(proposed, Verdict):
            return proposed
        want = problem.tests[payload["test"]].output
        reference = self._reference_run(problem, proposed)
        if isinstance(reference, Verdict):
            return reference
        agree = same_value(reference, want) if problem.style == "function" else \
            normalise_output(reference) == normalise_output(want)
        return Verdict("passed" if agree else "wrong answer")

    def _verify_reconstruction(self, problem: CodeProblem, payload: Mapping, response: str) -> Verdict:
        answer = extract_code(response)
        if answer.reason:
            return Verdict(answer.reason)
        if problem.style == "function" and not defines(answer.text, problem.entry_point):
            return Verdict("missing function")
        shown = set(self._shown(problem, payload["test"]))
        hidden = [t for i, t in enumerate(problem.tests) if i not in shown]
        return judge(self.sandbox.get(), problem, answer.text, hidden, check=True)

    def _verify_falsification(self, problem: CodeProblem, payload: Mapping, response: str) -> Verdict:
        proposed = self._proposed_input(problem, response)
        if isinstance(proposed, Verdict):
            return proposed
        rejected = problem.rejected[payload["rejected"]]
        if problem.style == "function":
            reference_run, run = run_calls(self.sandbox.get(), problem, [problem.accepted[0], rejected], [proposed])
            reference = self._reference_result(reference_run)
            if isinstance(reference, Verdict):
                return reference
            failed = run.failure is not None or run.returns[0].error is not None
            differs = failed or not same_value(run.returns[0].repr, reference)
        else:
            reference = self._reference_run(problem, proposed)
            if isinstance(reference, Verdict):
                return reference
            run, = self.sandbox.get().run(rejected, [proposed])
            differs = run.status != "ok" or normalise_output(run.stdout) != normalise_output(reference)
        return Verdict("passed" if differs else "no disagreement")

    # ---- proposed inputs ----------------------------------------------------------------------------

    def _proposed_input(self, problem: CodeProblem, response: str) -> str | Verdict:
        """The input an answer proposes (function: its argument list source; stdio: the standard input),
        or the Verdict saying why it is malformed or invalid."""
        answer = extract_text(response)
        if answer.reason:
            return Verdict(answer.reason)
        if problem.style == "stdio":
            stdin = answer.text + "\n"
            if problem.validator is not None:
                check, = self.sandbox.get().run(problem.validator, [stdin])
                if check.status != "ok":
                    return Verdict("invalid input", "the validator rejects it")
            return stdin
        return _call_arguments(problem, answer.text)

    def _reference_run(self, problem: CodeProblem, proposed: str) -> str | Verdict:
        """The reference solution's result on a proposed input (repr or standard output); failing on it
        makes the input invalid."""
        if problem.style == "function":
            run, = run_calls(self.sandbox.get(), problem, problem.accepted[:1], [proposed])
            return self._reference_result(run)
        run, = self.sandbox.get().run(problem.accepted[0], [proposed])
        if run.status == "lost":
            return Verdict("sandbox lost", run.stderr)
        return run.stdout if run.status == "ok" else Verdict("invalid input", f"the reference solution: {run.status}")

    @staticmethod
    def _reference_result(run) -> str | Verdict:
        if run.failure == "sandbox lost":
            return Verdict("sandbox lost", run.detail)
        if run.failure is not None or run.returns[0].error is not None:
            return Verdict("invalid input", f"the reference solution: {run.failure or run.returns[0].error}")
        return run.returns[0].repr


def _call_arguments(problem: CodeProblem, text: str) -> str | Verdict:
    """The argument list of an answer `entry_point(<literals>)`, checked against the function's
    parameters and the types the tests pass, or the Verdict saying what is wrong with it."""
    try:
        call = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return Verdict("not a call", "does not parse as a Python expression")
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == problem.entry_point):
        return Verdict("not a call", f"not a call of {problem.entry_point}")
    if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
        return Verdict("not a literal", "keyword or starred arguments")
    try:
        values = [literal(a) for a in call.args]
    except ValueError as exc:
        return Verdict("not a literal", str(exc))
    low, high = _arity(problem)
    if not low <= len(values) <= high:
        return Verdict("invalid input", f"{len(values)} arguments; {problem.entry_point} takes {low} to {high}")
    seen = _argument_types(problem)
    for position, value in enumerate(values):
        allowed = seen[position] if position < len(seen) else None
        if allowed and type(value) not in allowed:
            return Verdict("invalid input", f"argument {position + 1} is a {type(value).__name__}; the tests pass "
                                            f"{sorted(t.__name__ for t in allowed)}")
    return ", ".join(repr(v) for v in values)


def _arity(problem: CodeProblem) -> tuple[int, float]:
    """How many positional arguments the reference solution's function takes (min, max)."""
    functions = [n for n in ast.parse(problem.accepted[0]).body
                 if isinstance(n, ast.FunctionDef) and n.name == problem.entry_point]
    if not functions:
        return 0, float("inf")
    args = functions[-1].args
    positional = len(args.posonlyargs) + len(args.args)
    return positional - len(args.defaults), float("inf") if args.vararg else positional


def _argument_types(problem: CodeProblem) -> list[set[type]]:
    """Per position, the types of the arguments the problem's tests pass there."""
    seen: list[set[type]] = []
    for test in problem.tests:
        for position, value in enumerate(parse_arguments(test.input)):
            if position == len(seen):
                seen.append(set())
            seen[position].add(type(value))
    return seen
