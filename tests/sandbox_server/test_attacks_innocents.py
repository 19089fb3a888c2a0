"""Attacks on other calls' results (issue 20): each hostile program runs in the same batch as innocent calls,
and at the same time as a second batch of them; every innocent call must come back with its correct result,
and no worker may die.
"""

from __future__ import annotations

import concurrent.futures
import textwrap

import msgpack
import pytest

from tests.sandbox_server.conftest import assert_clean, get, post, run_batch

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
    result = attack_with_innocents(server.url, {"code": MEMFD_FILL, "timeout": 20})
    mechanisms = get(server.url, "/health")["mechanisms"]["active"]
    if "call_memory_cgroup" not in mechanisms:
        pytest.skip("no per-call memory cgroup here (needs root and a memory cgroup)")
    assert result["status"] == "memory_limit" and "survived" not in result["stdout"], result
    assert_clean(server.url)


def test_filled_pipes_harm_no_other_call(server):
    result = attack_with_innocents(server.url, {"code": PIPE_FILL, "timeout": 20})
    assert result["status"] in ("ok", "memory_limit", "error"), result
    assert_clean(server.url)
