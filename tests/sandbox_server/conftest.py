"""Fixtures for the sandbox server tests: real server processes and host-side inspection helpers."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import msgpack
import pytest

from sandbox_server import start_local

# The main test server: default isolation, short limits so hostile programs end quickly.
MAIN_SERVER_OPTIONS = dict(
    workers=2, slots=8, default_timeout=5.0, memory_mb=1024, max_sessions=8, session_ttl=60.0
)


# Present in the server's environment; a call must never see it.
SECRET_ENV = {"SANDBOX_TEST_SECRET": "do-not-leak"}


@pytest.fixture(scope="session")
def server():
    with start_local(env=SECRET_ENV, **MAIN_SERVER_OPTIONS) as running:
        yield running


def post(url: str, payload, *, path: str = "/run", content_type: str = "application/json", headers=None):
    """POST raw bytes or a JSON-able payload; returns (http status, decoded body, response headers)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(
        url + path, data=body, headers={"Content-Type": content_type, **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, _decode(response.read(), response.headers), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, _decode(error.read(), error.headers), dict(error.headers)


def _decode(raw: bytes, headers):
    if headers.get("Content-Type", "").startswith("application/msgpack"):
        return msgpack.unpackb(raw)
    return json.loads(raw)


def run_code(url: str, code: str, **fields) -> dict:
    status, body, _ = post(url, {"code": code, **fields})
    assert status == 200, body
    return body


def run_batch(url: str, requests: list[dict]) -> list[dict]:
    status, body, _ = post(url, {"requests": requests}, path="/run/batch")
    assert status == 200, body
    return body["results"]


def open_session(url: str, headers=None) -> dict:
    """``POST /sessions``: the fields a call in the new session carries (``session``, ``session_token``)."""
    status, body, _ = post(url, b"", path="/sessions", headers=headers)
    assert status == 200, body
    return {"session": body["session"], "session_token": body["token"]}


def delete_session(url: str, session: dict, headers=None) -> tuple[int, dict]:
    """``DELETE /sessions/{id}`` with the session's token (``session`` as ``open_session`` returns it)."""
    token = {"X-Session-Token": session["session_token"]} if session.get("session_token") else {}
    request = urllib.request.Request(
        f"{url}/sessions/{urllib.parse.quote(session['session'], safe='')}",
        method="DELETE",
        headers={**token, **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=30) as response:
        return json.load(response)


def _proc_status_field(pid: str, field: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return line.split()[1]
    except OSError:
        return None
    return None


def processes_in_uid_range(lo: int, hi: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        uid = _proc_status_field(pid, "Uid")
        if uid is not None and lo <= int(uid) < hi:
            found.append(int(pid))
    return found


def collapse_expected() -> bool:
    """MADV_COLLAPSE exists (Linux 6.1+) and transparent huge pages are not switched off."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    return tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit()) >= (6, 1)


def children_of(parents: set[int], exclude_uids: range, exclude_pids: set[int]) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        ppid, uid = _proc_status_field(pid, "PPid"), _proc_status_field(pid, "Uid")
        if ppid is not None and int(ppid) in parents and uid is not None and int(uid) not in exclude_uids:
            if int(pid) not in exclude_pids:
                found.append(int(pid))
    return found


def leftovers(url: str) -> dict:
    """Everything a finished call could have left behind, as seen from the host.

    * processes running under any of the server's per-call uids (session processes live on by design);
    * children of the warm workers other than session processes and fork servers (every call is a direct child
      of its worker);
    * files in a worker's /tmp (its view, through /proc/<pid>/root) or in the host-side worker directories.
    """
    health = get(url, "/health")
    sessions = range(*health["uid_ranges"]["sessions"])
    workers = {w["pid"] for w in health["workers"]}
    files = {f"worker {pid} /tmp": os.listdir(f"/proc/{pid}/root/tmp") for pid in workers}
    temp_root = health["temp_root"]
    for name in os.listdir(temp_root):
        path = os.path.join(temp_root, name)
        files[path] = os.listdir(path) if os.path.isdir(path) else ["<not a directory>"]
    return {
        "uid_processes": processes_in_uid_range(*health["uid_ranges"]["calls"]),
        "worker_children": children_of(workers, sessions, {w["fork_server_pid"] for w in health["workers"]}),
        "files": {k: v for k, v in files.items() if v},
    }


def assert_clean(url: str, wait_s: float = 2.0) -> None:
    """No stray processes or files; allows ``wait_s`` for the kernel to finish tearing a namespace down."""
    deadline = time.monotonic() + wait_s
    while True:
        state = leftovers(url)
        if not any(state.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"sandbox left things behind: {state}")
        time.sleep(0.05)
