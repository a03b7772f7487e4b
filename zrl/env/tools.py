"""Tools a policy calls from its messages, and the sandboxed Python tool.

Call format: the Hermes convention that Qwen-family chat templates render, one JSON object per call,
    <tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>
with any whitespace around the JSON. `Toolbox.reply(text)` answers every call of a policy message, in
order, with one tool message `{"role": "tool", "content": ...}` per call, and counts the calls and the
failed ones. A call that cannot be answered (not JSON, no closing tag, an unknown tool, bad arguments,
too many calls in one message) and a tool run that fails get their reason back as the message's text:
the policy reads it on its next turn; nothing a message contains raises.

`PythonTool` runs a call's `code` in a fresh sandbox (zrl/sandbox.py; generated code is hostile input),
stdin empty: its reply is the program's stdout; a non-zero exit, a timeout, the output limit or a lost
sandbox is an error whose text is the last part of stderr or the limit that stopped it. No state carries
from one call to the next. Replies are clipped to `max_reply_chars` so that one call cannot flood the
context.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

TOOL_ROLE = "tool"
_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call read from a policy message; `error` says why it cannot be run (name and arguments then
    hold what could be read)."""

    name: str | None
    arguments: Mapping[str, Any]
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    content: str   # what the tool message says
    ok: bool       # False: the call failed and `content` says why


@dataclass(frozen=True)
class ToolReplies:
    """A policy message's tool messages (one per call, in order) and how many calls failed."""

    messages: tuple[dict[str, str], ...]
    calls: int
    errors: int


class Tool(Protocol):
    name: str

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult: ...


def tool_call_text(name: str, arguments: Mapping[str, Any]) -> str:
    """A call in the format `parse_tool_calls` reads (compact JSON: fewer tokens in demonstrations)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': dict(arguments)}, separators=(',', ':'))}</tool_call>"


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call in `text`, in order; a malformed one is a ToolCall with its `error`."""
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1), match.group(2)
        if not closed:
            calls.append(ToolCall(None, {}, "the tool call has no closing </tool_call>"))
            continue
        try:
            call = json.loads(body)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
            calls.append(ToolCall(None, {}, f"the tool call is not valid JSON ({exc})"))
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(ToolCall(name if isinstance(name, str) else None, {},
                                  'a tool call is a JSON object {"name": <tool>, "arguments": {...}}'))
            continue
        calls.append(ToolCall(name, arguments))
    return calls


class Toolbox:
    """The tools of an environment, by name; answers the calls of a policy message."""

    def __init__(self, tools: Sequence[Tool], max_calls: int = 4):
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"tools: names must be unique, got {[tool.name for tool in tools]}")
        self.max_calls = max_calls

    def reply(self, text: str) -> ToolReplies:
        results = [self._run(call, index) for index, call in enumerate(parse_tool_calls(text))]
        return ToolReplies(tuple({"role": TOOL_ROLE, "content": r.content} for r in results), len(results),
                           sum(not r.ok for r in results))

    def _run(self, call: ToolCall, index: int) -> ToolResult:
        if index >= self.max_calls:
            return _error(f"too many tool calls in one message (at most {self.max_calls} are run)")
        if call.error:
            return _error(call.error)
        if call.name not in self.tools:
            return _error(f"unknown tool {call.name!r} (available: {', '.join(sorted(self.tools))})")
        return self.tools[call.name](call.arguments)


class PythonTool:
    """`{"code": <program>}` runs the program in a fresh sandbox; its stdout is the reply."""

    name = "python"

    def __init__(self, sandbox, max_reply_chars: int = 1000):
        """`sandbox`: a zrl.sandbox.Sandbox (anything with its `run(program, inputs)`)."""
        if max_reply_chars < 1:
            raise ValueError(f"max_reply_chars must be >= 1, got {max_reply_chars}")
        self.sandbox = sandbox
        self.max_reply_chars = max_reply_chars

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            return _error(f'the python tool takes {{"code": <program>}}, got arguments {sorted(arguments)}')
        [run] = self.sandbox.run(code, [""])
        if run.status == "ok":
            return ToolResult(_clip(run.stdout, self.max_reply_chars, keep="head"), ok=True)
        limits = self.sandbox.limits
        why = {"error": f"exit code {run.exit_code}",
               "timeout": f"the program ran past its time limit ({limits.wall_s:g} s, {limits.cpu_s:g} s of CPU)",
               "output_limit": f"the program wrote more than {limits.output_bytes} bytes",
               "lost": "the sandbox ended before the program finished"}[run.status]
        stderr = _clip(run.stderr.strip(), self.max_reply_chars, keep="tail")
        return _error(f"{why}\n{stderr}" if stderr else why)


def _error(text: str) -> ToolResult:
    return ToolResult(f"Error: {text}", ok=False)


def _clip(text: str, max_chars: int, keep: str) -> str:
    """`text` cut to at most `max_chars` characters, keeping its head (stdout) or its last whole lines
    (stderr: a traceback ends with the exception), with a note of how much was cut."""
    if len(text) <= max_chars:
        return text
    if keep == "head":
        return f"{text[:max_chars]}\n[... {len(text) - max_chars} more characters]"
    tail = text[-max_chars:]
    if "\n" in tail[:-1]:
        tail = tail[tail.index("\n") + 1:]
    return f"[... {len(text) - len(tail)} characters before]\n{tail}"


__all__ = ["PythonTool", "Tool", "ToolCall", "ToolReplies", "ToolResult", "Toolbox", "parse_tool_calls",
           "tool_call_text"]
