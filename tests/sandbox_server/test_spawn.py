"""The fork server (``sandbox_server._spawn``), driven directly: this test process plays the worker.

The server-level check that its calls are isolated exactly as the Python steps isolate them is
``test_both_call_setups_isolate_alike`` in test_hostile.py; here: the request/reply protocol, what a call
keeps, the failure report, bad requests, and the fork server's end; and the huge-page arenas of the warm
heap it forks from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sandbox_server import isolation
from tests.sandbox_server.conftest import children_of, collapse_expected

native = pytest.importorskip(
    "sandbox_server._spawn", reason="the extension is not built (no C compiler at install time)"
)


def _plan(workdir: str | None = "/", native: bool = True) -> isolation.CallSandbox:
    """No namespaces, uid change or seccomp: what an unprivileged test process may do itself."""
    sandbox = isolation.WorkerSandbox(isolation.Mechanisms(), [], None, None, None, None, None)
    config = {"tmp_mb": 8, "file_size_mb": 1, "nproc": 64, "nofile": 64}
    plan = isolation.CallSandbox.plan(
        sandbox, config, uid=None, netns_fd=None, fresh_netns=False, workdir=workdir, memory_mb=1 << 20,
        native=native,
    )  # fmt: skip
    return plan


# The fork server: a fresh interpreter (this test process may have threads, which a fork would not carry),
# so the calls it clones with CLONE_PARENT are this process's children. Each reports its state on fd 1.
FORK_SERVER = """
import json, os, resource, sys
from sandbox_server import _spawn
payload = _spawn.serve_forks(int(sys.argv[1]))
if payload is not None:  # in a call
    state = {
        "payload_size": len(payload),
        "payload_ok": payload == bytes(range(256)) * (len(payload) // 256),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "limits": [resource.getrlimit(r) for r in (resource.RLIMIT_NOFILE, resource.RLIMIT_CPU)],
        "cwd": os.getcwd(),
        "session_leader": os.getsid(0) == os.getpid(),
        "parent": os.getppid(),
    }
    os.write(1, json.dumps(state).encode())
"""


def _start_fork_server(script: str = FORK_SERVER) -> tuple[isolation.ForkServer, subprocess.Popen]:
    worker_end, server_end = native.socketpair()
    process = subprocess.Popen([sys.executable, "-c", script, str(server_end)], pass_fds=[server_end])
    os.close(server_end)
    return isolation.ForkServer(worker_end, process.pid), process


@pytest.fixture
def fork_server():
    server, process = _start_fork_server()
    yield server
    os.close(server.sock)
    assert process.wait(timeout=30) == 0  # it ends when the worker's end closes
    os.close(server.pidfd)


def _fork(server: isolation.ForkServer, plan: isolation.CallSandbox, payload: bytes) -> tuple[int, str]:
    """Request a call that reports on a pipe; its exit code and everything it wrote."""
    read_end, write_end = os.pipe()
    pidfd = os.pidfd_open(os.getpid())
    try:
        targets = (1, write_end, 2, write_end, isolation.WORKER_PIDFD, pidfd)
        pid = server.fork(plan, targets, 7, payload)
    finally:
        os.close(write_end)
        os.close(pidfd)
    with os.fdopen(read_end, "rb") as pipe:
        output = pipe.read().decode()
    _, status = os.waitpid(pid, 0)  # CLONE_PARENT: the call is this process's child, not the server's
    return os.waitstatus_to_exitcode(status), output


def _children() -> list[int]:
    return children_of({os.getpid()}, exclude_uids=range(0), exclude_pids=set())


def test_call_is_the_workers_child_with_only_its_descriptors_and_limits(fork_server):
    for size in (0, 256 * 40_000):  # the payload goes through a memfd, whatever its size
        code, output = _fork(fork_server, _plan(), bytes(range(256)) * (size // 256))
        assert code == 0, output
        state = json.loads(output)
        assert state["payload_size"] == size and state["payload_ok"]
        assert state["fds"] == [0, 1, 2, 3]  # 3: the one listdir opens; the worker pidfd was closed
        assert state["limits"] == [[64, 64], [7, 7]]
        assert state["cwd"] == "/" and state["session_leader"] and state["parent"] == os.getpid()


def test_failed_step_is_reported_on_the_calls_stderr(fork_server):
    code, output = _fork(fork_server, _plan(workdir="/no/such/dir"), b"")
    assert code == isolation.SETUP_FAILED_EXIT
    assert output == f"{isolation.SETUP_FAILED_MESSAGE} OSError: chdir: No such file or directory\n"
    assert _fork(fork_server, _plan(), b"")[0] == 0  # the server goes on


def test_bad_requests_are_refused_without_forking(fork_server):
    with pytest.raises(ValueError, match="packed FORK_REQUEST"):
        native.request_fork(fork_server.sock, b"short", (1,), b"")
    plan = _plan()
    bad_target = plan.native_plan + isolation.REQUEST_TAIL.pack(1, 1, 9, *[0] * 7, 0)  # 9 >= CHILD_FD_END
    children = _children()
    with pytest.raises(OSError) as error:
        native.request_fork(fork_server.sock, bad_target, (1,), b"")
    assert error.value.errno == 22 and not isinstance(error.value, ConnectionError)
    assert _children() == children
    assert _fork(fork_server, plan, b"")[0] == 0


def test_a_gone_fork_server_is_a_connection_error():
    server, process = _start_fork_server("pass")  # a fork server that ends at once
    process.wait(timeout=30)
    try:
        with pytest.raises(ConnectionError):
            _fork(server, _plan(), b"")
    finally:
        os.close(server.sock)
        os.close(server.pidfd)


def test_plan_is_packed_unless_python_is_asked_for_or_it_does_not_fit():
    packed = _plan(workdir=None).native_plan
    assert len(packed) == isolation.WIRE_PLAN.size
    assert isolation.WIRE_PLAN.unpack(packed)[-1].rstrip(b"\0") == b"/tmp"
    assert _plan(workdir=None, native=False).native_plan is None
    assert _plan(workdir="/" + "d" * isolation.WORKDIR_SIZE).native_plan is None  # left to the Python steps


HUGE_PAGE_ARENAS = """
import json, os
from sandbox_server import _spawn
CHUNK = 2 << 20
heap_end = max(int(l.split()[0].split("-")[1], 16) for l in open("/proc/self/maps") if "[heap]" in l)
_spawn.use_huge_page_arenas()
def private_anonymous():
    found = {}
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) == 5 and fields[1] == "rw-p":
            low, high = (int(x, 16) for x in fields[0].split("-"))
            found[low] = high
    return found
objects = [[i] for i in range(300_000)]  # ~30 MB of small objects: new arenas
blobs = [bytes(4000) for _ in range(2000)]  # ~7.7 MiB of objects over 512 bytes: glibc's heap
chunks = {low for low, high in private_anonymous().items() if low % CHUNK == 0 and high - low == CHUNK}
sample = objects[::1000]
in_chunks = sum(any(low <= id(o) < low + CHUNK for low in chunks) for o in sample)
collapsed = _spawn.collapse_huge_pages()
huge = next(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages:"))
heap_windows = {id(b) & -CHUNK for b in blobs if id(b) >= (heap_end + CHUNK - 1) & -CHUNK}  # grown since
heap_huge, in_heap = 0, False
for line in open("/proc/self/smaps"):
    fields = line.split()
    if "-" in fields[0] and not fields[0].endswith(":"):
        in_heap = fields[-1] == "[heap]"
    elif in_heap and fields[0] == "AnonHugePages:":
        heap_huge += int(fields[1]) * 1024
intact = all(o == [i] for i, o in enumerate(objects))
del objects, sample
left = len(chunks & set(private_anonymous()))
print(json.dumps({"chunks": len(chunks), "in_chunks": in_chunks, "sampled": 300, "collapsed": collapsed,
                  "huge": huge * 1024, "heap_huge": heap_huge, "heap_windows": len(heap_windows),
                  "intact": intact, "left": left}))
"""


def test_huge_page_arenas_place_collapse_and_release_the_heap():
    run = subprocess.run([sys.executable, "-c", HUGE_PAGE_ARENAS], capture_output=True, text=True, check=True)
    figures = json.loads(run.stdout)
    assert figures["chunks"] >= 10, figures  # arenas made after the call sit in 2 MiB-aligned chunks
    assert figures["in_chunks"] >= 0.9 * figures["sampled"], figures
    assert figures["intact"], figures
    assert figures["collapsed"] % (2 << 20) == 0, figures
    if collapse_expected():
        assert figures["collapsed"] >= 10 * (2 << 20), figures
        assert figures["huge"] >= figures["collapsed"], figures  # nothing forked: no window split since
        # the program break was moved to 2 MiB boundaries, before the blobs and after: their windows are whole
        assert figures["heap_windows"] >= 3, figures
        assert figures["heap_huge"] >= figures["heap_windows"] * (2 << 20), figures
    assert figures["left"] <= figures["chunks"] // 4, figures  # freed arenas give their chunks back
