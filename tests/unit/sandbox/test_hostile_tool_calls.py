"""The python tool (zrl/env/tools.py) against the hostile-program corpus, each program sent as a policy's
tool call: what test_hostile_programs.py checks of the sandbox holds through the tool (nothing escaped,
limits kept, no process left), the tool's reply leaks nothing, and a run that fails or hits a limit comes
back as the error's text, counted as a failed call. The tool's stdin is empty, so each call's code first
sets its stdin to the attack's context (what the corpus reads from stdin), encoded."""

import base64
import json
import time

import pytest
from test_hostile_programs import (  # noqa: F401 (fixtures)
    HOSTILE, PROGRAMS, REPORT_NAMESPACE, check_contained, host, sandbox)

from zrl.env.tools import PythonTool, Toolbox, tool_call_text

ERRORS = {"error": "Error: exit code ", "timeout": "Error: the program ran past its time limit",
          "output_limit": "Error: the program wrote more than", "lost": "Error: the sandbox ended"}


class Recorded:
    """The sandbox, keeping each run's executions and duration for the corpus's checks."""

    def __init__(self, sandbox):
        self.sandbox, self.limits, self.calls = sandbox, sandbox.limits, []

    def run(self, program, inputs):
        start = time.monotonic()
        runs = self.sandbox.run(program, inputs)
        self.calls.append((runs, time.monotonic() - start))
        return runs


@pytest.fixture(scope="module")
def recorded(sandbox):
    return Recorded(sandbox)


def call(program: str, ctx: dict) -> str:
    """The policy's message calling `program` with `ctx` on its stdin; the context is encoded, so that its
    secret is in no file of the sandbox (the program's own source included) for an attack to find."""
    encoded = base64.b64encode(json.dumps(ctx).encode()).decode()
    stdin = f"import base64, io, sys; sys.stdin = io.StringIO(base64.b64decode({encoded!r}).decode())\n"
    return f"</think>{tool_call_text('python', {'code': REPORT_NAMESPACE + stdin + program})}"


@pytest.mark.parametrize("name", [p for p in PROGRAMS if not p.startswith(("06_", "07_"))])
def test_hostile_tool_call_is_contained(recorded, host, name):
    ctx = host[0]
    replies = Toolbox([PythonTool(recorded, max_reply_chars=2000)]).reply(call((HOSTILE / name).read_text(), ctx))
    [(runs, seconds)] = recorded.calls[-1:]
    check_contained(name, runs, seconds, host)
    [message] = replies.messages
    content = message["content"]
    assert "ESCAPED" not in content and ctx["secret"] not in content and ctx["scratch_secret"] not in content
    status = runs[0].status
    assert (replies.calls, replies.errors) == (1, int(status != "ok")), f"{name}: {status}"
    if status != "ok":
        assert content.startswith(ERRORS[status]), f"{name}: {content[:200]}"
    if name.startswith(("20_", "21_")):  # killing the harness ends nothing but the program
        assert (status, content) == ("ok", "alive\n")


def test_the_tool_still_answers_after_the_corpus(recorded):
    replies = Toolbox([PythonTool(recorded)]).reply(
        tool_call_text("python", {"code": "print(sum(range(10)))"}) + tool_call_text("python", {"code": "1/0"}))
    assert replies.messages[0]["content"] == "45\n"
    assert replies.messages[1]["content"].endswith("ZeroDivisionError: division by zero")
    assert (replies.calls, replies.errors) == (2, 1)
