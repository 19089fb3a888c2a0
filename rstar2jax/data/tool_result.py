"""A tool's result and how it is shown to the model: labelled streams, cut in the middle to a character
budget.

Part of the conversation format (``rstar2jax.data.conversation`` re-exports both names).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one tool call returns, shaped like the sandbox's result (``agent.SandboxResult``) so that every
    tool's outcome is read the same way: ``status`` is the call's
    :data:`~rstar2jax.data.trajectory.ToolOutcome` (``"ok"``, ``"error"``, ``"timeout"``, ...: anything but
    ``"ok"`` counts as a failed call for the RoC tool-error penalty), ``stdout`` what the tool returned,
    ``stderr`` what went wrong, ``error_type`` the failure's kind (an exception's class name, say)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    error_type: str | None = None


def truncate_middle(text: str, max_chars: int) -> str:
    """Keeps the head and the tail of ``text`` within ``max_chars`` characters, marking the cut."""
    if len(text) <= max_chars:
        return text
    omitted = len(text) - max_chars
    while True:  # the marker's length depends on the number it reports; settles in at most two steps
        marker = f"\n...[{omitted} characters truncated]...\n"
        keep = max_chars - len(marker)
        if keep < 2:
            raise ValueError(f"max_chars={max_chars} is too small to hold the truncation marker {marker!r}")
        if len(text) - keep == omitted:
            break
        omitted = len(text) - keep
    head = (keep + 1) // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def format_tool_result(result: Mapping[str, Any] | Any, max_chars: int) -> str:
    """Renders a sandbox result for the model, at most ``max_chars`` characters (head and tail kept).

    ``result`` is the sandbox wire result (a mapping, or an object with the same attributes) with at least
    ``status``, ``stdout`` and ``stderr``. A clean run (status ``ok``, empty stderr) shows stdout as is;
    anything else is labelled so the model can tell the streams and the failure kind apart::

        status: timeout
        stdout:
        ...
        stderr:
        ...
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")

    def field(name: str) -> Any:
        value = result.get(name) if isinstance(result, Mapping) else getattr(result, name, None)
        if value is None and name == "status":
            raise ValueError(f"tool result has no 'status': {result!r}")
        return value or ""

    status, stdout, stderr = str(field("status")), str(field("stdout")), str(field("stderr"))
    if status == "ok" and not stderr:
        text = stdout if stdout else "(no output)"
    else:
        parts = [f"status: {status}"]
        if stdout:
            parts.append(f"stdout:\n{stdout}")
        if stderr:
            parts.append(f"stderr:\n{stderr}")
        text = "\n".join(parts)
    return truncate_middle(text, max_chars)
