"""Hostile programs: each must be contained with the right status, and leave nothing behind.

After every program a benign call must succeed, no process may remain under a per-call uid or as a
worker's child, no file may remain in the sandbox's temporary space, and the host must be unchanged
where the program tried to reach it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import textwrap
import urllib.parse
import uuid
from collections.abc import Callable

import pytest

from sandbox_server import isolation, start_local
from sandbox_server.config import ServerConfig
from tests.sandbox_server.conftest import MAIN_SERVER_OPTIONS, assert_clean, collapse_expected, get, run_code

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = f"sbx_probe_{uuid.uuid4().hex}"
SHORT = 2.0  # timeout for programs that never end by themselves


@dataclasses.dataclass
class Hostile:
    code: str
    status: str
    timeout: float = 5.0
    stdin: str = ""
    error_type: str | None = None
    check: Callable[[dict], bool] | None = None  # an extra condition on the result


def _py(source: str) -> str:
    return textwrap.dedent(source).strip()


#: Forks until the pid limit and keeps trying (here and in test_hardening's storm).
FORK_BOMB = _py("""
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
""")


def _stdout_has(text: str):
    return lambda result: text in result["stdout"]


def _host_path_absent(path: str):
    return lambda result: not os.path.exists(path)


def _head_and_tail_kept(result) -> bool:
    stdout = result["stdout"]
    return (
        "bytes of output omitted" in stdout
        and len(stdout) < 2 * 65536 + 200
        and stdout.startswith("x" * 1000)
        and stdout.rstrip().endswith("x" * 1000)
    )


FORGED_RECORD = '{"status": "ok", "error_type": null, "exit_code": 0, "exec_start": 0, "exec_end": 0}'

HOSTILE = {
    "infinite_loop": Hostile("while True:\n    pass", "timeout", SHORT, error_type="Timeout"),
    "long_numpy": Hostile(
        _py("""
            import numpy as np
            while True:
                np.linalg.svd(np.random.rand(300, 300))
        """),
        "timeout",
        SHORT,
    ),
    "sleep_forever": Hostile("import time\ntime.sleep(10**6)", "timeout", SHORT),
    "memory_bomb": Hostile("x = bytearray(8 * 1024**3)", "memory_limit", error_type="MemoryError"),
    "numpy_memory_bomb": Hostile("import numpy as np\nnp.ones((10**5, 10**5))", "memory_limit"),
    "raise_rlimit_then_allocate": Hostile(
        _py("""
            import resource
            try:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except (ValueError, OSError) as e:
                print("raise refused", type(e).__name__)
            x = bytearray(3 * 1024**3)
        """),
        "memory_limit",
        check=_stdout_has("raise refused"),
    ),
    "fork_bomb": Hostile(
        FORK_BOMB,
        "timeout",
        SHORT,
    ),
    "detached_grandchild": Hostile(
        _py("""
            import os, time
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(10**6)
                os._exit(0)
            print("parent done")
        """),
        "ok",
        check=_stdout_has("parent done"),
    ),
    # Holding the output pipe open must not keep the call alive: the call ends when its main process does.
    "grandchild_holding_stdout": Hostile(
        _py("""
            import os, time
            if os.fork() == 0:
                os.setsid()
                time.sleep(10**6)
            print("main exits")
        """),
        "ok",
        10.0,
        check=_stdout_has("main exits"),
    ),
    "ignore_signals": Hostile(
        _py("""
            import signal, time
            for s in (signal.SIGTERM, signal.SIGALRM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, signal.SIG_IGN)
            signal.alarm(1)
            while True:
                time.sleep(0.1)
        """),
        "timeout",
        SHORT,
    ),
    "kill_parent": Hostile(
        _py("""
            import os, signal
            for pid in (os.getppid(), 1, -1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError as e:
                    print(type(e).__name__)
            print("still here")
        """),
        "ok",
        check=_stdout_has("still here"),
    ),
    "signal_every_pid": Hostile(
        _py("""
            import os, signal
            hits = 0
            for pid in range(2, 70000):
                try:
                    os.kill(pid, signal.SIGTERM)
                    hits += 1
                except OSError:
                    pass
            print("signalled", hits)
        """),
        "ok",
        check=_stdout_has("signalled 0"),
    ),
    "output_flood_100mb": Hostile(
        _py("""
            import sys
            chunk = "x" * 65535 + "\\n"
            for _ in range(1600):
                sys.stdout.write(chunk)
        """),
        "output_limit",
        error_type="OutputLimit",
        check=_head_and_tail_kept,
    ),
    "non_utf8_output": Hostile(
        _py("""
            import sys
            sys.stdout.buffer.write(b"ok \\xff\\xfe\\xc3(\\n")
            sys.stderr.buffer.write(b"\\x80err\\n")
        """),
        "ok",
        check=lambda r: "\ufffd" in r["stdout"] and "\ufffd" in r["stderr"],
    ),
    "write_host_tmp": Hostile(
        f"open('/tmp/{PROBE}', 'w').write('x')\nprint('wrote private tmp')",
        "ok",
        check=_host_path_absent(f"/tmp/{PROBE}"),
    ),
    "write_working_tree": Hostile(
        f"open({os.path.join(REPO_ROOT, PROBE)!r}, 'w').write('x')",
        "error",
        check=_host_path_absent(os.path.join(REPO_ROOT, PROBE)),
    ),
    "read_working_tree": Hostile(f"print(open({os.path.join(REPO_ROOT, 'setup.py')!r}).read())", "error"),
    "read_etc_shadow": Hostile(
        "print(open('/etc/shadow').read())", "error", check=lambda r: "root:" not in r["stdout"]
    ),
    "user_namespace_escape": Hostile(
        _py("""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            for flags in (0x10000000, 0x40000000, 0x00020000):
                if libc.unshare(flags) == 0:
                    raise SystemExit(f"unshare({flags:#x}) succeeded")
            print("blocked")
        """),
        "ok",
        check=_stdout_has("blocked"),
    ),
    "setuid_root": Hostile("import os\nos.setuid(0)", "error", error_type="PermissionError"),
    "deep_recursion": Hostile("def f(n):\n    return f(n + 1)\nf(0)", "error", error_type="RecursionError"),
    "segfault_ctypes": Hostile("import ctypes\nctypes.string_at(0)", "killed", error_type="SIGSEGV"),
    "abort": Hostile("import os\nos.abort()", "killed"),
    "thread_spam": Hostile(
        _py("""
            import threading, time
            for _ in range(10000):
                threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
        """),
        "error",
        error_type="RuntimeError",
    ),
    "huge_stdin": Hostile(
        "import sys\nprint(len(sys.stdin.read()))", "ok", stdin="y" * 5_000_000, check=_stdout_has("5000000")
    ),
    "forged_result_markers": Hostile(
        _py(f"""
            import os
            fake = {FORGED_RECORD!r}.encode() + b"\\n"
            for fd in range(3, 64):
                try:
                    os.write(fd, fake)
                except OSError:
                    pass
            print(fake.decode())
            raise ValueError("the real outcome")
        """),
        "error",
        error_type="ValueError",
    ),
    "exit_code_300": Hostile(
        "import sys\nsys.exit(300)", "error", error_type="SystemExit", check=lambda r: r["exit_code"] == 44
    ),
    "os_exit_7": Hostile("import os\nos._exit(7)", "error", check=lambda r: r["exit_code"] == 7),
    "fd_exhaustion": Hostile(
        "fs = [open('/dev/null') for _ in range(100000)]", "error", error_type="OSError"
    ),
    "file_size_limit": Hostile(
        _py("""
            with open("big", "wb") as f:
                while True:
                    f.write(b"x" * 2**20)
        """),
        "error",
        error_type="OSError",
    ),
    "fill_tmpfs": Hostile(
        "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * (15 * 2**20))",
        "error",
        error_type="OSError",
    ),
    "scrubbed_environment": Hostile(
        "import os\nprint(sorted(os.environ))", "ok", check=lambda r: "SANDBOX_TEST_SECRET" not in r["stdout"]
    ),
}


@pytest.fixture(scope="module")
def listener():
    """A loopback TCP port on the host that no sandboxed call may reach."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def _assert_contained(server, result: dict, hostile: Hostile, workers_before: list) -> None:
    assert result["status"] == hostile.status, result
    if hostile.error_type is not None:
        assert result["error_type"] == hostile.error_type, result
    if hostile.check is not None:
        assert hostile.check(result), result
    benign = run_code(server.url, "print(6 * 7)")
    assert benign["status"] == "ok" and benign["stdout"] == "42\n", benign
    assert_clean(server.url)
    health = get(server.url, "/health")
    assert [w["pid"] for w in health["workers"]] == workers_before, "a worker died"
    assert server.process.poll() is None


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(server, name):
    hostile = HOSTILE[name]
    workers_before = [w["pid"] for w in get(server.url, "/health")["workers"]]
    result = run_code(server.url, hostile.code, stdin=hostile.stdin, timeout=hostile.timeout)
    _assert_contained(server, result, hostile, workers_before)


@pytest.mark.parametrize("target", ["server_port", "host_listener", "udp"])
def test_no_network(server, listener, target):
    port = {"server_port": urllib.parse.urlsplit(server.url).port, "host_listener": listener.getsockname()[1]}
    if target == "udp":
        code = (
            "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 53))"
        )
    else:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port[target]}), timeout=2)"
    workers_before = [w["pid"] for w in get(server.url, "/health")["workers"]]
    result = run_code(server.url, code)
    _assert_contained(server, result, Hostile(code, "error", error_type="OSError"), workers_before)
    assert "unreachable" in result["stderr"], result["stderr"]
    with pytest.raises(BlockingIOError):
        listener.accept()


def test_threads_are_stopped_by_the_process_limit_with_memory_to_spare(server):
    """RLIMIT_NPROC, not the address space, refuses the extra thread: a thread whose own start-up allocation
    fails would leave CPython's Thread.start() waiting until the timeout instead of raising."""
    code = _py("""
        import mmap, threading, time
        started = 0
        try:
            while True:
                threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
                started += 1
        except RuntimeError:
            pass
        spare = mmap.mmap(-1, 256 << 20)  # address space left after the last thread
        print(started)
    """)
    workers_before = [w["pid"] for w in get(server.url, "/health")["workers"]]
    result = run_code(server.url, code)
    _assert_contained(server, result, Hostile(code, "ok"), workers_before)
    assert int(result["stdout"]) == ServerConfig().nproc - 1  # every thread but the main one


IPC_KEY = 0x5B0C
LEAVE_FILE_AND_IPC = _py(f"""
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    open("left.txt", "w").write("x")
    def attempt(result):
        return "created" if result >= 0 else errno.errorcode[ctypes.get_errno()]
    print(attempt(libc.shmget({IPC_KEY}, 4096, 0o1600)), attempt(libc.msgget({IPC_KEY}, 0o1600)),
          attempt(libc.semget({IPC_KEY}, 1, 0o1600)),
          attempt(libc.mq_open(b"/sbx", 0o100 | 0o2, 0o600, None)), "left.txt" in os.listdir())
""")  # 0o1600: IPC_CREAT | 0600; 0o100 | 0o2: O_CREAT | O_RDWR
LOOK_FOR_FILE_AND_IPC = _py(f"""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    print(libc.shmget({IPC_KEY}, 0, 0), libc.msgget({IPC_KEY}, 0), libc.semget({IPC_KEY}, 0, 0),
          libc.mq_open(b"/sbx", 0o2), "left.txt" in os.listdir())
""")


def test_nothing_a_call_leaves_behind_reaches_the_next_calls(server):
    """Files in its /tmp die with the call; SysV IPC and message queues, whose objects would outlive it, are
    denied by seccomp. On an idle server consecutive calls get the same slot (the most recently freed one),
    so the later calls here run where the first one did."""
    assert run_code(server.url, LEAVE_FILE_AND_IPC)["stdout"] == "EPERM EPERM EPERM EPERM True\n"
    for _ in range(4):
        assert run_code(server.url, LOOK_FOR_FILE_AND_IPC)["stdout"] == "-1 -1 -1 -1 False\n"


def test_without_seccomp_ipc_objects_die_with_their_call(tmp_path, monkeypatch):
    """Where seccomp is unavailable each call gets a fresh IPC namespace: what it creates is gone after it."""
    # As on a machine without a syscall table: the server's processes start without the filter.
    (tmp_path / "sitecustomize.py").write_text(
        "import sandbox_server.linux as linux\nlinux.seccomp_filter = lambda: None\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with start_local(**dict(MAIN_SERVER_OPTIONS, workers=1, slots=1)) as bare:
        health = get(bare.url, "/health")
        assert "seccomp" in health["mechanisms"]["inactive"], health["mechanisms"]
        assert run_code(bare.url, LEAVE_FILE_AND_IPC)["stdout"] == "created created created created True\n"
        for _ in range(2):
            assert run_code(bare.url, LOOK_FOR_FILE_AND_IPC)["stdout"] == "-1 -1 -1 -1 False\n"


def _huge_page_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("AnonHugePages:"))


def test_fork_servers_keep_their_huge_pages_across_calls(server):
    """Each fork server re-collapses the windows its worker collapsed (``huge_page_mib``) and then writes to
    none of them: a write into a huge page shared with its calls would split its own mapping of it, and
    every later fork would copy 512 page-table entries for it."""
    base = [w for w in get(server.url, "/health")["workers"] if w["tier"] == "base"]
    if any(w["fork_server_pid"] is None for w in base) or not collapse_expected():
        pytest.skip(f"no fork server ({base[0]['call_setup']}), or no MADV_COLLAPSE here")
    for _ in range(40):
        assert run_code(server.url, "x = [str(i) for i in range(100)]")["status"] == "ok"
    kept = [_huge_page_bytes(w["fork_server_pid"]) >> 20 for w in base]
    assert all(k >= w["huge_page_mib"] > 0 for k, w in zip(kept, base, strict=True)), (kept, base)


ISOLATION_PROBE = _py("""
    import ctypes, errno, json, os, resource, socket
    libc = ctypes.CDLL(None, use_errno=True)
    def attempt(action):
        try:
            action()
            return "allowed"
        except OSError as error:
            return errno.errorcode[error.errno]
    def connect():
        socket.create_connection(("127.0.0.1", 22), timeout=1)
    open_fds = []
    for fd in range(64):
        try:
            os.fstat(fd)
            open_fds.append(fd)
        except OSError:
            pass
    print(json.dumps({
        "unprivileged": os.getuid() == os.getgid() == os.geteuid() != 0 and os.getgroups() == [],
        "limits": [resource.getrlimit(getattr(resource, "RLIMIT_" + name))
                   for name in ("AS", "FSIZE", "NPROC", "NOFILE", "CORE", "CPU")],
        "pid_and_session": [os.getpid(), os.getsid(0)],
        "cwd_and_tmp": [os.getcwd(), os.listdir("/tmp")],
        "fds": open_fds,
        "prctl": [libc.prctl(39, 0, 0, 0, 0), libc.prctl(3, 0, 0, 0, 0), libc.prctl(21, 0, 0, 0, 0)],
        "unshare_user": libc.unshare(0x10000000) == 0,
        "network": attempt(connect),
        "write_root": attempt(lambda: open("/escape", "w")),
        "sysv_ipc": errno.errorcode[ctypes.get_errno()] if libc.shmget(0, 4096, 0o1600) < 0 else "allowed",
        "env": sorted(os.environ),
    }, sort_keys=True))
""")  # prctl 39/3/21: PR_GET_NO_NEW_PRIVS, PR_GET_DUMPABLE, PR_GET_SECCOMP


def test_both_call_setups_isolate_alike(server):
    """The compiled set-up (``sandbox_server._spawn``, the default where it is built) and the Python steps
    leave a call in the same state; a few hostile programs are contained by both."""
    health = get(server.url, "/health")
    expected = "native"
    if isolation.native_spawn is None:
        expected = f"python: {isolation.NATIVE_UNAVAILABLE}"
    elif isolation.PYTHON_UNDER_TMP and "private_tmpfs" in health["mechanisms"]["active"]:
        expected = f"python: {isolation.PYTHON_UNDER_TMP_UNAVAILABLE}"  # e.g. a checkout cloned under /tmp
    workers = health["workers"]
    assert {w["call_setup"] for w in workers} == {expected}
    if expected == "native" and collapse_expected():  # sympy's heap is tens of MiB: some of it collapses
        assert all(w["huge_page_mib"] > 0 for w in workers if w["tier"] == "full"), workers
    native_probe = run_code(server.url, ISOLATION_PROBE)
    assert native_probe["status"] == "ok", native_probe
    options = dict(MAIN_SERVER_OPTIONS, workers=1, slots=2, call_setup="python")
    with start_local(**options) as python_server:
        python_workers = get(python_server.url, "/health")["workers"]
        assert {w["call_setup"] for w in python_workers} == {"python: --call-setup python"}
        assert {w["huge_page_mib"] for w in python_workers} == {0}  # no fork server to fork from huge pages
        python_probe = run_code(python_server.url, ISOLATION_PROBE)
        assert python_probe == dict(native_probe, duration=python_probe["duration"])
        for name in ("fork_bomb", "raise_rlimit_then_allocate", "read_etc_shadow", "write_host_tmp"):
            hostile = HOSTILE[name]
            workers_before = [w["pid"] for w in get(python_server.url, "/health")["workers"]]
            result = run_code(python_server.url, hostile.code, stdin=hostile.stdin, timeout=hostile.timeout)
            _assert_contained(python_server, result, hostile, workers_before)
    state = json.loads(native_probe["stdout"])
    # fd 3 is the call's own outcome-record pipe (runner.RECORD_FD)
    assert state["unprivileged"] and state["pid_and_session"] == [1, 1] and state["fds"] == [0, 1, 2, 3]
    assert state["prctl"] == [1, 0, 2] and not state["unshare_user"] and state["network"] == "ENETUNREACH"
    assert state["sysv_ipc"] == "EPERM"
    assert state["env"] == sorted({*isolation.SCRUBBED_ENV, "HOME", "TMPDIR"})  # not the worker's LD_BIND_NOW
