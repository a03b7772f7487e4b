"""The sandboxed executor's contract on ordinary programs: statuses, limits, refusals (the attacks are in
test_hostile_programs.py)."""

from pathlib import Path

import pytest

import zrl.sandbox as sandbox_module
from zrl.sandbox import Limits, Sandbox, SandboxUnavailable


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(Limits(wall_s=2.0, cpu_s=1.0, output_bytes=1000))


def test_each_input_gets_its_own_run_with_its_status(sandbox):
    program = "import sys\nline = input()\nif line == 'fail': sys.exit(4)\nif line == 'spin':\n    while True: pass\nprint(line * 2)"
    runs = sandbox.run(program, ["ab", "fail", "spin", "x" * 600, "cd"])
    assert [r.status for r in runs] == ["ok", "error", "timeout", "output_limit", "ok"]
    assert (runs[0].stdout, runs[1].exit_code, runs[4].stdout) == ("abab\n", 4, "cdcd\n")
    assert len(runs[3].stdout) == 1000  # kept up to the budget


def test_an_exception_is_an_error_with_its_traceback(sandbox):
    run = sandbox.run("raise KeyError('missing')", [""])[0]
    assert run.status == "error" and "KeyError: 'missing'" in run.stderr


def test_a_program_that_ignores_a_large_input_does_not_block(sandbox):
    runs = sandbox.run("print('done')", ["x" * (1 << 20), ""])
    assert [(r.status, r.stdout) for r in runs] == [("ok", "done\n")] * 2


def test_bytes_that_are_not_utf8_are_replaced(sandbox):
    run = sandbox.run("import sys\nsys.stdout.buffer.write(b'a\\xffb')", [""])[0]
    assert (run.status, run.stdout) == ("ok", "a\ufffdb")


def test_no_inputs_start_no_sandbox(sandbox):
    assert sandbox.run("print(1)", []) == []


def test_the_scratch_directory_is_the_working_directory_and_writable(sandbox):
    run = sandbox.run("import os\nopen('f', 'w').write('x')\nprint(os.getcwd(), open('f').read())", [""])[0]
    assert (run.status, run.stdout) == ("ok", "/scratch x\n")


@pytest.mark.parametrize("field", ["wall_s", "cpu_s", "memory_mb", "processes", "output_bytes"])
def test_a_limit_must_be_positive(field):
    with pytest.raises(ValueError, match=f"sandbox limit {field} must be a positive number"):
        Limits(**{field: 0})


def test_a_runtime_that_cannot_start_is_refused_with_the_reason():
    with pytest.raises(SandboxUnavailable, match=r"/nonexistent/python3: not found") as error:
        Sandbox(python="/nonexistent/python3")
    assert "\n" not in str(error.value)


def test_a_machine_without_namespaces_is_refused_not_run_unsandboxed(monkeypatch):
    """bwrap that cannot create the sandbox (here: a binary that fails at once) makes Sandbox() raise;
    nothing runs outside a sandbox instead."""
    monkeypatch.setattr(sandbox_module, "_bwrap_for", lambda user: Path("/bin/false"))
    with pytest.raises(SandboxUnavailable, match="bubblewrap cannot run Python in a sandbox") as error:
        Sandbox()
    assert "user namespaces" in str(error.value) and "\n" not in str(error.value)
