"""Issue 20's remaining hardening, each attack beside innocent calls that must keep their exact results:
slow clients (header and body read timeouts), session ownership and expiry, a session's CPU budget over all
its processes and its background processes stopped between calls.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gzip
import json
import os
import select
import socket
import time
import urllib.parse

import pytest

from sandbox_server import start_local
from sandbox_server.config import ServerConfig
from sandbox_server.isolation import PYTHON_UNDER_TMP
from tests.sandbox_server.conftest import (
    assert_clean,
    delete_session,
    get,
    open_session,
    post,
    processes_in_uid_range,
    run_batch,
)
from tests.sandbox_server.test_attacks_innocents import _assert_innocent, _innocent
from tests.sandbox_server.test_hostile import FORK_BOMB, _py

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0
WRITE_TIMEOUT = 1.0
SESSION_TTL = 2.0


@pytest.fixture(scope="module")
def hardened():
    with start_local(
        workers=1,
        slots=8,
        tiers="base,full",
        default_timeout=5.0,
        header_timeout=HEADER_TIMEOUT,
        body_timeout=BODY_TIMEOUT,
        write_timeout=WRITE_TIMEOUT,
        max_sessions=6,
        session_ttl=SESSION_TTL,
        session_cpu_seconds=3,
        call_cpu_cgroups=1,
    ) as running:
        yield running


def _connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _trickle_until_closed(
    sock: socket.socket, data: bytes, *, interval: float, limit_s: float, answered: bytes | None = None
) -> bytes | None:
    """Send ``data`` one byte every ``interval`` s; return what the server answered when it closed the
    connection (or once the answer contains ``answered``), or None if neither happened in ``limit_s`` s."""
    answer = b""
    started = time.monotonic()
    for position in range(len(data)):
        if time.monotonic() - started > limit_s:
            return None
        try:
            sock.send(data[position : position + 1])
        except (BrokenPipeError, ConnectionResetError):
            return answer
        readable, _, _ = select.select([sock], [], [], interval)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return answer
            if not chunk:
                return answer
            answer += chunk
            if answered is not None and answered in answer:
                return answer
    return None


def _innocent_batch(url: str, offset: int) -> list[dict]:
    return run_batch(url, [_innocent(offset + i) for i in range(8)])


@pytest.mark.parametrize("connections", [1, 40])
def test_a_client_trickling_headers_is_disconnected_while_innocent_calls_succeed(hardened, connections):
    """Slowloris: request heads sent a byte at a time never complete; the server drops each connection
    ``header_timeout`` after it opened (the limit below is 15 times that), while calls run normally."""
    head = b"POST /run HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 4000
    socks = [_connect(hardened.url) for _ in range(connections)]
    with concurrent.futures.ThreadPoolExecutor(connections + 1) as pool:
        innocent = pool.submit(_innocent_batch, hardened.url, 0)
        outcomes = list(
            pool.map(
                lambda s: _trickle_until_closed(s, head, interval=0.05, limit_s=15 * HEADER_TIMEOUT), socks
            )
        )
        _assert_innocent(innocent.result())
    for sock in socks:
        sock.close()
    assert all(outcome is not None for outcome in outcomes), "a slow header sender kept its connection"
    _assert_innocent(_innocent_batch(hardened.url, 0))


def test_a_client_trickling_its_body_gets_400_while_innocent_calls_succeed(hardened):
    sock = _connect(hardened.url)
    body = b'{"code": "print(1)"}' + b" " * 4000
    head = (
        b"POST /run HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    sock.sendall(head)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(_innocent_batch, hardened.url, 0)
        answer = _trickle_until_closed(sock, body, interval=0.05, limit_s=15 * BODY_TIMEOUT, answered=b's"}')
        _assert_innocent(innocent.result())
    sock.close()
    assert answer is not None, "a slow body sender kept its connection"
    assert answer.startswith(b"HTTP/1.1 400") and b"not received within" in answer, answer[:300]


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_a_compressed_body_is_refused_unread_while_innocent_calls_succeed(hardened):
    """A gzip bomb (1 MiB on the wire, 1 GiB inflated) answers 415 at once; the front end never inflates
    it (aiohttp would have, before any size check: its peak memory grew by ~300 MB)."""
    pid = get(hardened.url, "/health")["server_pid"]
    peak_before = _peak_rss_mib(pid)
    # 1,024 gzip members of 1 MiB of zeros each (a gzip stream may hold many members): built in milliseconds,
    # where deflating 1 GiB took seconds of the test.
    bomb = gzip.compress(bytes(1 << 20), compresslevel=9) * 1024
    sock = _connect(hardened.url)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(_innocent_batch, hardened.url, 0)
        sock.sendall(
            b"POST /run HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
            b"Content-Encoding: gzip\r\nContent-Length: " + str(len(bomb)).encode() + b"\r\n\r\n" + bomb
        )
        sock.settimeout(30)
        answer = sock.recv(4096)
        _assert_innocent(innocent.result())
    sock.close()
    assert answer.startswith(b"HTTP/1.1 415") and b"Content-Encoding: gzip" in answer, answer[:300]
    assert _peak_rss_mib(pid) - peak_before < 64, (peak_before, _peak_rss_mib(pid))
    assert _run_one(hardened.url, "print(6 * 7)")[1]["stdout"] == "42\n"


def _body_bytes_in_flight(url: str) -> int:
    return get(url, "/metrics")["body_bytes_in_flight"]


def test_large_bodies_beyond_the_in_flight_budget_get_503_while_innocent_calls_succeed():
    """The bytes of bodies being received count against ``max_body_bytes_in_flight``: with two 3.5 MiB
    bodies 3 MiB in, a third gets 503 + Retry-After once it would pass 8 MiB (many large bodies at once
    held ~30 MB of front-end memory each), while small calls still fit. Bodies announced by Content-Length
    but not sent hold nothing, so they cannot lock others out."""
    with start_local(workers=1, slots=4, max_request_bytes=4 << 20, max_body_bytes_in_flight=8 << 20) as srv:
        body = json.dumps({"code": "print(1)" + " " * (7 << 19)}).encode()
        head = (
            b"POST /run HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        announced = [_connect(srv.url) for _ in range(4)]
        for sock in announced:
            sock.sendall(head)
        _assert_innocent(_innocent_batch(srv.url, 0))
        assert _body_bytes_in_flight(srv.url) == 0
        held = [_connect(srv.url) for _ in range(2)]
        for sock in held:
            sock.sendall(head + body[: 3 << 20])
        deadline = time.monotonic() + 30  # until both handlers have received their 3 MiB
        while _body_bytes_in_flight(srv.url) < 2 * (3 << 20):
            assert time.monotonic() < deadline, get(srv.url, "/metrics")
            time.sleep(0.05)
        refused = _connect(srv.url)
        refused.sendall(head + body)
        refused.settimeout(30)
        answer = refused.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer[:300]
        assert b"max-body-bytes-in-flight" in answer, answer[:400]
        _assert_innocent(_innocent_batch(srv.url, 8), offset=8)  # small bodies still fit beside them
        for sock in held:
            sock.sendall(body[3 << 20 :])
            sock.settimeout(30)
            assert sock.recv(4096).startswith(b"HTTP/1.1 400"), "the code is over max_code_chars"
            sock.close()
        status, result = _run_one(srv.url, "print(1)" + " " * (7 << 19))
        assert status == 400 and "code" in result["error"], result  # admitted again: read, then refused
        status, result = _run_one(srv.url, "print(1)" + " " * (5 << 20))
        assert status == 413, result  # one body over --max-request-bytes
        for sock in announced:
            sock.close()


def _write_timeouts(url: str) -> int:
    return get(url, "/metrics")["http_rejected"].get("write_timeout", 0)


def test_a_client_that_never_reads_its_answer_is_disconnected_while_innocent_calls_succeed(hardened):
    """A batch whose answer (~16 MB) cannot fit the socket buffers, from a client that never reads: the
    server drops the connection ``write_timeout`` after the answer was ready instead of holding it."""
    noisy = {"code": "import sys\nprint('x' * 70000)\nprint('y' * 70000, file=sys.stderr)", "timeout": 20}
    body = json.dumps({"requests": [noisy] * 120}).encode()
    dropped_before = _write_timeouts(hardened.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    parts = urllib.parse.urlsplit(hardened.url)
    sock.connect((parts.hostname, parts.port))
    sock.sendall(
        b"POST /run/batch HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(_innocent_batch, hardened.url, 0)
        _assert_innocent(innocent.result())
        deadline = time.monotonic() + 60  # the batch runs, then its answer waits out the write timeout
        while _write_timeouts(hardened.url) == dropped_before and time.monotonic() < deadline:
            _assert_innocent(_innocent_batch(hardened.url, 0))
    received, closed = 0, False
    sock.settimeout(10)
    try:
        while chunk := sock.recv(1 << 16):
            received += len(chunk)
        closed = True
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        pass
    sock.close()
    assert closed and 0 < received < 120 * 2 * 65536, (closed, received)


@pytest.mark.parametrize("field", ["header_timeout", "body_timeout", "write_timeout"])
@pytest.mark.parametrize("value", [0.0, float("nan"), 1e9])
def test_read_timeouts_outside_sane_bounds_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**{field: value})


def test_a_body_budget_smaller_than_one_body_is_refused():
    with pytest.raises(ValueError, match="max_body_bytes_in_flight"):
        ServerConfig(max_request_bytes=64 << 20, max_body_bytes_in_flight=32 << 20)


# ------------------------------------------------------------------------------------ session ownership
def _run_one(url: str, code: str, **fields) -> tuple[int, dict]:
    status, body, _ = post(url, {"code": code, **fields})
    return status, body


def _assert_not_found(status: int, result: dict) -> None:
    assert status == 404, result
    assert (result["status"], result["error_type"]) == ("invalid_request", "SessionNotFound"), result
    assert result["stdout"] == "", result


def test_a_session_answers_only_its_token_and_strangers_learn_nothing(hardened):
    url = hardened.url
    owner, stranger = open_session(url), open_session(url)
    assert owner["session"] != stranger["session"] and len(owner["session_token"]) >= 40
    assert _run_one(url, "secret = 'owner data'", **owner)[1]["status"] == "ok"
    sid = owner["session"]
    attempts = [
        {"session": sid},  # no token
        {"session": sid, "session_token": stranger["session_token"]},  # another session's token
        {"session": sid, "session_token": owner["session_token"][:-1] + "x"},  # nearly right
        {"session": sid + "x", "session_token": owner["session_token"]},  # a guessed id
        {"session": sid, "session_token": "é\ud800" + owner["session_token"][2:]},  # not even ASCII
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        innocent = pool.submit(_innocent_batch, url, 0)
        for fields in attempts:
            _assert_not_found(*_run_one(url, "print(secret)", **fields))
            batch = run_batch(url, [{"code": "print(secret)", **fields}])[0]
            assert batch["error_type"] == "SessionNotFound" and "owner data" not in str(batch), batch
            token = (fields.get("session_token") or "x").encode("utf-8", "surrogatepass").decode("latin-1")
            wrong = {"session": fields["session"], "session_token": token}  # a header carries raw bytes
            assert delete_session(url, wrong)[0] == 404
        _assert_innocent(innocent.result())
    mine = _run_one(url, "print(secret)", **owner)[1]
    assert mine["stdout"] == "owner data\n", mine  # untouched by all of the above
    assert delete_session(url, owner) == (200, {"closed": True})
    # Closed: its owner learns why; a stranger gets the same answer as for an id that never existed.
    gone = _run_one(url, "1", **owner)[1]
    assert (gone["status"], gone["error_type"]) == ("killed", "SessionClosed") and "closed" in gone["stderr"]
    _assert_not_found(*_run_one(url, "1", session=sid, session_token=stranger["session_token"]))
    delete_session(url, stranger)


def test_an_idle_session_expires_and_its_processes_are_gone(hardened):
    url = hardened.url
    session = open_session(url)
    spawn = "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])\nprint(child.pid > 1)"
    assert _run_one(url, spawn, **session)[1]["stdout"] == "True\n"
    lo, hi = get(url, "/health")["uid_ranges"]["sessions"]
    assert processes_in_uid_range(lo, hi), "the session's processes should be running"
    deadline = time.monotonic() + 10 * SESSION_TTL
    while processes_in_uid_range(lo, hi) and time.monotonic() < deadline:
        _assert_innocent(_innocent_batch(url, 0))  # other clients' calls meanwhile are fine
    assert not processes_in_uid_range(lo, hi), "the expired session's processes are still running"
    expired = _run_one(url, "print(1)", **session)[1]
    assert (expired["status"], expired["error_type"]) == ("killed", "SessionClosed"), expired
    assert f"closed after {SESSION_TTL:g} s idle" in expired["stderr"]


# ------------------------------------------------------------------------------ a session's CPU and idling
STAMPER = """
import os, time
if os.fork() == 0:
    if os.fork() == 0:  # an orphaned grandchild, writing a time stamp every 20 ms
        with open("/tmp/stamps", "a") as f:
            while True:
                f.write(f"{time.monotonic()}\\n")
                f.flush()
                time.sleep(0.02)
    os._exit(0)
os.wait()
while not os.path.exists("/tmp/stamps") or len(open("/tmp/stamps").read().split()) < 3:
    time.sleep(0.02)  # the grandchild is stamping before the call ends (it may start late on a busy machine)
print("stamping")
"""
LONGEST_GAP = """
import time
start = time.monotonic()
while float(open("/tmp/stamps").read().split()[-1]) < start:
    time.sleep(0.01)  # a stamp written after the thaw: else the idle gap is not in the file yet
stamps = [float(x) for x in open("/tmp/stamps").read().split()]
print(round(max(b - a for a, b in zip(stamps, stamps[1:])), 1))
"""
BURNERS = """
import os
for _ in range(2):
    if os.fork() == 0:
        while True:
            pass
print("burning")
"""


def _require(url: str, mechanism: str) -> None:
    if mechanism not in get(url, "/health")["mechanisms"]["active"]:
        pytest.skip(f"{mechanism} is not available here (needs root and the cgroup controller)")


def test_a_sessions_background_processes_are_stopped_between_its_calls(hardened):
    url = hardened.url
    _require(url, "session_freezer")
    session = open_session(url)
    assert _run_one(url, STAMPER, **session)[1]["stdout"] == "stamping\n"
    idle = 1.5  # below the session TTL
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(_innocent_batch, url, 0)
        time.sleep(idle)
        _assert_innocent(innocent.result())
    result = _run_one(url, LONGEST_GAP, **session)[1]
    assert result["status"] == "ok", result
    assert float(result["stdout"]) >= 1.0, result  # no stamp while the session was idle
    delete_session(url, session)


def test_a_sessions_cpu_budget_counts_all_its_processes(hardened):
    """Two detached busy processes, each far under the 3 s budget on its own: together they use it up
    during the next call, which is killed (``timeout``) with the whole session; innocent calls meanwhile
    are fine, and the session's next call starts afresh."""
    url = hardened.url
    _require(url, "session_cpu_accounting")
    session = open_session(url)
    assert _run_one(url, "kept = 1\n" + BURNERS, **session)[1]["stdout"] == "burning\n"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        innocent = pool.submit(_innocent_batch, url, 0)
        charged = _run_one(url, "import time\ntime.sleep(20)\nprint('survived')", timeout=30, **session)[1]
        _assert_innocent(innocent.result())
    assert charged["status"] == "timeout" and "survived" not in charged["stdout"], charged
    assert "CPU budget" in charged["stderr"], charged
    fresh = _run_one(url, "print('kept' in globals())", **session)[1]
    assert fresh["stdout"] == "False\n" and "fresh session" in fresh["stderr"], fresh
    lo, hi = get(url, "/health")["uid_ranges"]["sessions"]
    uid = int(_run_one(url, "import os\nprint(os.getuid())", **session)[1]["stdout"])
    assert lo <= uid < hi
    assert len(processes_in_uid_range(uid, uid + 1)) == 1  # the burners died with the session
    delete_session(url, session)


# ------------------------------------------------------------------------------------------- the storm
# Hostile programs beyond test_hostile's, all in ONE batch with innocent calls between them and a second
# innocent batch at the same time: each must end with its expected status, every innocent call with its
# exact result, no worker may be replaced and nothing may be left behind.
STORM = {
    "fork_bomb": (
        FORK_BOMB,
        "timeout",
    ),
    "thread_bomb": (
        _py("""
            import threading, time
            for _ in range(10000):
                threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
        """),
        "error",
    ),
    "busy_threads": (
        _py("""
            import threading
            for _ in range(24):
                threading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()
        """),
        "timeout",
    ),
    "fd_exhaustion": (
        _py("""
            import os, socket
            held = []
            try:
                while True:
                    held += [*os.pipe(), socket.socket(), open("/dev/null")]
            except OSError as e:
                print("exhausted", e.errno)
        """),
        "ok",
    ),
    "fill_tmpfs": ("for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (15 * 2**20))", "error"),
    "write_everywhere": (
        _py("""
            import os
            wrote = []
            for p in ["/", "/usr", "/etc", "/dev", "/dev/shm", "/var/tmp", "/run", "/home", "/work", "/root"]:
                try:
                    open(os.path.join(p, "sbx_storm"), "w").write("x")
                    wrote.append(p)
                except OSError:
                    pass
            print("wrote", wrote)
        """),
        "ok",
    ),
    "output_flood": (
        "import sys\nchunk = 'x' * 65535 + '\\n'\nfor _ in range(1600):\n    sys.stdout.write(chunk)",
        "output_limit",
    ),
    "signal_everything": (
        _py("""
            import os, signal
            for target in (-1, 0, 1, 2, 3):
                for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
                    try:
                        os.kill(target, sig)
                    except OSError:
                        pass
            print("still here")
        """),
        "ok",
    ),
    "trace_and_peek": (  # pid 1 is the call itself (init of its PID namespace)
        _py("""
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            reached = []
            for pid in range(2, 64):
                if libc.ptrace(16, pid, 0, 0) == 0:  # PTRACE_ATTACH
                    reached.append(("ptrace", pid))
                try:
                    os.close(os.pidfd_open(pid))
                    reached.append(("pidfd", pid))
                except OSError:
                    pass
            print("reached", reached)
        """),
        "ok",
    ),
    "daemonize": (
        _py("""
            import os, time
            if os.fork() == 0:
                if os.fork() == 0:
                    for fd in range(64):
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                    time.sleep(10**6)
                os._exit(0)
            os.wait()
            print("daemon started")
        """),
        "ok",
    ),
    "new_session": (  # denied: it would be a scheduling group of its own, outside its call's CPU share
        _py("""
            import os
            pid = os.fork()
            if pid == 0:
                try:
                    os.setsid()
                    os._exit(0)
                except PermissionError:
                    os._exit(1)
            print("setsid denied" if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1 else "allowed")
        """),
        "ok",
    ),
    "exec_shell_with_background": (
        "import os\nos.execv('/bin/sh', ['sh', '-c', 'yes > /dev/null & sleep 1000'])",
        "timeout",
    ),
    "rlimit_games": (
        _py("""
            import resource
            raised = []
            for r in (resource.RLIMIT_NPROC, resource.RLIMIT_NOFILE, resource.RLIMIT_CPU, resource.RLIMIT_AS):
                hard = resource.getrlimit(r)[1]
                try:
                    resource.setrlimit(r, (hard + 1, hard + 1))
                    raised.append(r)
                except (ValueError, OSError):
                    pass
            print("raised", raised)
            x = bytearray(3 * 2**30)
        """),
        "memory_limit",
    ),
    "snoop_other_calls": (
        _py("""
            import os
            found = [p for p in ("/proc", "/sys", "/dev/shm") if os.path.exists(p)]
            found += [n for n in os.listdir("/tmp") if "victim" in n]
            print("found", found)
        """),
        "ok",
    ),
}
STORM_STDOUT = {
    "fd_exhaustion": "exhausted 24\n",
    "write_everywhere": "wrote []\n",
    "signal_everything": "still here\n",
    "trace_and_peek": "reached []\n",
    "daemonize": "daemon started\n",
    "snoop_other_calls": "found []\n",
    "new_session": "setsid denied\n",
    "rlimit_games": "raised []\n",
}
VICTIM = (
    "import time\nopen('/tmp/victim_secret', 'w').write('mine')\ntime.sleep(1.5)\n"
    "print(open('/tmp/victim_secret').read(), sorted(__import__('os').listdir('/tmp')))"
)


def test_a_storm_of_hostile_programs_changes_no_innocent_result(server):
    url = server.url
    workers_before = [w["pid"] for w in get(url, "/health")["workers"]]
    names = sorted(STORM)
    batch, where = [], {}
    for i, name in enumerate(names):
        batch.append(_innocent(i))
        where[name] = len(batch)
        batch.append({"code": STORM[name][0], "timeout": 2.0})
    batch.append({"code": VICTIM, "timeout": 20})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(run_batch, url, [_innocent(100 + i) for i in range(12)])
        results = run_batch(url, batch)
        _assert_innocent(other.result(), offset=100)
    for i in range(len(names)):
        _assert_innocent([results[2 * i]], offset=i)
    problems = {}
    for name in names:
        result = results[where[name]]
        expected_stdout = STORM_STDOUT.get(name)
        if result["status"] != STORM[name][1] or (expected_stdout and result["stdout"] != expected_stdout):
            problems[name] = result
    assert not problems, problems
    victim = results[-1]
    # The call's /tmp holds its own file, plus the read-only interpreter folders when the server's Python
    # lives under /tmp (a checkout cloned there), exactly as test_semantics expects.
    listing = sorted(["victim_secret", *{p.split("/")[2] for p in PYTHON_UNDER_TMP}])
    assert victim["status"] == "ok" and victim["stdout"] == f"mine {listing}\n", victim
    assert [w["pid"] for w in get(url, "/health")["workers"]] == workers_before, "a worker died"
    assert_clean(url)


# ------------------------------------------------------------------------------------- CPU between calls
HOG = """
import os, time
for _ in range(12):
    if os.fork() == 0:
        while True:
            pass
time.sleep(100)
"""


def _cpu_cgroup(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "cpu" in controllers.split(","):
                    return path
    except OSError:
        return None
    return None


def test_each_call_is_one_cpu_cgroup_whatever_it_starts(hardened):
    """With --call-cpu-cgroups 1 every process of a call is in its slot's cpu cgroup (equal weights), so
    two hogs of 13 busy processes each weigh two calls, not 26 processes, against the innocent calls."""
    url = hardened.url
    _require(url, "call_cpu_cgroup")
    health = get(url, "/health")
    lo, hi = health["uid_ranges"]["calls"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hogs = pool.submit(run_batch, url, [{"code": HOG, "timeout": 3.0}] * 2)
        by_uid: dict = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pids = processes_in_uid_range(lo, hi)
            if len(pids) >= 26:  # both hogs and all their processes
                for pid in pids:
                    with contextlib.suppress(OSError):
                        by_uid.setdefault(os.stat(f"/proc/{pid}").st_uid, set()).add(_cpu_cgroup(pid))
                break
            time.sleep(0.05)
        _assert_innocent(_innocent_batch(url, 0))
        assert [r["status"] for r in hogs.result()] == ["timeout", "timeout"]
    groups = [next(iter(paths)) for paths in by_uid.values() if len(paths) == 1]
    assert len(by_uid) == 2 and len(groups) == 2 and len(set(groups)) == 2, by_uid
    assert all(f"sandbox_server-{health['server_pid']}/" in group for group in groups), groups
