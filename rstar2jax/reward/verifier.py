"""Binary answer reward: integer fast path, otherwise math-verify in a small pool of worker processes.

math-verify bounds its own run time with ``signal.alarm``, which only works in a process's main thread;
called from a worker thread or an event loop's executor it raises, and a caller that maps that to reward 0
silently zeroes every reward. Here each comparison runs in a child process with math-verify's timeouts
disabled, and the parent enforces a deadline: a comparison that hangs (sympy on ``9^{9^{9^{9}}}``) scores 0
with a logged reason, and its worker is killed and replaced while the other workers keep serving. A worker
that dies (killed, crashed; the whole pool at once included) is replaced too, and a comparison it was
running is verified again on its replacement: a crash never scores an answer 0 unless the same answer
killed ``crash_retries + 1`` workers in a row.

The blocking core is thread-safe; :meth:`AnswerVerifier.grade` runs it on a private thread pool, so an
asyncio loop never blocks on verification.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import math
import numbers
import os
import pathlib
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import NamedTuple

from rstar2jax.reward.extraction import as_integer, extract_answer_with_reason

logger = logging.getLogger(__name__)

_WORKER_MODULE = "rstar2jax.reward._math_verify_worker"
READY = "ready"  # a worker's first message, once math-verify is imported
_DEFAULT_MEMORY_LIMIT = 2 << 30  # bytes of address space per worker: sympy blow-ups fail fast, not swap
# The directory holding the rstar2jax package, put on the workers' PYTHONPATH in case it is not installed.
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


class RewardError(RuntimeError):
    """A reward function (``reward.fn``) raised or returned no finite number: the run stops, naming it."""


class AnswerGrade(NamedTuple):
    """Outcome of grading one response; unpacks as ``(is_correct, extracted_answer, reason)``."""

    is_correct: bool
    extracted_answer: str | None
    reason: str


class _Worker:
    """One verification process (a fresh interpreter) and the parent's end of its socket."""

    def __init__(self, memory_limit_bytes: int | None):
        parent_socket, child_socket = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        with child_socket:
            command = [
                sys.executable,
                "-m",
                _WORKER_MODULE,
                str(child_socket.fileno()),
                str(memory_limit_bytes or 0),
            ]
            self.process = subprocess.Popen(
                command, pass_fds=(child_socket.fileno(),), stdin=subprocess.DEVNULL, env=env
            )
        self.conn = Connection(parent_socket.detach())
        self.ready = False

    def kill(self, close_connection: bool = True) -> None:
        # Workers hold no state worth a graceful shutdown.
        self.process.kill()
        self.process.wait()
        if close_connection:
            self.conn.close()


def _quick_grade(response_text: str, gold: str) -> tuple[AnswerGrade | None, str | None]:
    """Extraction and the integer fast path; returns (grade, None) when decided, else (None, answer)."""
    answer, reason = extract_answer_with_reason(response_text)
    if answer is None:
        return AnswerGrade(False, None, reason), None
    gold_integer, answer_integer = as_integer(gold), as_integer(answer)
    if gold_integer is not None and answer_integer is not None:
        if gold_integer == answer_integer:
            return AnswerGrade(True, answer, "integer match"), None
        return AnswerGrade(False, answer, f"integer mismatch ({answer_integer} != {gold_integer})"), None
    return None, answer


def _gold_text(gold: str | int) -> str:
    if isinstance(gold, bool) or not isinstance(gold, str | int):
        raise TypeError(f"gold must be a str or int, got {type(gold).__name__}")
    text = str(gold).strip()
    if not text:
        raise ValueError("gold answer is empty")
    return text


class AnswerVerifier:
    """Grades responses against gold answers; safe from any thread and from an asyncio loop.

    Args:
      num_workers: worker processes (default ``min(4, cpu count)``); each holds sympy (~70 MB resident).
      timeout_s: deadline for one math-verify comparison, counted from when a worker takes it.
      start_timeout_s: how long a new worker may take to import math-verify before it counts as failed.
      memory_limit_bytes: address-space limit per worker (``None``: unlimited).
      crash_retries: times a comparison whose worker died under it is verified again on a new worker.

    Workers are fresh interpreters (``python -m rstar2jax.reward._math_verify_worker``) connected by a
    socket pair: never a fork of the (possibly multi-threaded JAX) parent, and unlike multiprocessing's
    spawn/forkserver they never re-import the parent's ``__main__``, so scripts, ``python -`` and notebooks
    all work. POSIX only (file-descriptor passing and ``RLIMIT_AS``).

    Use as a (async) context manager or call :meth:`close`.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        timeout_s: float = 5.0,
        start_timeout_s: float = 120.0,
        memory_limit_bytes: int | None = _DEFAULT_MEMORY_LIMIT,
        crash_retries: int = 2,
    ):
        num_workers = num_workers if num_workers is not None else min(4, os.cpu_count() or 1)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(
                f"timeouts must be positive, got timeout_s={timeout_s}, start_timeout_s={start_timeout_s}"
            )
        if not isinstance(crash_retries, int) or crash_retries < 0:
            raise ValueError(f"crash_retries must be an int >= 0, got {crash_retries!r}")
        if os.name != "posix":
            raise RuntimeError("AnswerVerifier needs a POSIX system (it passes a socket to its workers)")
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.crash_retries = crash_retries
        self._memory_limit_bytes = memory_limit_bytes
        self._lock = threading.Lock()
        self._closed = False
        self._workers: set[_Worker] = set()
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._idle.put(self._spawn())
        self._threads = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="answer-verifier"
        )

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the live workers (for monitoring; they change when a worker is replaced)."""
        with self._lock:
            return tuple(sorted(worker.process.pid for worker in self._workers))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the verifier then grades nothing more)."""
        return self._closed

    def _spawn(self) -> _Worker:
        worker = _Worker(self._memory_limit_bytes)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            closed = self._closed
        self._idle.put(None if closed else self._spawn())

    def _acquire(self) -> _Worker:
        """An idle, started worker; waits while all are busy. Workers found dead are replaced first, so
        a crash that no request caused never costs a request its score."""
        while True:
            worker = self._idle.get()
            if worker is None:
                self._idle.put(None)  # wake the next waiter too
                raise RuntimeError("AnswerVerifier is closed")
            # Dead before serving this request: replace it, unless it failed at start-up with an exit code
            # (a broken installation, reported by _ensure_started) rather than being killed by a signal.
            if worker.process.poll() is not None and (worker.ready or worker.process.returncode < 0):
                logger.warning(
                    "answer-verifier worker exited unexpectedly (code %s); replacing it",
                    worker.process.returncode,
                )
                self._replace(worker)
                continue
            self._ensure_started(worker)
            return worker

    def _ensure_started(self, worker: _Worker) -> None:
        """Waits for a new worker's ready message; a worker that cannot start is an error, not a 0 score."""
        if worker.ready:
            return
        try:
            if worker.conn.poll(self.start_timeout_s):
                worker.ready = worker.conn.recv() == READY
                return
            problem = f"did not start within {self.start_timeout_s} s"
        except (EOFError, OSError):
            problem = f"exited during start-up with code {worker.process.wait()} (its stderr says why)"
        self._replace(worker)
        if self._closed:
            raise RuntimeError("AnswerVerifier is closed")
        raise RuntimeError(f"answer-verifier worker {problem}")

    def _compare_blocking(self, gold: str, answer: str) -> tuple[bool, str]:
        reply, reason = self._ask_blocking((gold, answer), "math-verify", gold, answer)
        return (False, reason) if reply is None else reply

    def _ask_blocking(self, request: tuple, what: str, gold: str, answer: str) -> tuple[object, str | None]:
        """``(a worker's reply to request, None)``, or ``(None, why it scores 0)`` when ``what`` timed out or
        killed its workers ``crash_retries + 1`` times (logged with ``gold`` and ``answer``)."""
        error: BaseException | None = None
        for _ in range(1 + self.crash_retries):
            worker = self._acquire()
            try:
                worker.conn.send(request)
                if not worker.conn.poll(self.timeout_s):
                    self._replace(worker)
                    reason = f"{what} timed out after {self.timeout_s} s"
                    return None, self._scored_zero(reason, gold, answer)[1]
                reply = worker.conn.recv()
            except (EOFError, OSError) as e:
                if self._closed:
                    raise RuntimeError("AnswerVerifier is closed") from e
                logger.warning("answer-verifier worker died during a comparison; replacing it and verifying "
                               "the answer again")
                self._replace(worker)
                error = e
                continue
            self._idle.put(worker)
            return reply, None
        reason = f"verifier workers died {1 + self.crash_retries} times on this answer ({error!r})"
        return None, self._scored_zero(reason, gold, answer)[1]

    @staticmethod
    def _scored_zero(reason: str, gold: str, answer: str) -> tuple[bool, str]:
        logger.warning("answer scored 0: %s; gold=%r answer=%r", reason, gold, answer[:200])
        return False, reason

    def grade_blocking(self, response_text: str, gold: str | int) -> AnswerGrade:
        """Grades ``response_text`` (model-written text only) against ``gold``; blocks the calling thread."""
        gold = _gold_text(gold)
        grade, answer = _quick_grade(response_text, gold)
        if grade is not None:
            return grade
        is_correct, reason = self._compare_blocking(gold, answer)
        return AnswerGrade(is_correct, answer, reason)

    async def grade(self, response_text: str, gold: str | int) -> AnswerGrade:
        """Async :meth:`grade_blocking`: math-verify runs off the event loop."""
        gold = _gold_text(gold)
        grade, answer = _quick_grade(response_text, gold)
        if grade is not None:
            return grade
        loop = asyncio.get_running_loop()
        is_correct, reason = await loop.run_in_executor(self._threads, self._compare_blocking, gold, answer)
        return AnswerGrade(is_correct, answer, reason)

    async def reward(self, function: str, trajectory, problem) -> float:
        """The reward function ``function`` (``"module:function"``, taking ``(trajectory, problem)``: a
        :class:`~rstar2jax.data.trajectory.Trajectory` with the model's ``text`` and the
        :class:`~rstar2jax.data.problems.Problem` row) run in a worker process under :attr:`timeout_s` (past
        it: 0.0, logged), off the event loop. :class:`RewardError` naming ``function`` when it raises or
        returns anything but a finite number."""
        request = ("reward", function, list(sys.path), trajectory, problem)
        loop = asyncio.get_running_loop()
        what, text = f"reward {function}", trajectory.text or ""
        reply, _ = await loop.run_in_executor(self._threads, self._ask_blocking, request, what,
                                              str(problem.answer), text)
        status, value = reply or ("ok", 0.0)
        if status == "raised":
            raise RewardError(f"reward {function} raised {value} (problem {problem.id!r})")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward {function} returned {value!r} for problem {problem.id!r}: a reward "
                              "must be a finite number")
        return float(value)

    async def score(self, response_text: str, gold: str | int) -> bool:
        """The binary reward of ``response_text``: 1 iff its final boxed answer equals ``gold``."""
        return (await self.grade(response_text, gold)).is_correct

    def close(self) -> None:
        """Stops the workers; in-flight and later calls raise ``RuntimeError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            self._workers.clear()
        for worker in workers:
            # A thread may be waiting on this connection: let it see end-of-file rather than closing the
            # descriptor under it (the connection closes when the worker is garbage-collected).
            worker.kill(close_connection=False)
            self._idle.put(None)
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> AnswerVerifier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    async def __aenter__(self) -> AnswerVerifier:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)


# The process-wide verifier behind grade_answer / score_answer: started on first use, replaced by a fresh one
# when it was closed (a second run in the same process), stopped at exit.
_default_verifier: AnswerVerifier | None = None
_default_verifier_lock = threading.Lock()


def default_verifier() -> AnswerVerifier:
    """The process-wide verifier behind :func:`grade_answer` / :func:`score_answer`: started on first use,
    and started again on the next use after it was closed (:func:`close_default_verifier` or its own
    ``close()``)."""
    global _default_verifier
    with _default_verifier_lock:
        if _default_verifier is None or _default_verifier.closed:
            _default_verifier = AnswerVerifier()
        return _default_verifier


def close_default_verifier() -> None:
    """Stops the default verifier's workers, if it was started (also run at exit); the next use starts a
    fresh one."""
    global _default_verifier
    with _default_verifier_lock:
        verifier, _default_verifier = _default_verifier, None
    if verifier is not None:
        verifier.close()


atexit.register(close_default_verifier)


def grade_answer(response_text: str, gold: str | int) -> AnswerGrade:
    """``(is_correct, extracted_answer, reason)`` for logging; see :class:`AnswerVerifier`."""
    return default_verifier().grade_blocking(response_text, gold)


def score_answer(response_text: str, gold: str | int) -> bool:
    """Binary reward: whether the last ``\\boxed{}`` of the final ``<answer>`` block equals ``gold``."""
    return grade_answer(response_text, gold).is_correct
