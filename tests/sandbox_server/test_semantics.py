"""What a call sees and returns: stdout/stdin, notebook display, errors, timeouts, batches, sessions, wire."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request

import msgpack
import pytest

from sandbox_server import schema
from sandbox_server.isolation import PYTHON_UNDER_TMP
from tests.sandbox_server.conftest import (
    assert_clean,
    delete_session,
    get,
    open_session,
    post,
    processes_in_uid_range,
    run_batch,
    run_code,
)


def test_stdout_and_result_fields(server):
    result = run_code(server.url, "print('hello')\nprint(1 + 1)")
    assert set(result) == set(schema.RESULT_FIELDS)
    assert result["status"] == "ok"
    assert result["stdout"] == "hello\n2\n"
    assert result["stderr"] == ""
    assert result["exit_code"] == 0 and result["error_type"] is None
    assert result["duration"] > 0


def test_stdin_is_readable(server):
    result = run_code(server.url, "a = int(input())\nb = int(input())\nprint(a * b)", stdin="6\n7\n")
    assert result["stdout"] == "42\n"
    result = run_code(server.url, "import sys\nprint(repr(sys.stdin.read()))")
    assert result["stdout"] == "''\n"


@pytest.mark.parametrize(
    "code, stdout",
    [
        ("2 ** 10", "1024\n"),
        ("x = 3\nx * 'ab'", "'ababab'\n"),
        ("print('a')\n'b'", "a\n'b'\n"),
        ("2 ** 10;", ""),  # a trailing semicolon suppresses the display, as in a notebook
        ("None", ""),
        ("x = 5", ""),
        ("import numpy as np\nnp.arange(3)", "array([0, 1, 2])\n"),
        ("import sympy\nx = sympy.Symbol('x')\nsympy.factor(x**2 - 1)", "(x - 1)*(x + 1)\n"),
        ("from fractions import Fraction\nFraction(1, 3) + Fraction(1, 6)", "Fraction(1, 2)\n"),
    ],
)
def test_last_expression_is_displayed(server, code, stdout):
    result = run_code(server.url, code)
    assert result["status"] == "ok", result
    assert result["stdout"] == stdout


def test_exception_reports_type_and_traceback(server):
    result = run_code(server.url, "def f(x):\n    return 1 / x\nprint('before')\nf(0)")
    assert result["status"] == "error"
    assert result["error_type"] == "ZeroDivisionError"
    assert result["stdout"] == "before\n"
    assert result["exit_code"] == 1
    stderr = result["stderr"]
    assert stderr.startswith("Traceback (most recent call last):")
    assert 'File "<cell>", line 4' in stderr and "return 1 / x" in stderr
    assert "runner.py" not in stderr  # the sandbox's own frames are not shown
    assert stderr.rstrip().endswith("ZeroDivisionError: division by zero")


def test_syntax_error(server):
    result = run_code(server.url, "def broken(:\n    pass")
    assert result["status"] == "error" and result["error_type"] == "SyntaxError"
    assert "SyntaxError" in result["stderr"]


@pytest.mark.parametrize("where", ["precompiled", "compiled in the call", "session"])
def test_cells_compile_as_a_python_file_would(server, where):
    # The front end compiles short one-shot cells (runner.precompile), longer ones and sessions compile in the
    # sandbox; either way no __future__ flag of the sandbox's own modules reaches the cell.
    filler = "# " + "-" * 3000 + "\n" if where == "compiled in the call" else ""
    code = filler + "def f(x: int):\n    return 1 / x\nprint(f.__annotations__)\nf(0)"
    session = open_session(server.url) if where == "session" else {}
    result = run_code(server.url, code, **session)
    assert result["stdout"] == "{'x': <class 'int'>}\n"
    assert result["error_type"] == "ZeroDivisionError"
    assert f'File "<cell>", line {4 + bool(filler)}' in result["stderr"]
    assert "return 1 / x" in result["stderr"]


@pytest.mark.parametrize(
    "code, status, exit_code",
    [
        ("import sys\nsys.exit(0)", "ok", 0),
        ("raise SystemExit", "ok", 0),
        ("import sys\nsys.exit(3)", "error", 3),
    ],
)
def test_exit(server, code, status, exit_code):
    result = run_code(server.url, code)
    assert (result["status"], result["exit_code"]) == (status, exit_code)


def test_exit_message_goes_to_stderr(server):
    result = run_code(server.url, "import sys\nsys.exit('bye')")
    assert result["status"] == "error" and result["exit_code"] == 1 and result["stderr"] == "bye\n"


def test_timeout_keeps_partial_output(server):
    result = run_code(server.url, "import time\nprint('started')\ntime.sleep(60)", timeout=1.0)
    assert result["status"] == "timeout"
    assert result["stdout"] == "started\n"
    assert "timeout" in result["stderr"]
    assert_clean(server.url)


def test_each_call_has_fresh_state(server):
    first = run_code(server.url, "import math\nmath.marker = 1\nGLOBAL = 2\nprint('set')")
    second = run_code(server.url, "import math\nprint(hasattr(math, 'marker'), 'GLOBAL' in globals())")
    assert first["stdout"] == "set\n"
    assert second["stdout"] == "False False\n"


def test_random_state_differs_between_calls(server):
    code = "import random, numpy as np\nprint(random.random(), np.random.rand())"
    outputs = {run_code(server.url, code)["stdout"] for _ in range(3)}
    assert len(outputs) == 3


def test_working_directory_is_private_and_writable(server):
    # A Python install under /tmp (a venv in a checkout there) is bound back read-only over each call's /tmp.
    python_dirs = sorted({p.split("/")[2] for p in PYTHON_UNDER_TMP})
    code = (
        "import os\nopen('data.txt', 'w').write('abc')\n"
        "print(sorted(os.listdir('.')), open('data.txt').read())"
    )
    assert run_code(server.url, code)["stdout"] == f"{sorted(['data.txt', *python_dirs])} abc\n"
    assert run_code(server.url, "import os\nprint(sorted(os.listdir('.')))")["stdout"] == f"{python_dirs}\n"


def test_large_output_keeps_head_and_tail(server):
    code = "for i in range(40000):\n    print(f'line {i:05d}')"
    result = run_code(server.url, code)
    assert result["status"] == "ok"
    stdout = result["stdout"]
    assert stdout.startswith("line 00000\n") and stdout.endswith("line 39999\n")
    assert "bytes of output omitted" in stdout
    assert len(stdout) < 70000


def test_batch_preserves_order_and_reports_invalid_items(server):
    requests = [{"code": f"import time\ntime.sleep({(7 - i % 8) * 0.02})\nprint({i})"} for i in range(40)]
    requests[5] = {"code": 5}
    requests[9] = {"code": "print(1)", "timeout": -1}
    results = run_batch(server.url, requests)
    assert len(results) == 40
    for i, result in enumerate(results):
        if i in (5, 9):
            assert result["status"] == "invalid_request"
        else:
            assert result["status"] == "ok" and result["stdout"] == f"{i}\n"
    assert "'code' must be a string" in results[5]["stderr"]
    assert "'timeout' must be in" in results[9]["stderr"]


def test_sessions_keep_state_and_are_separate(server):
    a, b = open_session(server.url), open_session(server.url)
    assert run_code(server.url, "x = 10\nimport numpy as np", **a)["status"] == "ok"
    assert run_code(server.url, "x = 'other'", **b)["status"] == "ok"
    assert run_code(server.url, "x * 2", **a)["stdout"] == "20\n"
    assert run_code(server.url, "x", **b)["stdout"] == "'other'\n"
    error = run_code(server.url, "1 / 0", **a)
    assert error["status"] == "error" and error["error_type"] == "ZeroDivisionError"
    assert run_code(server.url, "x + int(input())", stdin="5\n", **a)["stdout"] == "15\n"
    for session in (a, b):
        assert delete_session(server.url, session) == (200, {"closed": True})
    assert delete_session(server.url, a)[0] == 404
    result = run_code(server.url, "print('x' in globals())", **a)
    assert (result["status"], result["error_type"]) == ("killed", "SessionClosed"), result
    assert "closed by its client" in result["stderr"] and result["stdout"] == ""


def test_session_killed_by_limit_says_so(server):
    session = open_session(server.url)
    sid = session["session"]
    assert run_code(server.url, "state = 1", **session)["status"] == "ok"
    killed = run_code(server.url, "while True:\n    pass", **session, timeout=1.0)
    assert killed["status"] == "timeout"
    assert f"session '{sid}' was terminated (timeout)" in killed["stderr"]
    fresh = run_code(server.url, "print('state' in globals())", **session)
    assert fresh["status"] == "ok" and fresh["stdout"] == "False\n"
    assert "terminated earlier (timeout)" in fresh["stderr"]
    delete_session(server.url, session)


def test_session_that_dies_between_calls_says_so(server):
    session = open_session(server.url)
    code = (
        "import os, threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), os._exit(3))).start()"
    )
    assert run_code(server.url, "kept = 1", **session)["status"] == "ok"
    ended = run_code(server.url, code, **session, timeout=5)  # the cell waits for its thread, which exits
    assert ended["status"] == "error" and ended["exit_code"] == 3
    assert "was terminated (exited with code 3)" in ended["stderr"]
    after = run_code(server.url, "kept", **session)
    assert after["error_type"] == "NameError" and "started a fresh session" in after["stderr"]
    delete_session(server.url, session)


def test_session_that_dies_while_idle_says_so(server):
    """Its process killed between calls (from outside: a session's own threads and children are frozen
    between calls where the freezer cgroup exists): the next call says so, the one after starts afresh."""
    session = open_session(server.url)
    uid = int(run_code(server.url, "import os\nprint(os.getuid())", **session)["stdout"])
    pids = processes_in_uid_range(uid, uid + 1)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.3)
    lost = run_code(server.url, "print('hello')", **session)
    assert lost["status"] == "killed" and "killed by SIGKILL" in lost["stderr"], lost
    fresh = run_code(server.url, "print('hello')", **session)
    assert fresh["status"] == "ok" and fresh["stdout"] == "hello\n" and "fresh session" in fresh["stderr"]
    delete_session(server.url, session)


def test_session_processes_are_isolated(server):
    session = open_session(server.url)
    result = run_code(server.url, "import os, socket\nprint(os.getuid() != 0, os.getpid())", **session)
    assert result["stdout"] == "True 1\n"
    result = run_code(server.url, "socket.create_connection(('127.0.0.1', 22), timeout=1)", **session)
    assert result["status"] == "error" and result["error_type"] == "OSError"
    delete_session(server.url, session)


def test_msgpack_wire(server):
    body = msgpack.packb({"requests": [{"code": "print('packed')"}, {"code": "'\\udcff'"}]})
    request = urllib.request.Request(
        server.url + "/run/batch", data=body, headers={"Content-Type": "application/msgpack"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("application/msgpack")
        results = msgpack.unpackb(response.read())["results"]
    assert results[0]["stdout"] == "packed\n"
    assert results[1]["status"] == "ok"


def test_malformed_json_is_400_with_message(server):
    status, body, _ = post(server.url, b'{"code": "print(1)"', path="/run")
    assert status == 400 and "malformed JSON" in body["error"]
    status, body, _ = post(server.url, b"\x93\x01", path="/run", content_type="application/msgpack")
    assert status == 400 and "malformed msgpack" in body["error"]
    status, body, _ = post(server.url, {"requests": "nope"}, path="/run/batch")
    assert status == 400 and "'requests' must be a list" in body["error"]


def test_invalid_run_request_is_400_with_status(server):
    status, body, _ = post(server.url, {"code": "print(1)", "bogus": True})
    assert status == 400
    assert body["status"] == "invalid_request" and "unknown request field" in body["error"]


def test_oversized_request_is_413(server):
    status, body, _ = post(server.url, {"code": "x", "stdin": "y" * (33 << 20)})
    assert status == 413 and "larger than" in body["error"]


def test_health_and_metrics(server):
    health = get(server.url, "/health")
    assert health["status"] == "ok"
    assert len(health["workers"]) == 2 * 3 and all(w["ready"] for w in health["workers"])
    reported = set(health["mechanisms"]["active"]) | set(health["mechanisms"]["inactive"])
    assert {
        "pid_namespace",
        "network_namespace",
        "mount_namespace",
        "unprivileged_uid",
        "seccomp",
        "rlimits",
    } <= reported
    run_code(server.url, "print(1)")
    metrics = get(server.url, "/metrics")
    assert metrics["results_by_status"]["ok"] >= 1
    assert sum(metrics["latency_histogram"].values()) == metrics["results_total"]
    assert set(metrics["phase_mean_ms"]) == {
        "queue",
        "to_worker",
        "fork",
        "child_setup",
        "execution",
        "exit_reap",
        "to_frontend",
    }
    assert metrics["queue_depth"] == 0 and metrics["worker_restarts"] == 0
