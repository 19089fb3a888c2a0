"""A math-verify worker process: ``python -m rstar2jax.reward._math_verify_worker FD MEMORY_LIMIT``.

Started by :class:`rstar2jax.reward.AnswerVerifier` as a fresh interpreter (never a fork of a possibly
threaded JAX parent, never a re-import of the parent's ``__main__``). It talks over the socket ``FD`` with
``multiprocessing.connection`` messages: it sends ``"ready"`` once math-verify is imported, then answers each
``(gold, answer)`` request with ``(is_correct, reason)``, and each ``("reward", "module:function",
search_path, trajectory, problem)`` request with ``("ok", value)`` or ``("raised", "ExceptionType: message")``
(a reward function of the user's, :meth:`~rstar2jax.reward.AnswerVerifier.reward`), until it receives ``None``
or the socket closes. math-verify's own signal-based timeouts are disabled; the parent enforces the deadline
by killing this process.
"""

from __future__ import annotations

import functools
import importlib
import logging
import signal
import sys
from multiprocessing.connection import Connection

from rstar2jax.reward.verifier import READY


@functools.lru_cache(maxsize=4096)
def _parse_boxed(answer: str):
    from math_verify import parse

    return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


def compare(gold: str, answer: str) -> tuple[bool, str]:
    """math-verify with the gold first, both wrapped in ``\\boxed{}``; ``(is_correct, reason)``."""
    from math_verify import verify

    gold_parsed = _parse_boxed(gold)
    if not gold_parsed:
        return False, f"math-verify could not parse the gold answer {gold!r}"
    answer_parsed = _parse_boxed(answer)
    if not answer_parsed:
        return False, "math-verify could not parse the answer"
    if verify(gold_parsed, answer_parsed, timeout_seconds=None):
        return True, "math-verify: equivalent"
    return False, "math-verify: not equivalent"


@functools.lru_cache(maxsize=64)
def _function(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def call_reward(spec: str, search_path: list[str], trajectory, problem) -> tuple[str, object]:
    """``("ok", value)`` of the reward function ``spec`` on ``(trajectory, problem)``, or ``("raised",
    message)``; ``search_path``: the parent's ``sys.path``, where the function's module is found."""
    sys.path.extend(p for p in search_path if p not in sys.path)
    try:
        return "ok", _function(spec)(trajectory, problem)
    except Exception as e:  # noqa: BLE001  (the parent stops the run, naming the function and this)
        return "raised", f"{type(e).__name__}: {e}"


def serve(conn: Connection, memory_limit_bytes: int | None) -> None:
    """Answers requests on ``conn`` until ``None`` or end of file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the parent's terminal must not kill workers
    if memory_limit_bytes:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    # Timeouts are disabled on purpose (the parent's deadline replaces them); silence the reminder.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (imported before "ready" so start-up does not eat the first deadline)

    conn.send(READY)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is gone
            return
        if request is None:
            return
        try:
            reply = call_reward(*request[1:]) if request[0] == "reward" else compare(*request)
        except MemoryError:
            reply = (False, f"math-verify exceeded the worker memory limit of {memory_limit_bytes} bytes")
        except Exception as e:  # noqa: BLE001  (any math-verify/sympy failure scores 0 with its reason)
            reply = (False, f"math-verify raised {type(e).__name__}: {e}")
        conn.send(reply)


if __name__ == "__main__":
    fd, memory_limit = (int(arg) for arg in sys.argv[1:3])
    serve(Connection(fd), memory_limit or None)
