"""The sandbox wire schema: paths, field names, status values and validation.

Dependency-free (standard library only) so that clients — ``rstar2jax.agent.sandbox_client`` among them —
can import it without pulling in the server.

Request (``POST /run``, or each element of ``{"requests": [...]}`` on ``POST /run/batch``)::

    {"code": str, "stdin": str = "", "timeout": float = server default, "session": str | null = null,
     "session_token": str | null = null}

Sessions are opened with ``POST /sessions`` (no body), answered ``{"session": id, "token": token}``; every
call in the session names ``session`` and presents its ``session_token``, and ``DELETE /sessions/{id}`` the
``X-Session-Token`` header. An unknown id or a wrong or missing token is answered ``invalid_request`` with
``error_type`` ``SessionNotFound`` (``/run``: HTTP 404), the same either way, and does not touch the
session. A call with the right token to a session that was closed or expired is answered
``killed`` with ``error_type`` ``SessionClosed`` and the reason in ``stderr``.

Result (the ``/run`` body, or each element of ``{"results": [...]}``, in request order)::

    {"status": one of STATUSES, "stdout": str, "stderr": str, "exit_code": int | null,
     "error_type": str | null, "duration": float}

Status meanings:
    ok              ran to completion without an uncaught exception (``sys.exit(0)`` included)
    error           uncaught exception (``error_type`` names it, ``stderr`` holds the traceback),
                    a non-zero exit code, or a syntax error
    timeout         wall-clock timeout or CPU-time limit reached; the whole process tree was killed
    memory_limit    uncaught ``MemoryError`` under the address-space limit, or killed by the memory cgroup
    output_limit    stdout + stderr exceeded the output kill limit; the process tree was killed
    killed          ended by a signal (segfault, ...), its worker died, or its session was closed
    invalid_request the request did not validate (``stderr`` says why); nothing ran
    internal        the service could not run it (``stderr`` says why); safe to retry
"""

from __future__ import annotations

import math
from typing import Any

PATH_RUN = "/run"
PATH_BATCH = "/run/batch"
PATH_HEALTH = "/health"
PATH_METRICS = "/metrics"
PATH_SESSIONS = "/sessions"  # POST /sessions opens a session, DELETE /sessions/{id} closes one
SESSION_TOKEN_HEADER = "X-Session-Token"
SESSION_KEY = "session"
SESSION_TOKEN_KEY = "token"

CONTENT_TYPE_JSON = "application/json"
CONTENT_TYPE_MSGPACK = "application/msgpack"

STATUSES = ("ok", "error", "timeout", "memory_limit", "output_limit", "killed", "invalid_request", "internal")
REQUEST_FIELDS = ("code", "stdin", "timeout", "session", "session_token")
RESULT_FIELDS = ("status", "stdout", "stderr", "exit_code", "error_type", "duration")
BATCH_REQUESTS_KEY = "requests"
BATCH_RESULTS_KEY = "results"

MAX_SESSION_ID_CHARS = 128
SESSION_NOT_FOUND = "SessionNotFound"  # error_type: unknown session id, or a wrong or missing token
SESSION_CLOSED = "SessionClosed"  # error_type: the session was closed or expired (told to its owner only)


class SchemaError(ValueError):
    """A request or result does not follow the wire schema; the message names the offending field."""


def validate_run_request(
    obj: Any,
    *,
    default_timeout: float,
    max_timeout: float,
    max_code_chars: int,
    max_stdin_chars: int,
) -> dict:
    """Check one run request and return it normalised (all four fields present, timeout a float).

    Raises ``SchemaError`` naming the first problem found.
    """
    if not isinstance(obj, dict):
        raise SchemaError(f"a run request must be an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(REQUEST_FIELDS))
    if unknown:
        raise SchemaError(f"unknown request field(s) {unknown}; allowed: {list(REQUEST_FIELDS)}")
    code = obj.get("code")
    if not isinstance(code, str):
        raise SchemaError(f"'code' must be a string, got {type(code).__name__}")
    if len(code) > max_code_chars:
        raise SchemaError(f"'code' has {len(code)} characters; the limit is {max_code_chars}")
    stdin = obj.get("stdin", "")
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        raise SchemaError(f"'stdin' must be a string, got {type(stdin).__name__}")
    if len(stdin) > max_stdin_chars:
        raise SchemaError(f"'stdin' has {len(stdin)} characters; the limit is {max_stdin_chars}")
    timeout = obj.get("timeout")
    if timeout is None:
        timeout = default_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise SchemaError(f"'timeout' must be a number of seconds, got {type(timeout).__name__}")
    if not _finite(timeout) or timeout <= 0 or timeout > max_timeout:
        raise SchemaError(f"'timeout' must be in (0, {max_timeout}] seconds, got {timeout}")
    session, token = obj.get("session"), obj.get("session_token")
    for name, value in (("session", session), ("session_token", token)):
        if value is not None:
            if not isinstance(value, str) or not value:
                raise SchemaError(f"{name!r} must be a non-empty string or null")
            if len(value) > MAX_SESSION_ID_CHARS:
                raise SchemaError(f"{name!r} longer than {MAX_SESSION_ID_CHARS} characters")
    if token is not None and session is None:
        raise SchemaError("'session_token' given without a 'session'")
    return {
        "code": code,
        "stdin": stdin,
        "timeout": float(timeout),
        "session": session,
        "session_token": token,
    }


def _finite(number: int | float) -> bool:
    """Whether ``number`` is finite; a JSON integer too large for a float is not (no OverflowError)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


def validate_batch_request(obj: Any, *, max_batch: int) -> list:
    """Check the batch envelope and return the raw list of requests (validated one by one later)."""
    if not isinstance(obj, dict) or BATCH_REQUESTS_KEY not in obj:
        raise SchemaError(f"a batch must be an object with a {BATCH_REQUESTS_KEY!r} list")
    requests = obj[BATCH_REQUESTS_KEY]
    if not isinstance(requests, list):
        raise SchemaError(f"{BATCH_REQUESTS_KEY!r} must be a list, got {type(requests).__name__}")
    if len(requests) > max_batch:
        raise SchemaError(f"batch of {len(requests)} requests; the limit is {max_batch}")
    return requests


def make_result(
    status: str,
    stdout: str = "",
    stderr: str = "",
    exit_code: int | None = None,
    error_type: str | None = None,
    duration: float = 0.0,
) -> dict:
    """Build a result object; raises ``SchemaError`` on an unknown status."""
    if status not in STATUSES:
        raise SchemaError(f"unknown status {status!r}; expected one of {STATUSES}")
    return {
        "status": status,
        "stdout": stdout,
        "stderr": stderr,
        "exit_code": exit_code,
        "error_type": error_type,
        "duration": float(duration),
    }


def validate_run_result(obj: Any) -> dict:
    """Check a result received over the wire; returns it restricted to ``RESULT_FIELDS``."""
    if not isinstance(obj, dict):
        raise SchemaError(f"a result must be an object, got {type(obj).__name__}")
    missing = [name for name in RESULT_FIELDS if name not in obj]
    if missing:
        raise SchemaError(f"result lacks field(s) {missing}")
    if obj["status"] not in STATUSES:
        raise SchemaError(f"unknown status {obj['status']!r}")
    for name in ("stdout", "stderr"):
        if not isinstance(obj[name], str):
            raise SchemaError(f"result field {name!r} must be a string")
    exit_code = obj["exit_code"]
    if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
        raise SchemaError("result field 'exit_code' must be an integer or null")
    if obj["error_type"] is not None and not isinstance(obj["error_type"], str):
        raise SchemaError("result field 'error_type' must be a string or null")
    if isinstance(obj["duration"], bool) or not isinstance(obj["duration"], (int, float)):
        raise SchemaError("result field 'duration' must be a number")
    return {name: obj[name] for name in RESULT_FIELDS}
