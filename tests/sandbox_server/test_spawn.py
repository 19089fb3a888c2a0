"""The compiled call set-up (``sandbox_server._spawn``), driven directly in this test process.

The server-level checks that it isolates a call exactly as the Python steps do are in test_hostile.py
(``test_both_call_setups_isolate_alike``); here: descriptors, limits, the failure report and bad specs.
"""

from __future__ import annotations

import json
import os
import resource
import sys

import pytest

from sandbox_server import isolation

spawn_module = pytest.importorskip(
    "sandbox_server._spawn", reason="the C helper is not built (no compiler at install time)"
)


def _spec(workdir: bytes = b"/", limits=((resource.RLIMIT_NOFILE, 64),)) -> tuple:
    # No namespaces, uid change or seccomp: what an unprivileged test process may do itself.
    return (-1, -1, 0, -1, None, workdir, limits, -1, 0, isolation.WORKER_PIDFD, isolation.CHILD_FD_END)


def _run(spec: tuple, child_body) -> tuple[int, str]:
    """Spawn a child that runs ``child_body()`` after the set-up: its exit code and its fd 1/2 output."""
    read_end, write_end = os.pipe()
    pidfd = os.pidfd_open(os.getpid())
    try:
        pid = spawn_module.spawn(spec, (1, write_end, 2, write_end, isolation.WORKER_PIDFD, pidfd), 7)
        if pid == 0:
            try:
                child_body()
            finally:
                os._exit(0)
    finally:
        os.close(write_end)
        os.close(pidfd)
    with os.fdopen(read_end, "rb") as pipe:
        output = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output


def test_child_keeps_only_its_descriptors_under_its_limits():
    def report():
        state = {
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
            "cpu": resource.getrlimit(resource.RLIMIT_CPU),
            "cwd": os.getcwd(),
            "session_leader": os.getsid(0) == os.getpid(),
        }
        os.write(1, json.dumps(state).encode())

    code, output = _run(_spec(), report)
    assert code == 0, output
    state = json.loads(output)
    # 0-2 and the one listdir opens (the lowest free); the worker pidfd is closed by the set-up.
    assert state["fds"] == [0, 1, 2, 3]
    assert state["nofile"] == [64, 64] and state["cpu"] == [7, 7]
    assert state["cwd"] == "/" and state["session_leader"]


def test_failed_step_is_reported_on_the_calls_stderr():
    code, output = _run(_spec(workdir=b"/no/such/dir"), lambda: print("ran anyway"))
    assert code == isolation.SETUP_FAILED_EXIT
    assert output == f"{isolation.SETUP_FAILED_MESSAGE} OSError: chdir: No such file or directory\n"


@pytest.mark.parametrize(
    "spec, targets, error",
    [
        ((1, 2), (1, 1), TypeError),  # too short a spec
        (_spec(limits=((1,),)), (1, 1), TypeError),  # a limit without its value
        (_spec(), (1,), ValueError),  # targets not in pairs
        (_spec(), (9, 1), ValueError),  # a target at or above CHILD_FD_END
        (_spec(), [1, 1], ValueError),  # not a tuple
    ],
)
def test_bad_specs_are_refused_before_forking(spec, targets, error):
    children_before = _child_count()
    with pytest.raises(error):
        spawn_module.spawn(spec, targets, 1)
    assert _child_count() == children_before


def _child_count() -> int:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        return len(f.read().split())


def test_plan_uses_the_helper_unless_told_not_to():
    sandbox = isolation.WorkerSandbox(isolation.Mechanisms(), [], None, None, None, None, None)
    config = {"tmp_mb": 8, "file_size_mb": 1, "nproc": 4, "nofile": 32}
    common = dict(uid=None, netns_fd=None, fresh_netns=False, workdir=None, memory_mb=64)
    native = isolation.CallSandbox.plan(sandbox, config, native=True, **common)
    assert native.native_spec is not None and native.native_spec[5] == b"/tmp"
    assert isolation.CallSandbox.plan(sandbox, config, native=False, **common).native_spec is None
    assert sys.platform.startswith("linux")
