"""Tools as plug-ins: what a rollout needs of a tool (:class:`Tool`), the Python sandbox as one
(:class:`PythonTool`), any Python function as another (:class:`FunctionTool`), and tools named in a run config
(``"python"``, a registered name or ``module:function``, :func:`load_tools`).

A tool has a name, an OpenAI function schema (what the prompt lists), a check of a call's parsed JSON
arguments (its error is fed back to the model as the tool response, outcome ``parse_error``) and an async
``call`` that returns a result with a ``status`` (a :data:`~rstar2jax.data.trajectory.ToolOutcome`: anything
but ``"ok"`` counts as a failed call for the RoC tool-error penalty), ``stdout``, ``stderr`` and
``error_type`` (:class:`~rstar2jax.data.tool_result.ToolResult`). A function tool that raises is an
``"error"`` with the exception's class and message as stderr; one that runs past the rollout's
``tool_timeout`` a ``"timeout"``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rstar2jax.data.conversation import PromptConfig, python_tool_schema
from rstar2jax.data.tool_parser import (
    FunctionCall,
    ToolCallError,
    bad_arguments,
    parse_function_calls,
    python_arguments_error,
)
from rstar2jax.data.tool_result import ToolResult

#: The run config's name of the Python sandbox tool (``rollout.tools``).
PYTHON = "python"


@runtime_checkable
class Tool(Protocol):
    """What a rollout needs of a tool."""

    name: str
    schema: Mapping[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        """Why the model's ``arguments`` cannot be run (shown to the model), or None."""

    async def call(self, arguments: Mapping[str, Any], *, timeout: float, session: str | None = None) -> Any:
        """The result of a checked call (``status``, ``stdout``, ``stderr``, ``error_type``); never raises
        for the call's own failures. ``session``: the trajectory's sandbox session, for a stateful tool."""


@dataclasses.dataclass(frozen=True)
class PythonTool:
    """The paper's code tool: ``code`` run in the sandbox with ``input`` as standard input."""

    sandbox: Any  # an agent.ToolSandbox (a SandboxClient)
    schema: Mapping[str, Any] = dataclasses.field(default_factory=python_tool_schema)

    @property
    def name(self) -> str:
        return _schema_name(self.schema)

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        return python_arguments_error(self.name, arguments)

    async def call(self, arguments: Mapping[str, Any], *, timeout: float, session: str | None = None) -> Any:
        extra = {} if session is None else {"session": session}
        return await self.sandbox.run(arguments["code"], stdin=arguments.get("input", ""), timeout=timeout,
                                      **extra)


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def _fits(value: Any, spec: Mapping[str, Any]) -> bool:
    """Whether ``value`` has the JSON type of a parameter's schema (a bool is no number)."""
    if value is None and spec.get("nullable"):
        return True
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(kind in _JSON_TYPES and isinstance(value, _JSON_TYPES[kind])
               and not (kind in ("integer", "number") and isinstance(value, bool)) for kind in kinds)


def schema_arguments_error(schema: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit a function schema's parameters (names, required ones, JSON types and
    ``enum`` values), or None."""
    function = schema.get("function", schema)
    name, parameters = function["name"], function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    unexpected = sorted(set(arguments) - set(properties))
    if unexpected:
        return f"unexpected argument(s) {unexpected}; {name} takes {sorted(properties)}"
    missing = [key for key in parameters.get("required", ()) if key not in arguments]
    if missing:
        return f"missing argument(s) {missing} of {name}"
    for key, value in arguments.items():
        spec = properties[key]
        if not _fits(value, spec):
            return f"'{key}' must be of JSON type {spec['type']}, got {value!r}"
        if "enum" in spec and value not in spec["enum"]:
            return f"'{key}' must be one of {spec['enum']}, got {value!r}"
    return None


def _in_daemon_thread(fn: Callable, arguments: Mapping[str, Any]) -> asyncio.Future:
    """``fn(**arguments)`` on its own daemon thread, as a future of the running loop: the loop is never
    blocked, and a call that hangs past its timeout holds neither the loop nor the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, error):
        if not future.done():  # a timed-out call's future was cancelled
            future.set_exception(error) if error is not None else future.set_result(value)

    def work():
        try:
            value, error = fn(**arguments), None
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine as is)
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the call ran: nobody waits for it
            pass

    threading.Thread(target=work, name="rstar2jax-tool", daemon=True).start()
    return future


def _as_text(value: Any) -> str:
    """A function tool's return value as the model sees it: a string as is, else JSON (else ``str``)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class FunctionTool:
    """A plain Python function as a tool (like TRL's ``tools=[fn]``): its schema from its signature and
    Google-style docstring (``transformers.utils.get_json_schema``: a summary line and an ``Args:`` entry per
    parameter, type hints on all), its arguments checked against that schema, its return value shown to the
    model (a string as is, anything else as JSON). An ``async def`` function runs on the rollout's loop, a
    plain one on its own thread; either is given the rollout's ``tool_timeout``."""

    def __init__(self, fn: Callable, *, name: str | None = None, schema: Mapping[str, Any] | None = None):
        if not callable(fn):
            raise TypeError(f"a function tool needs a callable, got {type(fn).__name__}")
        if schema is None:
            from transformers.utils import get_json_schema  # noqa: PLC0415  (transformers: on first use)

            try:
                schema = get_json_schema(fn)
            except Exception as error:  # noqa: BLE001  (its own exception types vary across versions)
                raise ValueError(f"tool {getattr(fn, '__qualname__', fn)!r}: no schema from its signature "
                                 f"and docstring: {error}") from None
        if name is not None:
            schema = {**schema, "function": {**schema["function"], "name": name}}
        self.fn, self.schema, self.name = fn, schema, _schema_name(schema)
        self.is_async = inspect.iscoroutinefunction(fn)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"

    def check(self, arguments: Mapping[str, Any]) -> str | None:
        return schema_arguments_error(self.schema, arguments)

    async def call(self, arguments: Mapping[str, Any], *, timeout: float, session: str | None = None) -> Any:
        running = self.fn(**arguments) if self.is_async else _in_daemon_thread(self.fn, arguments)
        try:
            value = await asyncio.wait_for(running, timeout)
        except TimeoutError:
            return ToolResult("timeout", stderr=f"{self.name} did not return within {timeout:g} s",
                              error_type="Timeout")
        except Exception as error:  # noqa: BLE001  (the tool's failure is the model's to read)
            kind = type(error).__name__
            return ToolResult("error", stderr=f"{kind}: {error}", error_type=kind)
        return ToolResult("ok", stdout=_as_text(value))


def _schema_name(schema: Mapping[str, Any]) -> str:
    return schema.get("function", schema)["name"]


def as_tool(tool: Any) -> Tool:
    """``tool`` if it is a :class:`Tool`, else a plain function as a :class:`FunctionTool`."""
    if isinstance(tool, Tool):
        return tool
    if callable(tool):
        return FunctionTool(tool)
    raise TypeError(f"a tool must be a Tool or a function, got {type(tool).__name__}")


#: Function tools by name (``register_tool``): what a run config's ``rollout.tools`` may name.
TOOLS: dict[str, Callable] = {}


def register_tool(name: str | None = None):
    """Registers a function (or a :class:`Tool`) under ``name`` (default: the function's name), so that a run
    config can list it in ``rollout.tools``; returns it unchanged."""

    def register(tool):
        key = name or getattr(tool, "name", None) or tool.__name__
        if key == PYTHON or key in TOOLS:
            raise ValueError(f"a tool named {key!r} is already registered")
        TOOLS[key] = tool
        return tool

    return register


def load_tool(spec: str) -> Tool:
    """The tool a run config names: a registered name (:data:`TOOLS`) or ``module:attribute`` (a function or
    a :class:`Tool`, imported); ValueError naming ``spec`` otherwise."""
    if spec in TOOLS:
        return as_tool(TOOLS[spec])
    module, _, attribute = spec.partition(":")
    if not (module and attribute):
        raise ValueError(f"tool {spec!r}: not '{PYTHON}', a registered tool {sorted(TOOLS)} or "
                         "'module:function'")
    try:
        target = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"tool {spec!r}: {error}") from None
    return as_tool(target)


def load_tools(specs: Sequence[str], sandbox: Any, prompt: PromptConfig) -> tuple[list[Tool], PromptConfig]:
    """The tools a run config lists (``rollout.tools``) and the prompt that lists their schemas.

    ``"python"`` is the sandbox's Python tool under each name ``prompt`` gives it (the paper's when it gives
    none); every other entry is :func:`load_tool`'s. The prompt's tools become exactly these, Python first.
    """
    functions = [load_tool(spec) for spec in specs if spec != PYTHON]
    taken = {tool.name for tool in functions}
    python = []
    if PYTHON in specs:
        schemas = [s for s in prompt.tools if _schema_name(s) not in taken] or [python_tool_schema()]
        python = [PythonTool(sandbox, schema) for schema in schemas]
    tools = python + functions
    return tools, dataclasses.replace(prompt, tools=tuple(dict(tool.schema) for tool in tools))


def rollout_tools(prompt: PromptConfig, sandbox: Any, tools: Sequence[Any] | None = None) -> dict[str, Tool]:
    """The tools of a rollout by name: ``tools`` (each :func:`as_tool`), or None: the sandbox's Python tool
    under every name the prompt lists (the paper's set-up). ValueError for two tools of one name, or a
    prompt that lists a tool none of them is."""
    if tools is None:
        tools = [PythonTool(sandbox, schema) for schema in prompt.tools]
    by_name: dict[str, Tool] = {}
    for tool in map(as_tool, tools):
        if tool.name in by_name:
            raise ValueError(f"two tools are named {tool.name!r}")
        by_name[tool.name] = tool
    if unserved := [name for name in prompt.tool_names if name not in by_name]:
        raise ValueError(f"the prompt lists tool(s) {unserved} that no tool given implements "
                         f"(tools: {sorted(by_name)})")
    return by_name


def parse_calls(text: str, tools: Mapping[str, Tool]) -> list[FunctionCall | ToolCallError]:
    """Every ``<tool_call>`` block of an assistant turn, in order: a call of one of ``tools`` whose
    arguments it accepts, or the error the model is shown."""
    calls = parse_function_calls(text, tool_names=tuple(tools))
    checked = []
    for call in calls:
        problem = None if isinstance(call, ToolCallError) else tools[call.name].check(call.arguments)
        checked.append(call if problem is None else bad_arguments(problem))
    return checked
