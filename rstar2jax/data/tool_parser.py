"""Parses Hermes tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Every ``<tool_call>`` block becomes either a :class:`ToolCall` ready for the sandbox or a
:class:`ToolCallError` whose ``message`` is shown to the model as the tool response (rStar2-Agent feeds
parse failures back instead of dropping them). The body must be one JSON value; nothing is guessed from
broken JSON.

:func:`parse_function_call` reads any tool's call (name and JSON arguments); each tool then checks its own
arguments (``rstar2jax.agent.tools.parse_calls``: the Python tool with :func:`python_arguments_error`, a
function tool against its schema). :func:`parse_tool_call` is the Python tool's parse in one step.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from typing import Any

from rstar2jax.data.conversation import PYTHON_TOOL_NAME

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_CALL_SHAPE = '{"name": "<tool name>", "arguments": {"code": "<python code>", "input": "<stdin text>"}}'
_ARGUMENT_NAMES = ("code", "input")


class ToolCallErrorKind(enum.StrEnum):
    """Why a tool call could not be run."""

    MALFORMED_JSON = "malformed_json"  # the body is not valid JSON
    BAD_STRUCTURE = "bad_structure"  # valid JSON but not {"name": ..., "arguments": ...}
    UNKNOWN_TOOL = "unknown_tool"  # "name" is not a configured tool
    BAD_ARGUMENTS = "bad_arguments"  # "arguments" missing keys, wrong types, unexpected keys
    UNTERMINATED = "unterminated"  # <tool_call> without its </tool_call>
    UNOPENED = "unopened"  # </tool_call> without a preceding <tool_call>


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call of the Python tool."""

    name: str
    code: str
    input: str = ""


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call that cannot be run; ``message`` is the tool response the model sees."""

    kind: ToolCallErrorKind
    message: str


def _error(kind: ToolCallErrorKind, detail: str) -> ToolCallError:
    return ToolCallError(kind, f"Error: invalid tool call: {detail}")


def _loads(text: str, what: str, kind: ToolCallErrorKind) -> Any | ToolCallError:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        hint = " (write newlines inside JSON strings as \\n)" if "control character" in e.msg else ""
        return _error(kind, f"{what} is not valid JSON: {e}{hint}. Expected {_CALL_SHAPE}")


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    """A well-formed call of any listed function tool: its name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any]


def parse_function_call(body: str, *, tool_names: Sequence[str]) -> FunctionCall | ToolCallError:
    """Parses the text between ``<tool_call>`` and ``</tool_call>`` as ``{"name": ..., "arguments": {...}}``
    naming one of ``tool_names``; the arguments themselves are not checked (the OpenAI-compatible server
    hands them to the client as they are).

    ``arguments`` may be a JSON object or a JSON string that holds one (both occur in the wild).
    """
    call = _loads(body.strip(), "the tool call", ToolCallErrorKind.MALFORMED_JSON)
    if isinstance(call, ToolCallError):
        return call
    if not isinstance(call, dict):
        return _error(
            ToolCallErrorKind.BAD_STRUCTURE, f"expected a JSON object {_CALL_SHAPE}, got {body.strip()!r}"
        )
    unexpected = sorted(set(call) - {"name", "arguments"})
    if unexpected:
        return _error(
            ToolCallErrorKind.BAD_STRUCTURE, f"unexpected key(s) {unexpected}; expected {_CALL_SHAPE}"
        )
    if "name" not in call or not isinstance(call["name"], str):
        return _error(ToolCallErrorKind.BAD_STRUCTURE, f"missing string 'name'; expected {_CALL_SHAPE}")
    name = call["name"]
    if name not in tool_names:
        return _error(
            ToolCallErrorKind.UNKNOWN_TOOL, f"unknown tool {name!r}; available tools: {list(tool_names)}"
        )
    if "arguments" not in call:
        return _error(ToolCallErrorKind.BAD_STRUCTURE, f"missing 'arguments'; expected {_CALL_SHAPE}")
    arguments = call["arguments"]
    if isinstance(arguments, str):
        arguments = _loads(arguments, "the 'arguments' string", ToolCallErrorKind.BAD_ARGUMENTS)
        if isinstance(arguments, ToolCallError):
            return arguments
    if not isinstance(arguments, dict):
        return _error(
            ToolCallErrorKind.BAD_ARGUMENTS, f"'arguments' must be a JSON object, got {arguments!r}"
        )
    return FunctionCall(name=name, arguments=arguments)


def python_arguments_error(name: str, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` cannot be a call of the Python tool ``name`` (None: they can): a string ``code``
    and optionally a string ``input`` (standard input, default ''), nothing else."""
    unexpected = sorted(set(arguments) - set(_ARGUMENT_NAMES))
    if unexpected:
        return f"unexpected argument(s) {unexpected}; {name} takes 'code' and optionally 'input'"
    code, stdin = arguments.get("code"), arguments.get("input", "")
    if not isinstance(code, str) or not code.strip():
        return f"'code' must be a non-empty string, got {code!r}"
    if not isinstance(stdin, str):
        return f"'input' must be a string, got {stdin!r}"
    return None


def bad_arguments(detail: str) -> ToolCallError:
    """The ``BAD_ARGUMENTS`` error the model sees for a call whose arguments its tool refuses."""
    return _error(ToolCallErrorKind.BAD_ARGUMENTS, detail)


def parse_tool_call(
    body: str, *, tool_names: Sequence[str] = (PYTHON_TOOL_NAME,)
) -> ToolCall | ToolCallError:
    """Parses the text between ``<tool_call>`` and ``</tool_call>`` as a call of the Python tool.

    The call must pass :func:`parse_function_call`; its arguments must pass :func:`python_arguments_error`.
    """
    call = parse_function_call(body, tool_names=tool_names)
    if isinstance(call, ToolCallError):
        return call
    return as_python_call(call)


def as_python_call(call: FunctionCall) -> ToolCall | ToolCallError:
    """``call`` as a call of the Python tool, or the error its arguments give."""
    problem = python_arguments_error(call.name, call.arguments)
    if problem is not None:
        return bad_arguments(problem)
    return ToolCall(name=call.name, code=call.arguments["code"], input=call.arguments.get("input", ""))


def tool_call_bodies(text: str) -> list[str | ToolCallError]:
    """The body of every ``<tool_call>…</tool_call>`` block of an assistant turn, in order.

    A ``<tool_call>`` that is opened again or never closed yields an ``UNTERMINATED`` error, a
    ``</tool_call>`` with no open block an ``UNOPENED`` error; text outside blocks is ignored.
    """
    results: list[str | ToolCallError] = []
    position = 0
    while True:
        open_at = text.find(TOOL_CALL_OPEN, position)
        close_at = text.find(TOOL_CALL_CLOSE, position)
        if close_at != -1 and (open_at == -1 or close_at < open_at):
            results.append(
                _error(ToolCallErrorKind.UNOPENED, f"{TOOL_CALL_CLOSE} without a {TOOL_CALL_OPEN}")
            )
            position = close_at + len(TOOL_CALL_CLOSE)
            continue
        if open_at == -1:
            return results
        body_at = open_at + len(TOOL_CALL_OPEN)
        reopen_at = text.find(TOOL_CALL_OPEN, body_at)
        if close_at == -1 or (reopen_at != -1 and reopen_at < close_at):
            results.append(
                _error(
                    ToolCallErrorKind.UNTERMINATED, f"{TOOL_CALL_OPEN} is never closed by {TOOL_CALL_CLOSE}"
                )
            )
            if reopen_at == -1:
                return results
            position = reopen_at
            continue
        results.append(text[body_at:close_at])
        position = close_at + len(TOOL_CALL_CLOSE)


def parse_tool_calls(
    text: str, *, tool_names: Sequence[str] = (PYTHON_TOOL_NAME,)
) -> list[ToolCall | ToolCallError]:
    """Parses every ``<tool_call>…</tool_call>`` block of an assistant turn as a Python-tool call, in order
    (block errors as in :func:`tool_call_bodies`)."""
    return [
        parse_tool_call(body, tool_names=tool_names) if isinstance(body, str) else body
        for body in tool_call_bodies(text)
    ]


def parse_function_calls(text: str, *, tool_names: Sequence[str]) -> list[FunctionCall | ToolCallError]:
    """Parses every ``<tool_call>…</tool_call>`` block of an assistant turn as a function-tool call."""
    return [
        parse_function_call(body, tool_names=tool_names) if isinstance(body, str) else body
        for body in tool_call_bodies(text)
    ]
