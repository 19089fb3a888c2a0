"""Runs user code inside a forked, already isolated child: notebook semantics and the outcome record.

The child's file descriptors are fixed: 0 = stdin (a memfd, or the worker's /dev/null when it is empty),
1/2 = stdout/stderr pipes to the worker, ``RECORD_FD`` = a pipe for the outcome record, and for sessions
``CONTROL_FD`` = requests from the worker. The record is JSON
``{"id", "status", "error_type", "exit_code", "exec_start", "exec_end"}``. The code runs in the same process
and could write its own record, but that only changes its own result: it has no descriptor that reaches any
other call.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import linecache
import marshal
import os
import struct
import sys
import time
import traceback

RECORD_FD = 3
CONTROL_FD = 4
CELL_FILENAME = "<cell>"
_FRAME_HEADER = struct.Struct("!I")


# The interpreter's own streams, kept referenced: a forked call that freed them would touch (and copy)
# every page their teardown reaches.
_ORIGINAL_STDIO = (sys.stdin, sys.stdout, sys.stderr)


def make_stdio() -> tuple:
    """Text streams for fds 0/1/2: UTF-8 stdin, line-buffered UTF-8 stdout/stderr (not yet installed).

    A warm worker builds one set before it forks anything and every one-shot call installs its own pristine
    copy: building them in the call would cost it ~70 copy-on-write faults (~0.2 ms). The streams cache
    whether their descriptor is seekable, so they are built with pipes on fds 1 and 2, as a call has them.
    """
    saved = [os.dup(fd) for fd in (1, 2)]
    read_end, write_end = os.pipe()
    try:
        for fd in (1, 2):
            os.dup2(write_end, fd)
        stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        # Line buffering keeps partial output when a call is killed mid-way (timeout, output limit).
        stdout, stderr = (
            io.TextIOWrapper(
                io.FileIO(fd, "w", closefd=False),
                encoding="utf-8",
                errors="backslashreplace",
                line_buffering=True,
            )
            for fd in (1, 2)
        )
    finally:
        for fd, original in zip((1, 2), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)
        os.close(read_end)
        os.close(write_end)
    return stdin, stdout, stderr


def install_stdio(stdin: str, streams: tuple | None = None) -> None:
    """``stdin`` on fd 0 (a memfd; an empty one keeps the inherited fd 0 when ``streams`` are given, which
    one-shot calls get from the worker with its /dev/null on fd 0) and ``streams`` (default: new
    ``make_stdio()``) as ``sys.stdin``/``stdout``/``stderr``."""
    if stdin or streams is None:
        fd = os.memfd_create("stdin", 0)
        data = memoryview(stdin.encode("utf-8", errors="surrogatepass"))
        while data:
            data = data[os.write(fd, data) :]
        os.lseek(fd, 0, os.SEEK_SET)
        os.dup2(fd, 0)
        os.close(fd)
    streams = streams or make_stdio()
    sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__ = streams


def reseed_random_state() -> None:
    """A forked child inherits its parent's RNG state; a fresh interpreter would not."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def compile_cell(code: str) -> tuple:
    """Module code for all statements, plus 'single'-mode code for a trailing bare expression.

    Like a notebook, the trailing expression's value is shown (via ``sys.displayhook``) unless the cell
    ends with a semicolon. ``dont_inherit``: the cell gets no ``__future__`` flags from this module.
    """
    tree = ast.parse(code, CELL_FILENAME, "exec")
    display = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        cell = ast.Interactive(body=[tree.body.pop()])
        display = compile(cell, CELL_FILENAME, "single", dont_inherit=True)
    return compile(tree, CELL_FILENAME, "exec", dont_inherit=True), display


def precompile(code: str, max_chars: int) -> bytes | None:
    """``compile_cell(code)`` marshalled: the front end compiles short cells before they reach a worker.

    A forked call that compiles its own cell writes more pages of its warm parent (copy-on-write faults)
    than one that unmarshals a compiled cell: ~70 per trivial call in the server here, ~0.3 ms of CPU.
    Compiling costs time and memory that grow with the code, so only cells up to ``max_chars`` characters
    are compiled outside the sandbox.
    ``None`` (too long, or not compilable): the call compiles the cell itself and reports any error as usual.
    The compiled form is only valid for the interpreter that made it, which the workers share.
    """
    if len(code) > max_chars:
        return None
    try:
        return marshal.dumps(compile_cell(code))
    except Exception:  # SyntaxError, RecursionError, MemoryError, ValueError (NUL bytes) ...
        return None


def _exit_code_of(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(value)`` would produce, printing a message value like Python."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int) and not isinstance(exc.code, bool):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _print_exception(exc: BaseException) -> None:
    """Traceback without the runner's own frames (as ``python file.py`` would show it)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != CELL_FILENAME:
        tb = tb.tb_next
    try:
        traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
    except BaseException:
        sys.stderr.write(f"{type(exc).__name__}: <exception could not be printed>\n")


def execute(code: str, namespace: dict, compiled: bytes | None = None) -> tuple[str, str | None, int]:
    """Run ``code`` in ``namespace``; return ``(status, error_type, exit_code)``.

    ``compiled``: ``precompile(code)``, if the front end made one; otherwise the cell is compiled here.
    """
    linecache.cache[CELL_FILENAME] = (len(code), None, code.splitlines(True), CELL_FILENAME)
    try:
        body, display = compile_cell(code) if compiled is None else marshal.loads(compiled)
        exec(body, namespace)
        if display is not None:
            exec(display, namespace)
        _join_foreground_threads()
        return "ok", None, 0
    except SystemExit as exc:
        exit_code = _exit_code_of(exc)
        return ("ok", None, 0) if exit_code == 0 else ("error", "SystemExit", exit_code)
    except MemoryError as exc:
        _print_exception(exc)
        return "memory_limit", type(exc).__name__, 1
    except BaseException as exc:
        _print_exception(exc)
        return "error", type(exc).__name__, 1


def _join_foreground_threads() -> None:
    """Python waits for non-daemon threads before exiting; so does a cell (bounded by the timeout).

    ``threading`` is not imported by the sandbox itself: its after-fork hook alone doubles the cost of a
    fork. If the code started threads, it imported the module.
    """
    threading = sys.modules.get("threading")
    if threading is None:
        return
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def encode_record(record: dict) -> bytes:
    """The outcome record as one JSON line.

    The usual record (no error type) is formatted directly: ``json.dumps`` would touch enough of the json
    package to cost a forked call ~30 copy-on-write faults (~0.1 ms).
    """
    if record["error_type"] is not None:
        return json.dumps(record).encode() + b"\n"
    call_id = f', "id": {record["id"]:d}' if "id" in record else ""
    return (
        f'{{"status": "{record["status"]}", "error_type": null, "exit_code": {record["exit_code"]:d}, '
        f'"exec_start": {record["exec_start"]!r}, "exec_end": {record["exec_end"]!r}{call_id}}}\n'
    ).encode()


def _write_record(record: dict) -> None:
    try:
        os.write(RECORD_FD, encode_record(record))
    except OSError:
        pass


def _run_cell(
    code: str, stdin: str, namespace: dict, streams: tuple | None = None, compiled: bytes | None = None
) -> dict:
    """Run one cell with fresh stdio (``install_stdio``); returns its outcome record."""
    install_stdio(stdin, streams)
    start = time.monotonic()
    status, error_type, exit_code = execute(code, namespace, compiled)
    end = time.monotonic()
    _flush_streams()
    return {
        "status": status,
        "error_type": error_type,
        "exit_code": exit_code,
        "exec_start": start,
        "exec_end": end,
    }


def rehearse(times: int = 16) -> None:
    """Run a one-shot call's Python path ``times`` in this (warm) process, its output going to /dev/null.

    CPython 3.11 rewrites a function's code object as it warms up (call counters, then specialized
    instructions), so code that first runs in a forked call writes, and copies, those pages in every call.
    Rehearsed in the warm worker, the runner's code is already specialized when calls fork: ~20 fewer
    copy-on-write faults per trivial call. The rehearsal uses its own streams of the same types on
    /dev/null and restores ``sys``'s streams, fds 1 and 2 and ``linecache`` afterwards.
    """
    saved_fds = [os.dup(fd) for fd in (1, 2)]
    saved_streams = (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
        streams = make_stdio()
        code = "x = 1\nprint(x)\nx"
        compiled = precompile(code, len(code))
        for _ in range(times):
            reseed_random_state()
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            encode_record(_run_cell(code, "", namespace, streams, compiled))
    finally:
        sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__ = saved_streams
        for fd, saved in zip((1, 2), saved_fds, strict=True):
            os.dup2(saved, fd)
            os.close(saved)
        os.close(devnull)
        linecache.cache.pop(CELL_FILENAME, None)


def run_once(code: str, stdin: str, streams: tuple, compiled: bytes | None = None) -> None:
    """Child entry for a one-shot call: run, report, exit (no interpreter teardown). Never returns.

    ``streams``: the worker's ``make_stdio()`` set, pristine in this fresh fork; ``compiled``: the front
    end's ``precompile(code)``, if it made one.
    """
    runner_pid = os.getpid()
    exit_code = 70
    try:
        reseed_random_state()
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        record = _run_cell(code, stdin, namespace, streams, compiled)
        exit_code = record["exit_code"]
        # Code that forked and let the fork run on reaches here twice; only the runner itself reports.
        if os.getpid() == runner_pid:
            _write_record(record)
    finally:
        os._exit(exit_code)


def _read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            raise EOFError("control channel closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_control_message() -> dict:
    (length,) = _FRAME_HEADER.unpack(_read_exact(CONTROL_FD, _FRAME_HEADER.size))
    return json.loads(_read_exact(CONTROL_FD, length))


def encode_control_message(message: dict) -> bytes:
    body = json.dumps(message).encode()  # ASCII: lone surrogates are escaped
    return _FRAME_HEADER.pack(len(body)) + body


def serve_session() -> None:
    """Child entry for a session: run requests one at a time in one persistent namespace. Never returns."""
    runner_pid = os.getpid()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    reseed_random_state()
    try:
        while True:
            request = read_control_message()
            record = _run_cell(request["code"], request["stdin"], namespace)
            if os.getpid() != runner_pid:
                os._exit(record["exit_code"])
            _write_record(dict(record, id=request["id"]))
    finally:
        os._exit(0)
