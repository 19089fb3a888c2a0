"""The OpenAI chat-completions wire format: request validation and the error object.

:func:`parse_chat_request` turns a decoded JSON body into a :class:`ChatRequest` or raises
:class:`RequestError`, which the server answers with HTTP 400 and OpenAI's error object
``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``. Fields this server does not
implement are rejected when they would change the output (``tool_choice`` "required", a non-zero
``presence_penalty``...), and ignored when they would not (``user``, ``metadata``...).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
#: Most stop strings per request (as OpenAI).
MAX_STOPS = 4
#: Largest ``top_logprobs`` (as OpenAI).
MAX_TOP_LOGPROBS = 20


class RequestError(Exception):
    """A request the server does not carry out: answered with ``status`` (400: a client mistake; 429, 503:
    the server's state), OpenAI's error object and ``headers`` (``Retry-After``)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body.

    ``messages`` are normalised for the chat template (text parts joined, assistant ``tool_calls`` with
    their ``function.arguments`` as given). ``max_tokens`` is None when the client set no limit (the rest
    of the context is the limit). ``tools`` is None when the request lists none or ``tool_choice`` is
    ``"none"`` with no tools; ``parse_tools`` says whether tool calls are parsed from the output.
    """

    model: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    temperature: float
    top_p: float
    max_tokens: int | None
    n: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools or ())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, null, or a list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': ...}}; "
                    "this model reads text only",
                    param=f"{where}.content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(
        f"{where}.content must be a string, null or a list of text parts", param=f"{where}.content"
    )


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"{at} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=at
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                json.loads(arguments)
            except json.JSONDecodeError as e:
                raise RequestError(f"{at}.function.arguments is not valid JSON: {e}", param=at) from e
        elif not isinstance(arguments, Mapping):
            raise RequestError(f"{at}.function.arguments must be a JSON string", param=at)
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list of messages", param="messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise RequestError(f"{where} must be an object with 'role' and 'content'", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role {role!r} is not one of {list(ROLES)}", param=f"{where}.role")
        out: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(message.get("content"), where),
        }
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = _tool_calls(message["tool_calls"], where)
        elif role == "assistant" and message.get("content") is None:
            raise RequestError(f"{where}: an assistant message needs 'content' or 'tool_calls'", param=where)
        if role == "tool" and message.get("tool_call_id") is not None:
            out["tool_call_id"] = str(message["tool_call_id"])
        messages.append(out)
    return messages


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise RequestError("'tools' must be a list of function tools", param="tools")
    tools, names = [], set()
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "function") != "function"
            or not isinstance(function, Mapping)
        ):
            raise RequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param=f"tools[{i}]"
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", param=f"tools[{i}]")
        if name in names:
            raise RequestError(f"tools lists the function {name!r} twice", param="tools")
        names.add(name)
        tools.append({"type": "function", "function": dict(function)})
    return tools or None


def _optional_int(body: Mapping, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


def _number(
    body: Mapping, name: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or value > high or value < low or (open_low and value == low):
        interval = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise RequestError(f"'{name}' must be a number in {interval}, got {value!r}", param=name)
    return float(value)


def parse_chat_request(body: Any, *, max_n: int) -> ChatRequest:
    """Validates a chat-completions body (already JSON-decoded). ``max_n``: the most choices one request
    may ask for (the engine's slots). Raises :class:`RequestError` naming the offending field."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise RequestError(
            f"tool_choice {tool_choice!r} is not supported; use 'auto' or 'none'", param="tool_choice"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(f"'{name}' is not supported (only 0)", param=name)
    if body.get("logit_bias"):
        raise RequestError("'logit_bias' is not supported", param="logit_bias")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise RequestError("'response_format' other than text is not supported", param="response_format")
    max_tokens = _optional_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens", 1)
    n = _optional_int(body, "n", 1, max_n)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stop = tuple(stop)
    else:
        raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    if any(not s for s in stop):
        raise RequestError("'stop' strings must not be empty", param="stop")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, Mapping)):
        raise RequestError(
            "'stream_options' is allowed only with stream=true, as an object", param="stream_options"
        )
    include_usage = bool((options or {}).get("include_usage", False))
    logprobs = body.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise RequestError("'logprobs' must be a boolean", param="logprobs")
    top_logprobs = _optional_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top_logprobs and not logprobs:
        raise RequestError("'top_logprobs' needs logprobs=true", param="top_logprobs")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        parse_tools=tools is not None and tool_choice != "none",
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        max_tokens=max_tokens,
        n=n or 1,
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
