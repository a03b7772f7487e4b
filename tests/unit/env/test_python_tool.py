"""Tool calls (zrl/env/tools.py): every call of a message is read in the Hermes format, a malformed one is
answered with its reason as text (never an exception), and the python tool runs code in the real sandbox:
stdout back on success, the error's text on failure, replies clipped."""

import pytest

from zrl.env.tools import PythonTool, ToolCall, Toolbox, ToolResult, parse_tool_calls, tool_call_text
from zrl.sandbox import Limits, Sandbox


class Echo:
    """A tool that answers with its arguments (the toolbox's logic without a sandbox)."""

    name = "echo"

    def __call__(self, arguments):
        return ToolResult(str(arguments.get("say")), ok="say" in arguments)


class NoSandbox:
    """Fails the test if the python tool runs anything."""

    limits = Limits()

    def run(self, program, inputs):
        raise AssertionError(f"ran {program!r}")


@pytest.fixture(scope="module")
def python():
    return PythonTool(Sandbox(Limits(wall_s=2.0, cpu_s=1.0, output_bytes=4096)), max_reply_chars=200)


def test_calls_are_read_in_order_with_whitespace_around_the_json():
    text = ('</think>first <tool_call>\n  {"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
            'then<tool_call>{"name":"echo","arguments":{"say":"hi"}}</tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "print(1)"}), ToolCall("echo", {"say": "hi"})]
    assert parse_tool_calls("</think>42") == []


@pytest.mark.parametrize("body, reason", [
    ('{"name": "python", "arguments": {"code": "1"}', "not valid JSON"),
    ("[" * 100_000, "not valid JSON"),                      # deeper than the JSON parser recurses
    ('["python", {"code": "1"}]', "is a JSON object"),
    ('{"arguments": {"code": "1"}}', "is a JSON object"),
    ('{"name": "python", "arguments": "print(1)"}', "is a JSON object"),
])
def test_a_malformed_call_is_a_call_with_its_error(body, reason):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and reason in call.error


def test_an_unclosed_call_is_an_error():
    [call] = parse_tool_calls('<tool_call>{"name": "echo", "arguments": {}}')
    assert "no closing </tool_call>" in call.error


def test_rendered_calls_parse_back():
    arguments = {"code": 'print("a\\n", {"b": 1})'}
    assert parse_tool_calls(tool_call_text("python", arguments)) == [ToolCall("python", arguments)]


def test_the_toolbox_answers_every_call_in_order_and_counts_the_failures():
    text = ('<tool_call>{"name": "echo", "arguments": {"say": "one"}}</tool_call>'
            '<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"say": "two"</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {}}</tool_call>')
    replies = Toolbox([Echo()]).reply(text)
    contents = [m["content"] for m in replies.messages]
    assert [m["role"] for m in replies.messages] == ["tool"] * 4
    assert contents[0] == "one"
    assert contents[1] == "Error: unknown tool 'shell' (available: echo)"
    assert contents[2].startswith("Error: the tool call is not valid JSON")
    assert contents[3] == "None"  # the tool's own failure, reported by the tool
    assert (replies.calls, replies.errors) == (4, 3)


def test_calls_past_the_limit_are_errors_and_do_not_run():
    text = "".join(tool_call_text("echo", {"say": str(i)}) for i in range(5))
    replies = Toolbox([Echo()], max_calls=3).reply(text)
    assert [m["content"] for m in replies.messages[:3]] == ["0", "1", "2"]
    assert [m["content"] for m in replies.messages[3:]] == ["Error: too many tool calls in one message (at most 3 "
                                                           "are run)"] * 2
    assert (replies.calls, replies.errors) == (5, 2)


def test_tool_names_are_unique():
    with pytest.raises(ValueError, match="names must be unique"):
        Toolbox([Echo(), Echo()])


@pytest.mark.parametrize("arguments", [{"code": 7}, {"program": "print(1)"}, {"code": "print(1)", "timeout": 9}])
def test_the_python_tool_refuses_other_arguments_without_running(arguments):
    result = PythonTool(NoSandbox())(arguments)
    assert not result.ok and result.content.startswith('Error: the python tool takes {"code": <program>}')


def test_code_runs_in_the_sandbox_and_stdout_is_the_reply(python):
    replies = Toolbox([python]).reply(tool_call_text("python", {"code": "import os\nprint(123 * 456, os.getcwd())"}))
    assert replies.messages == ({"role": "tool", "content": "56088 /scratch\n"},)  # the sandbox's scratch directory
    assert (replies.calls, replies.errors) == (1, 0)


def test_stdin_is_empty(python):
    assert python({"code": "import sys\nprint(repr(sys.stdin.read()))"}) == ToolResult("''\n", ok=True)


def test_an_exception_returns_the_end_of_its_traceback(python):
    result = python({"code": "def f(x):\n    return 1 / x\nf(0)"})
    assert not result.ok
    assert result.content.startswith("Error: exit code 1\nTraceback")
    assert result.content.endswith("ZeroDivisionError: division by zero")


def test_a_long_traceback_keeps_its_last_whole_lines(python):
    result = python({"code": "import sys\nsys.stderr.write('x' * 5000 + '\\n')\nraise ValueError('the cause')"})
    header, note, kept = result.content.split("\n", 2)
    assert not result.ok and (header, note[:5]) == ("Error: exit code 1", "[... ")
    assert kept.startswith("Traceback") and kept.endswith("ValueError: the cause") and len(kept) <= 200


def test_long_output_is_clipped_to_its_head(python):
    result = python({"code": "print(''.join(str(i % 10) for i in range(3000)))"})
    assert result.ok
    assert result.content == "0123456789" * 20 + "\n[... 2801 more characters]"


def test_limits_come_back_as_errors(python):
    timeout = python({"code": "while True: pass"})
    flood = python({"code": "print('x' * 10_000)"})
    assert (timeout.ok, flood.ok) == (False, False)
    assert timeout.content == "Error: the program ran past its time limit (2 s, 1 s of CPU)"
    assert flood.content == "Error: the program wrote more than 4096 bytes"


def test_no_state_carries_between_calls(python):
    text = tool_call_text("python", {"code": "open('state', 'w').write('1')\nx = 5"}) + tool_call_text(
        "python", {"code": "import os\nprint(os.path.exists('state'), 'x' in globals())"})
    replies = Toolbox([python]).reply(text)
    assert [m["content"] for m in replies.messages] == ["", "False False\n"]
