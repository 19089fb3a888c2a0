"""Overload, dead workers, the memory cgroup, authentication and session limits, on a small server."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from sandbox_server import start_local
from tests.sandbox_server.conftest import assert_clean, get, open_session, post

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def small_server():
    options = dict(
        workers=1, slots=2, max_queue=4, token=TOKEN, total_memory_mb=640, max_sessions=2, session_ttl=1.0
    )
    with start_local(**options) as running:
        yield running


def _run(server, code: str, **fields) -> tuple[int, dict, dict]:
    return post(server.url, {"code": code, **fields}, headers=AUTH)


def _metrics(server) -> dict:
    request = urllib.request.Request(server.url + "/metrics", headers=AUTH)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _wait_until(condition, what: str, limit_s: float = 60.0) -> None:
    """Poll ``condition``; fail (instead of hanging) if it is still false after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        time.sleep(0.05)


def test_token_required_except_health(small_server):
    status, body, _ = post(small_server.url, {"code": "print(1)"})
    assert status == 401 and "bearer token" in body["error"]
    status, body, _ = post(small_server.url, {"code": "print(1)"}, headers={"Authorization": "Bearer wrong"})
    assert status == 401
    not_utf8 = "Bearer \xff\xfe".encode("latin-1").decode("latin-1")  # raw bytes that are not UTF-8
    status, body, _ = post(small_server.url, {"code": "print(1)"}, headers={"Authorization": not_utf8})
    assert status == 401, body
    assert get(small_server.url, "/health")["status"] == "ok"
    status, body, _ = _run(small_server, "print(1)")
    assert status == 200 and body["stdout"] == "1\n"


def test_full_queue_answers_503_with_retry_after(small_server):
    # 2 slots + 4 queue places: of 12 simultaneous one-second calls, some must be turned away.
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(
            pool.map(lambda _: _run(small_server, "import time\ntime.sleep(1)\nprint('done')"), range(12))
        )
    statuses = [status for status, _, _ in answers]
    assert statuses.count(503) >= 1 and statuses.count(200) >= 6, statuses
    for status, body, headers in answers:
        if status == 503:
            assert int(headers["Retry-After"]) >= 1 and "busy" in body["error"]
        else:
            assert status == 200 and body["status"] == "ok" and body["stdout"] == "done\n"
    assert _metrics(small_server)["http_rejected"]["503"] >= 1


@pytest.mark.parametrize("victim", ["pid", "fork_server_pid"])
def test_dead_worker_is_replaced_and_its_call_killed(small_server, victim):
    """Killing a worker, or its fork server (without which the worker exits), kills the worker's call and
    gets the worker replaced; neither process outlives the other."""
    base = next(w for w in get(small_server.url, "/health")["workers"] if w["tier"] == "base")
    if base[victim] is None:
        pytest.skip(f"no fork server: {base['call_setup']}")
    restarts = _metrics(small_server)["worker_restarts"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_run, small_server, "import time\ntime.sleep(30)")
        _wait_until(lambda: _metrics(small_server)["inflight"] > 0, "the call runs")
        os.kill(base[victim], signal.SIGKILL)
        status, result, _ = pending.result(timeout=60)
    assert status == 200
    assert result["status"] == "killed" and result["error_type"] == "WorkerDied", result

    def replaced():
        replacement = next(w for w in get(small_server.url, "/health")["workers"] if w["tier"] == "base")
        return replacement["ready"] and replacement["pid"] != base["pid"]

    _wait_until(replaced, "the worker is replaced", 120)
    assert _metrics(small_server)["worker_restarts"] == restarts + 1
    status, result, _ = _run(small_server, "print('after restart')")
    assert result["stdout"] == "after restart\n"
    assert_clean(small_server.url)
    for pid in (base["pid"], base["fork_server_pid"]):
        if pid is not None:
            _wait_until(lambda pid=pid: _gone(pid), f"process {pid} ends with its partner")


def _gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for whoever reaps orphans here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_call_needing_a_restarting_tier_waits_for_it(small_server):
    full = next(w for w in get(small_server.url, "/health")["workers"] if w["tier"] == "full")
    restarts = _metrics(small_server)["worker_restarts"]
    os.kill(full["pid"], signal.SIGKILL)
    _wait_until(lambda: _metrics(small_server)["worker_restarts"] > restarts, "the front end sees the death")
    status, result, _ = _run(small_server, "import sympy\nprint(sympy.Integer(2) ** 10)")
    assert status == 200 and result["status"] == "ok" and result["stdout"] == "1024\n", result
    assert _run(small_server, "print('base tier unaffected')")[1]["status"] == "ok"


def test_memory_cgroup_stops_what_rlimits_allow(small_server):
    health = get(small_server.url, "/health")
    if "memory_cgroup" not in health["mechanisms"]["active"]:
        pytest.skip(f"memory cgroup inactive: {health['mechanisms']['inactive'].get('memory_cgroup')}")
    # 700 MiB of touched memory fits the 1 GiB address-space limit but not the 640 MiB cgroup.
    status, result, _ = _run(small_server, "b = b'x' * (700 * 2**20)\nprint('allocated')")
    assert result["status"] == "memory_limit", result
    assert result["error_type"] == "OutOfMemory" and "out-of-memory" in result["stderr"]
    assert _run(small_server, "print('fine')")[1]["stdout"] == "fine\n"
    assert_clean(small_server.url)


def test_sessions_are_never_evicted_and_expire_when_idle(small_server):
    s1, s2 = (open_session(small_server.url, AUTH) for _ in range(2))
    assert _run(small_server, "a = 1", **s1)[1]["status"] == "ok"
    assert _run(small_server, "b = 2", **s2)[1]["status"] == "ok"
    # max_sessions is 2: a third is refused (503), and neither open session loses its state.
    status, body, headers = post(small_server.url, b"", path="/sessions", headers=AUTH)
    assert status == 503 and "Retry-After" in headers and "sessions are open" in body["error"], body
    assert _run(small_server, "print(a)", **s1)[1]["stdout"] == "1\n"
    time.sleep(1.6)  # > session_ttl plus one expiry sweep (every ttl / 4)
    result = _run(small_server, "print(b)", **s2)[1]
    assert (result["status"], result["error_type"]) == ("killed", "SessionClosed"), result
    assert "idle" in result["stderr"] and result["stdout"] == ""
    assert _metrics(small_server)["sessions"] == 0
    s3 = open_session(small_server.url, AUTH)  # room again
    assert _run(small_server, "print(3)", **s3)[1]["stdout"] == "3\n"


def test_shutdown_answers_open_calls_and_cleans_up():
    with start_local(workers=1, tiers="full", token=TOKEN) as server:
        health = get(server.url, "/health")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_run, server, "import time\ntime.sleep(60)")
            _wait_until(lambda: _metrics(server)["inflight"] > 0, "the call runs")
            server.process.terminate()
            status, result, _ = pending.result(timeout=60)
        assert server.process.wait(timeout=60) == 0
    assert status == 200 and result["status"] == "killed", result
    assert not os.path.exists(health["temp_root"])
    assert health["cgroup"] is None or not os.path.exists(health["cgroup"])
    assert not any(os.path.exists(f"/proc/{w['pid']}") for w in health["workers"])


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie lingers until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_server_stops_when_the_process_that_started_it_dies():
    """``start_local``'s server and its workers go away with a parent killed inside the ``with`` block."""
    starter = (
        "import json, time\n"
        "from sandbox_server import start_local\n"
        "with start_local(workers=1, tiers='full') as server:\n"
        "    pids = [server.process.pid] + [w['pid'] for w in server.get('/health')['workers']]\n"
        "    print(json.dumps(pids), flush=True)\n"
        "    time.sleep(600)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        pids = json.loads(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    assert len(pids) == 2
    _wait_until(lambda: not any(_running(pid) for pid in pids), "the orphaned server and worker stop")
