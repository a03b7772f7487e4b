"""The code-problem schema, its reader, answer extraction, the function-call driver and the human-eval builder.

The driver and builder tests run real sandboxes (bubblewrap is a project dependency: without it they
fail, they do not skip), one Sandbox for the module.
"""

import json

import pytest

from environments.code_driver import is_plain, parse_arguments
from environments.code_env import DEFAULT_PROBLEMS
from environments.code_problems import (Case, CodeProblem, canonical, extract_code, extract_text, judge,
                                        normalise_output, read_problems, run_calls, same_value)
from environments.human_eval_build import _mutants, decompose_check, human_eval_records
from zrl.sandbox import Limits, Sandbox

FUNCTION = {"id": "f1", "style": "function", "statement": "Add two numbers.", "entry_point": "add",
            "accepted": ["def add(a, b):\n    return a + b\n"], "rejected": ["def add(a, b):\n    return a - b\n"],
            "tests": [{"input": "1, 2", "output": "3"}, {"input": "[1], [2]", "output": "[1, 2]"}]}
STDIO = {"id": "s1", "style": "stdio", "statement": "Print the sum of two integers.", "input_spec": "two integers",
         "output_spec": "their sum", "accepted": ["a, b = map(int, input().split())\nprint(a + b)\n"],
         "tests": [{"input": "1 2\n", "output": "3\n"}]}

# A candidate that returns the expected output it finds in the process's memory (the test's job).
LOOKUP = """import ast, gc
def add(a, b):
    for o in gc.get_objects():
        for value in (o.values() if type(o) is dict else ()):
            if type(value) is list and value and all(type(v) is str for v in value) and "3" in value:
                return ast.literal_eval(value[0] if a == 1 else value[-1])
"""


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(wall_s=5.0))


def write(tmp_path, *records) -> str:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_reader_reads_both_styles(tmp_path):
    problems = read_problems(write(tmp_path, FUNCTION, "", STDIO))
    assert [p.id for p in problems] == ["f1", "s1"]
    assert problems[0].tests[1] == Case(input="[1], [2]", output="[1, 2]") and problems[1].rejected == ()


@pytest.mark.parametrize("record, message", [
    ("{not json", r":1: record: Invalid JSON"),
    ({k: v for k, v in STDIO.items() if k != "statement"}, r":1: statement: Field required"),
    ({**STDIO, "tests": [{"input": 1, "output": "3"}]}, r":1: tests\[0\].input: Input should be a valid string"),
    ({**STDIO, "style": "batch"}, r":1: style: Input should be 'stdio' or 'function'"),
    ({**STDIO, "accepted": []}, r":1: accepted: .*at least 1 item"),
    ({**STDIO, "extra": 1}, r":1: extra: Extra inputs are not permitted"),
    ({**FUNCTION, "tests": [{"input": "x + 1", "output": "3"}]}, r":1: tests\[0\].input: not a Python literal"),
    ({**FUNCTION, "tests": [{"input": "1", "output": "[1,"}]}, r":1: tests\[0\].output: not a Python literal"),
    ({**FUNCTION, "entry_point": None}, r":1: entry_point: function problems name the function"),
    ({**FUNCTION, "accepted": ["def add(a, b) return a"]}, r":1: accepted\[0\]: not valid Python"),
    ({**FUNCTION, "tests": [], "check": "def test(c): pass"}, r":1: check: defines no top-level function check"),
    ({**FUNCTION, "tests": []}, r":1: tests: a problem needs tests"),
    ({**STDIO, "entry_point": "main"}, r":1: entry_point: only function problems have one"),
    ({**FUNCTION, "validator": "pass"}, r":1: validator: only stdio problems have one"),
])
def test_reader_names_file_line_and_field(tmp_path, record, message):
    path = write(tmp_path, record)
    with pytest.raises(ValueError, match=f"^{path}{message}") as error:
        read_problems(path)
    assert "\n" not in str(error.value)


def test_reader_rejects_a_repeated_id(tmp_path):
    with pytest.raises(ValueError, match=r":3: id: 'f1' repeats the id of line 1$"):
        read_problems(write(tmp_path, FUNCTION, STDIO, FUNCTION))


@pytest.mark.parametrize("response, code, reason", [
    ("plan\n</think>\n```python\nx = 1\n```\nthen\n```\ny = 2\n```", "y = 2\n", None),
    ("```python\nx = 1\n```\n</think>\nno code here", "", "no code block"),
    ("</think>\n```py\nx = 1\n```\n```text\noutput\n```", "x = 1\n", None),
    ("no think tag\n```python\nprint(3)\n```", "print(3)\n", None),
    ("</think>\n```python\ndef f(:\n```", "", "syntax error"),
    ("</think>\n```python\n\n```", "", "empty answer"),
    ("reasoning only</think>  \n", "", "empty answer"),
    ("</think>\n```python\nx = 1\n", "", "no code block"),  # an unclosed fence: a truncated response
])
def test_extract_code(response, code, reason):
    answer = extract_code(response)
    assert (answer.text, answer.reason) == (code, reason)


@pytest.mark.parametrize("response, text, reason", [
    ("</think>\n  [1, 2]  \n", "  [1, 2]", None),
    ("</think>\n```\n1 2\n3\n```", "1 2\n3", None),
    ("x</think>\n", "", "empty answer"),
])
def test_extract_text(response, text, reason):
    assert (extract_text(response).text, extract_text(response).reason) == (text, reason)


def test_comparisons():
    assert normalise_output("1  \r\n2\n\n\n") == "1\n2" and normalise_output("1\n 2") != normalise_output("1\n2")
    assert canonical("{ 'a' : [1,2] }") == "{'a': [1, 2]}" and canonical("{3, 1}") == "{1, 3}"
    assert same_value("1", "1.0") and not same_value("1", "'1'") and same_value("<object>", "<object>")
    assert parse_arguments("(1, 2)") == ((1, 2),) and parse_arguments("") == ()
    assert parse_arguments("'a', -1") == ("a", -1)
    with pytest.raises(ValueError):
        parse_arguments("x=1")
    cyclic = []
    cyclic.append(cyclic)
    assert is_plain({1: [(2.0, "a", None, b"", {frozenset()})]}) and not is_plain(cyclic) and not is_plain([object()])


def test_decompose_check():
    module = ("METADATA = {}\n\ndef check(candidate):\n    assert candidate(1, [2]) == 3\n"
              "    assert True, 'no test'\n    assert 4 == candidate(0, [4]), 'reversed'\n"
              "    assert candidate(1, [2]) == 3\n")
    assert decompose_check(module) == ([("1, [2]", "3"), ("0, [4]", "4")], False)
    assert decompose_check(module + "    assert abs(candidate(1, [0]) - 1) < 1e-6\n")[1]
    assert decompose_check("def check(candidate):\n    assert candidate(x) == 1\n") == ([], True)


def test_mutants_are_distinct_deterministic_and_touch_only_the_function():
    import ast
    import random

    source = ("LIMIT = 3\n\ndef f(xs, k):\n    if not xs:\n        return 0\n"
              "    return sum(x for x in xs if x < k and x > 1)\n")
    mutants = list(_mutants(source, "f", random.Random(0)))
    assert mutants == list(_mutants(source, "f", random.Random(0))) and len(mutants) == len(set(mutants)) >= 8
    for mutant in mutants:
        ast.parse(mutant)
        assert mutant.startswith("LIMIT = 3\n") and mutant != ast.unparse(ast.parse(source))
    assert any("if not xs" not in m for m in mutants) and any(" or " in m for m in mutants)


def test_driver_runs_calls_and_compares(sandbox):
    problem = CodeProblem.model_validate_json(json.dumps(FUNCTION))
    ok, wrong = run_calls(sandbox, problem, [FUNCTION["accepted"][0], FUNCTION["rejected"][0]],
                          ["1, 2", "[1], [2]"], ["3", "[1, 2]"])
    assert [(r.repr, r.equal) for r in ok.returns] == [("3", True), ("[1, 2]", True)] and ok.failure is None
    assert wrong.returns[0].repr == "-1" and not wrong.returns[0].equal and "TypeError" in wrong.returns[1].error


@pytest.mark.parametrize("program, reason", [
    ("def add(a, b):\n    return a + b\n", "passed"),
    ("import sys\nsys.exit(0)\n", "runtime error"),  # an early exit leaves no answer line
    ("class Any:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Any()\n",
     "runtime error"),  # not plain data
    ("import sys\ndef add(a, b):\n    print('3')\n    sys.__stdout__.write('{\"load\": null}\\n')\n    return 0\n",
     "wrong answer"),  # prints cannot forge the answer line
    ("def add(a, b):\n    raise ValueError('no')\n", "runtime error"),
    ("raise SystemExit(3)\n", "runtime error"),
    (LOOKUP, "wrong answer"),  # the expected outputs are not in the sandbox to be found
])
def test_judge_function_problems_against_hostile_programs(sandbox, program, reason):
    problem = CodeProblem.model_validate_json(json.dumps(FUNCTION))
    assert judge(sandbox, problem, program, problem.tests, check=False).reason == reason


def test_judge_check_sees_the_starter_helpers(sandbox):
    record = {**FUNCTION, "starter": "def helper(x):\n    return 2 * x\n", "tests": [],
              "check": "def check(candidate):\n    assert candidate(helper(1), 1) == 3\n"}
    problem = CodeProblem.model_validate_json(json.dumps(record))
    assert judge(sandbox, problem, FUNCTION["accepted"][0], problem.tests, check=True).passed
    verdict = judge(sandbox, problem, FUNCTION["rejected"][0], problem.tests, check=True)
    assert verdict.reason == "wrong answer" and verdict.detail.startswith("check: AssertionError")


def test_judge_stdio(sandbox):
    problem = CodeProblem.model_validate_json(json.dumps(STDIO))
    assert judge(sandbox, problem, STDIO["accepted"][0], problem.tests, check=False).passed
    assert judge(sandbox, problem, "print(4)", problem.tests, check=False).reason == "wrong answer"
    assert judge(sandbox, problem, "raise SystemExit(2)", problem.tests, check=False).reason == "runtime error"
    assert judge(sandbox, problem, "print('3   ')\nprint()", problem.tests, check=False).passed


def test_bundled_human_eval_file():
    problems = read_problems(DEFAULT_PROBLEMS)
    assert len(problems) == 164 and len({p.statement for p in problems}) == 164
    assert all(p.style == "function" and p.starter and p.accepted for p in problems)
    assert sum(bool(p.tests) for p in problems) >= 150 and sum(bool(p.rejected) for p in problems) >= 140


def test_builder_is_deterministic_and_matches_the_bundled_file(sandbox):
    ids = ["HumanEval/0", "HumanEval/33", "HumanEval/151"]
    bundled = {r["id"]: r for r in map(json.loads, open(DEFAULT_PROBLEMS)) if r["id"] in ids}
    built = {r["id"]: r for r in human_eval_records(sandbox, ids)}
    assert built == bundled
    assert built["HumanEval/0"]["tests"][0] == {"input": "[1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3", "output": "True"}
    assert "check" in built["HumanEval/33"] and "check" not in built["HumanEval/0"]
