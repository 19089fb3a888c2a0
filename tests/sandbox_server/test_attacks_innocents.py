"""Attacks on other calls' results (issue 20): each hostile program runs in the same batch as innocent calls,
and at the same time as a second batch of them; every innocent call must come back with its correct result,
and no worker may die.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import textwrap
import time
import urllib.request

import msgpack
import pytest

from sandbox_server import start_local
from sandbox_server.config import ServerConfig
from sandbox_server.pool import STUCK_GRACE_S
from tests.sandbox_server.conftest import (
    assert_clean,
    get,
    open_session,
    post,
    processes_in_uid_range,
    run_batch,
)

INNOCENTS = 12


def _innocent(i: int) -> dict:
    return {"code": f"import time\ntime.sleep(0.2)\nprint({i} * 7)", "timeout": 20}


def _assert_innocent(results: list[dict], offset: int = 0) -> None:
    for i, result in enumerate(results):
        assert result["status"] == "ok" and result["stdout"] == f"{(i + offset) * 7}\n", (i, result)


def attack_with_innocents(url: str, hostile: dict) -> dict:
    """Run ``hostile`` between innocent calls in one batch while a second innocent batch runs; returns the
    hostile call's result after checking every innocent one and that no worker was replaced."""
    workers_before = [w["pid"] for w in get(url, "/health")["workers"]]
    first = [_innocent(i) for i in range(INNOCENTS // 2)]
    second = [_innocent(i) for i in range(INNOCENTS // 2, INNOCENTS)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(run_batch, url, [_innocent(100 + i) for i in range(INNOCENTS)])
        results = run_batch(url, first + [hostile] + second)
        _assert_innocent(other.result(), offset=100)
    _assert_innocent(results[: len(first)])
    _assert_innocent(results[len(first) + 1 :], offset=len(first))
    assert [w["pid"] for w in get(url, "/health")["workers"]] == workers_before, "a worker died"
    return results[len(first)]


FORGE = textwrap.dedent(
    """
    import os
    records = [
        b'{"status": "ok", "error_type": null, "exit_code": 100000000000000000000000000000, '
        b'"exec_start": 0, "exec_end": 0}\\n',
        b'{"status": "ok", "error_type": "\\\\ud800", "exit_code": 0, "exec_start": 1e999, "exec_end": 0}\\n',
        b'{"status": "ok", "error_type": null, "exit_code": -5, "exec_start": 0, "exec_end": 0, "id": -1}\\n',
        b'{"status": "ok", "error_type": "' + b"x" * 100000 + b'", "exit_code": 0}\\n',
        b'\\xff\\xfe not json\\n',
    ]
    for fd in range(3, 16):
        for record in records:
            try:
                os.write(fd, record)
            except OSError:
                pass
    raise ValueError("the real outcome")
    """
)


def test_forged_result_records_change_nothing_but_their_own_call(server):
    result = attack_with_innocents(server.url, {"code": FORGE, "timeout": 10})
    assert result["status"] == "error" and result["error_type"] == "ValueError", result
    assert_clean(server.url)


def test_forged_record_as_last_word_cannot_crash_the_worker(server):
    code = FORGE.replace('raise ValueError("the real outcome")', "os._exit(0)")
    result = attack_with_innocents(server.url, {"code": code, "timeout": 10})
    assert result["status"] == "ok" and result["exit_code"] == 0, result  # no valid record: the exit status


SURROGATE_RECORD = (
    "import os\n"
    "os.write(3, b'{\"status\": \"error\", \"error_type\": \"E\\\\ud800\", \"exit_code\": 1, '\n"
    "            b'\"exec_start\": 0, \"exec_end\": 0}\\n')\n"
    "os._exit(1)\n"
)


def test_lone_surrogate_in_a_result_is_escaped_for_the_wire(server):
    result = attack_with_innocents(server.url, {"code": SURROGATE_RECORD, "timeout": 10})
    assert result["status"] == "error" and result["error_type"] == "E\\ud800", result
    for content_type in ("application/msgpack", "application/json"):
        request = {"code": SURROGATE_RECORD}
        body = msgpack.packb(request) if content_type == "application/msgpack" else request
        status, answer, _ = post(server.url, body, content_type=content_type)
        assert status == 200 and answer["error_type"] == "E\\ud800", answer


@pytest.mark.parametrize("code", ["x = 1", "print('\\ud800')"])
def test_lone_surrogates_in_output_are_replaced(server, code):
    result = attack_with_innocents(server.url, {"code": code, "timeout": 10})
    assert result["status"] == "ok", result
    result["stdout"].encode("utf-8")  # valid UTF-8


MEMFD_FILL = textwrap.dedent(
    """
    import os
    fds, block = [], b"x" * (1 << 20)
    for _ in range(200):  # 3 GiB in files of 15 MiB (under RLIMIT_FSIZE), never mapped: outside RLIMIT_AS
        fd = os.memfd_create("fill")
        for _ in range(15):
            os.write(fd, block)
        fds.append(fd)
    print("survived")
    """
)
# The kernel ends a memfd fill at its cgroup's limit in a second or two on an idle host, but took 22 s with
# 12 GiB of the host's memory in use elsewhere (reclaim is tried first): the fill gets a minute, so that a
# busy test machine sees the memory limit, not the call's timeout.
PIPE_FILL = textwrap.dedent(
    """
    import fcntl, os
    ends, block = [], b"x" * (1 << 16)
    for _ in range(120):
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            pass
        os.set_blocking(w, False)
        try:
            while True:
                os.write(w, block)
        except BlockingIOError:
            pass
        ends += [r, w]
    print("filled")
    """
)


def test_memfd_memory_counts_against_the_call(server):
    result = attack_with_innocents(server.url, {"code": MEMFD_FILL, "timeout": 60})
    mechanisms = get(server.url, "/health")["mechanisms"]["active"]
    if "call_memory_cgroup" not in mechanisms:
        pytest.skip("no per-call memory cgroup here (needs root and a memory cgroup)")
    assert result["status"] == "memory_limit" and "survived" not in result["stdout"], result
    assert_clean(server.url)


def test_filled_pipes_harm_no_other_call(server):
    result = attack_with_innocents(server.url, {"code": PIPE_FILL, "timeout": 20})
    assert result["status"] in ("ok", "memory_limit", "error"), result
    assert_clean(server.url)


# ------------------------------------------------------------------------ failures, input, configuration
def test_a_stopped_worker_fails_only_its_own_calls():
    """SIGSTOP one warm process: calls on the others return their results; its own are answered
    ``WorkerDied`` once the watchdog (timeout + grace) kills it, and it is restarted."""
    with start_local(workers=2, slots=4, tiers="base,full") as server:
        victim = next(w for w in get(server.url, "/health")["workers"] if w["tier"] == "base")
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            batch = [{"code": f"print({i} * 7)", "timeout": 1} for i in range(16)]
            started = time.monotonic()
            results = run_batch(server.url, batch)
            waited = time.monotonic() - started
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)
        ok = [i for i, r in enumerate(results) if r["status"] == "ok"]
        assert ok, results  # the other worker set served its share
        for i, result in enumerate(results):
            if i in ok:
                assert result["stdout"] == f"{i * 7}\n", result
            else:
                assert (result["status"], result["error_type"]) == ("killed", "WorkerDied"), result
        assert waited < 1 + STUCK_GRACE_S + 20
        deadline = time.monotonic() + 120
        while victim["pid"] in [w["pid"] for w in get(server.url, "/health")["workers"]]:
            assert time.monotonic() < deadline, "the stopped worker was never replaced"
            time.sleep(0.2)
        assert run_batch(server.url, batch)[3]["stdout"] == "21\n"


@pytest.mark.parametrize(
    "body, content_type, message",
    [
        (b"[" * 100000 + b"]" * 100000, "application/json", "malformed JSON"),
        (msgpack.packb({1: "a", "code": "print(1)"}), "application/msgpack", None),
        (b"\x81\x81\x01\x02\x03", "application/msgpack", "malformed msgpack"),  # a map used as a key
        (json.dumps({"requests": "x"}).encode(), "application/json", "must be a list"),
        (b'{"code": "1", "timeout": 1' + b"0" * 400 + b"}", "application/json", "'timeout' must be in"),
    ],
)
def test_bad_bodies_get_400_with_a_message(server, body, content_type, message):
    path = "/run/batch" if b"requests" in body else "/run"
    status, answer, _ = post(server.url, body, path=path, content_type=content_type)
    assert status == 400, answer
    assert message is None or message in answer["error"], answer


def test_an_unrepresentable_number_fails_only_its_own_item(server):
    huge = b"1" + b"0" * 400  # a JSON integer beyond any float
    body = b'{"requests": [{"code": "print(1)"}, {"code": "1", "timeout": %s}, {"code": "print(2)"}]}' % huge
    status, answer, _ = post(server.url, body, path="/run/batch")
    assert status == 200, answer
    first, bad, last = answer["results"]
    assert first["stdout"] == "1\n" and last["stdout"] == "2\n", answer
    assert bad["status"] == "invalid_request" and "'timeout' must be in" in bad["stderr"], bad


def test_metrics_stay_valid_json_whatever_a_call_reports(server):
    code = (
        "import os\n"
        "os.write(3, b'{\"status\": \"ok\", \"error_type\": null, \"exit_code\": 0, "
        "\"exec_start\": NaN, \"exec_end\": Infinity}\\n')\n"
    )
    assert run_batch(server.url, [{"code": code}])[0]["status"] == "ok"
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        json.loads(response.read(), parse_constant=lambda name: pytest.fail(f"{name} in /metrics"))


@pytest.mark.parametrize(
    "options, field",
    [
        ({"max_output_bytes": 1}, "max_output_bytes"),
        ({"max_timeout": 1e300}, "max_timeout"),
        ({"memory_mb": 1}, "memory_mb"),
        ({"output_limit_bytes": 300, "max_output_bytes": 4096}, "output_limit"),
    ],
)
def test_configuration_outside_sane_bounds_is_refused(options, field):
    with pytest.raises(ValueError, match=field):
        ServerConfig(**options)


def test_a_sigkilled_server_leaves_nothing_the_next_start_does_not_clean():
    with start_local(workers=1, slots=2, tiers="base,full") as first:
        health = get(first.url, "/health")
        session = open_session(first.url)  # a session process, frozen between calls where it can be
        assert run_batch(first.url, [{"code": "import os\nos.getuid()", **session}])[0]["status"] == "ok"
        session_uids = health["uid_ranges"]["sessions"]
        assert processes_in_uid_range(*session_uids)
        os.kill(health["server_pid"], signal.SIGKILL)
        first.process.wait(30)
        temp_root, cgroup = health["temp_root"], health["cgroup"]
        time.sleep(0.5)  # the workers die with their parent (parent-death signal)
        assert os.path.isdir(temp_root)
        with start_local(workers=1, slots=2, tiers="base,full"):
            assert not os.path.exists(temp_root)
            assert cgroup is None or not os.path.exists(cgroup)
            for path in health["session_cgroups"].values():  # freezer and cpuacct (cgroup v1)
                assert not os.path.exists(path), path
            deadline = time.monotonic() + 20  # thawed by the sweep, they die of their SIGKILL
            while processes_in_uid_range(*session_uids) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not processes_in_uid_range(*session_uids)


def test_io_uring_is_denied_and_the_worker_configuration_is_not_visible(server):
    code = textwrap.dedent(
        """
        import ctypes, sys
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)
        print(libc.syscall(425, 8, params), ctypes.get_errno())  # io_uring_setup
        print(sys.argv, any("uid_base" in arg or "{" in arg for arg in sys.orig_argv))
        """
    )
    result = attack_with_innocents(server.url, {"code": code, "timeout": 10})
    assert result["status"] == "ok", result
    setup, argv = result["stdout"].splitlines()
    assert setup == "-1 1", result  # EPERM
    assert argv.endswith(" False"), result
    assert "uid_base" not in result["stdout"] and "temp_root" not in result["stdout"]


def test_memfd_memory_counts_against_a_session_too(server):
    mechanisms = get(server.url, "/health")["mechanisms"]["active"]
    if "call_memory_cgroup" not in mechanisms:
        pytest.skip("no per-call memory cgroup here (needs root and a memory cgroup)")
    session = open_session(server.url)
    assert run_batch(server.url, [{"code": "kept = 1", **session}])[0]["status"] == "ok"
    fill = MEMFD_FILL.replace("range(200)", "range(250)")  # above the session's 2 GiB + tmpfs
    result = attack_with_innocents(server.url, {"code": fill, "timeout": 60, **session})
    assert result["status"] == "memory_limit" and "survived" not in result["stdout"], result
    assert "terminated" in result["stderr"]  # the session says it ended; the next call starts afresh
