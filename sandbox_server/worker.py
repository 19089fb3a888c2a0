"""A warm worker: pre-imports its tier's modules, isolates itself once, then runs one child per call.

Started by the front end as ``python -m sandbox_server.worker``; talks to it over an inherited socketpair
with length-prefixed msgpack frames. Its calls are forked by its fork server (``isolation.ForkServer``, a
copy of the warm worker made once) or, without the C extension, by the worker itself; either way each call
is the worker's child. The worker is single-threaded (forking a threaded process is unsafe) and never
blocks on a call (only on the fork server's reply): one ``selectors`` loop watches the socket, every
child's output pipes and its pidfd, the fork server's pidfd, and the nearest deadline. Output is read as
it is produced into head/tail captures, so a call writing 100 MB costs the worker O(max_output_bytes)
memory and is killed at ``output_limit_bytes``.

Frames in:  {"op": "run", "id", "code", "compiled", "stdin", "timeout"}  (compiled: runner.precompile or None)
            {"op": "session_run", "id", "session", "uid", "create", "code", "stdin", "timeout"}
            {"op": "session_close", "session"}
Frames out: {"op": "ready", "pid", "tier", "mechanisms", "call_setup", "fork_server_pid", "huge_page_mib"}
            {"op": "result", "id", result fields..., "timings": {...}, "session_ended": reason | None}
``timings`` holds CLOCK_MONOTONIC stamps (comparable across processes) plus the call's CPU time and page
faults; the front end turns them into the phase breakdown of /metrics.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # must precede numpy's import: the worker has to stay single-threaded
if __name__ == "__main__":  # a warm worker; before the other imports, so that their arenas can be
    try:  # mapped by huge pages (see _spawn.c)
        from sandbox_server import _spawn

        _spawn.use_huge_page_arenas()
    except ImportError:  # no C extension: no fork server either
        pass

import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import heapq  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import selectors  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from sandbox_server import linux, runner  # noqa: E402
from sandbox_server.config import TIER_PRELOAD, TIER_WARMUP  # noqa: E402
from sandbox_server.framing import encode_frame, pack, split_frames, unpack  # noqa: E402
from sandbox_server.isolation import (  # noqa: E402
    SANDBOX_TMP,
    SETUP_FAILED_EXIT,
    SETUP_FAILED_MESSAGE,
    WORKER_PIDFD,
    CallSandbox,
    ForkServer,
    SessionControl,
    WorkerSandbox,
    fork_server_unavailable,
)
from sandbox_server.output import StreamCapture  # noqa: E402

READ_CHUNK = 1 << 16
BUDGET_CHECK_S = 0.2  # how often a running session call's CPU (all its processes) is checked
MAX_RECORD_BYTES = 1 << 16
MAX_ERROR_TYPE = 200  # characters of an exception type name kept in a record


@dataclasses.dataclass(eq=False)
class Call:
    """One request being served by a child process."""

    id: int
    timeout: float
    stdout: StreamCapture
    stderr: StreamCapture
    received: float
    fork_start: float = 0.0
    fork_end: float = 0.0
    deadline: float = math.inf
    kill_reason: str | None = None  # "timeout" | "output_limit" | "closed" | "cpu_budget"
    cpu_seconds: float | None = None
    page_faults: int = 0


@dataclasses.dataclass(eq=False)
class Child:
    """A live child process: a one-shot call, or a session serving calls one after another."""

    pid: int
    pidfd: int
    fds: dict  # open pipe read ends: fd -> "stdout" | "stderr" | "record"
    uid: int | None
    slot: int | None = None  # one-shot calls only
    workdir: str | None = None  # degraded mode: host directory to remove afterwards
    session: str | None = None
    control_fd: int | None = None
    call: Call | None = None
    record_buffer: bytearray = dataclasses.field(default_factory=bytearray)
    oom_counter_fd: int | None = None  # OOM-kill counter of the call's own memory cgroup, if it has one
    skipping_record: bool = False  # dropping the rest of an over-long line on the record pipe
    exited: bool = False
    control: SessionControl | None = None  # a session's freezer and CPU counter (all its processes)
    cpu_base: float = 0.0  # the counter when the session started


class Worker:
    def __init__(
        self,
        channel: int,
        sandbox: WorkerSandbox,
        config: dict,
        tier: str,
        stdio: tuple,
        session_uid_base: int | None = None,
    ):
        self.channel = channel  # the socketpair end, used through plain fd calls (no socket module)
        self.sandbox = sandbox
        self.config = config
        self.tier = tier
        self.stdio = stdio  # one-shot calls' sys.stdin/stdout/stderr (runner.make_stdio)
        self.selector = selectors.DefaultSelector()
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.free_slots = list(range(config["slots"]))[::-1]
        self.sessions: dict[str, Child] = {}
        self.lost_sessions: dict[str, str] = {}  # session id -> why its process ended between calls
        self.deadlines: list = []  # heap of (deadline, call id, child)
        self.metered: set[Child] = set()  # sessions with a call running, whose CPU budget is checked
        self.next_budget_check = 0.0
        self.worker_pidfd = os.pidfd_open(os.getpid())
        # OOM kills seen per counter: the server cgroup's (None) and each call cgroup's (its counter fd)
        counters = [oom_fd for _, oom_fd in sandbox.slot_cgroups + sandbox.session_cgroups]
        self.oom_kills_seen = {fd: sandbox.oom_kills(fd) for fd in [None, *counters]}
        self.session_uid_base = session_uid_base
        self.slot_plans: dict[int, CallSandbox] = {}
        self.native_unavailable = fork_server_unavailable(sandbox, config["call_setup"])  # None: fork server
        self.huge_page_bytes = 0  # of the warm heap, as the fork server started (ForkServer.collapse_heap)
        os.set_blocking(channel, False)
        self.selector.register(channel, selectors.EVENT_READ, self._on_channel)

    # ----------------------------------------------------------------------------------------- main loop
    def serve(self) -> None:
        mechanisms = self.sandbox.mechanisms.as_dict()
        self.fork_server = self._start_fork_server()
        self._send(
            {
                "op": "ready",
                "pid": os.getpid(),
                "tier": self.tier,
                "mechanisms": mechanisms,
                "call_setup": "native" if self.fork_server else f"python: {self.native_unavailable}",
                "fork_server_pid": self.fork_server.pid if self.fork_server else None,
                "huge_page_mib": self.huge_page_bytes >> 20,
            }
        )
        while True:
            timeout = max(0.0, self.deadlines[0][0] - time.monotonic()) if self.deadlines else None
            if self.metered:
                wait = max(0.0, self.next_budget_check - time.monotonic())
                timeout = wait if timeout is None else min(timeout, wait)
            for key, mask in self.selector.select(timeout):
                key.data(key.fileobj, mask)
            self._expire_deadlines()
            if self.metered and time.monotonic() >= self.next_budget_check:
                self.next_budget_check = time.monotonic() + BUDGET_CHECK_S
                for child in list(self.metered):
                    if self._over_budget(child):
                        self._kill(child, "cpu_budget")

    def _start_fork_server(self) -> ForkServer | None:
        """The fork server, where the extension is built and the configuration allows it (else None)."""
        if self.native_unavailable is not None:
            return None
        self.huge_page_bytes = ForkServer.collapse_heap()
        started = ForkServer.start(
            self.sandbox,
            self.worker_pidfd,
            (self.channel, self.selector.fileno(), *self.sandbox.worker_only_fds()),
        )
        if isinstance(started, bytes):  # in a call the server forked, isolated
            self._enter_call(unpack(started))
        self.selector.register(started.pidfd, selectors.EVENT_READ, self._on_fork_server_exit)
        return started

    def _on_fork_server_exit(self, pidfd: int, mask) -> None:
        self._fork_server_lost("exited")

    def _fork_server_lost(self, how: str) -> None:
        """Without its fork server a worker cannot start calls: it exits, and the front end restarts it
        (calls in flight are answered ``killed``)."""
        os.write(2, f"sandbox worker {os.getpid()}: fork server {how}; exiting\n".encode())
        os._exit(1)

    def _send(self, message: dict) -> None:
        self.outbox += encode_frame(message)
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        try:
            while self.outbox:
                del self.outbox[: os.write(self.channel, self.outbox)]
        except BlockingIOError:
            pass
        except OSError:  # the front end is gone; children die with us (parent-death signal)
            os._exit(0)
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.outbox else 0)
        self.selector.modify(self.channel, events, self._on_channel)

    def _on_channel(self, channel: int, mask) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush_outbox()
        if not mask & selectors.EVENT_READ:
            return
        try:
            data = os.read(channel, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            os._exit(0)
        self.inbox += data
        for message in split_frames(self.inbox):
            op = message["op"]
            if op == "run":
                self._start_call(message)
            elif op == "session_run":
                self._start_session_call(message)
            elif op == "session_close":
                self.lost_sessions.pop(message["session"], None)
                child = self.sessions.pop(message["session"], None)  # a new session may reuse the id at once
                if child is not None:
                    self._kill(child, "closed")
            else:
                raise ValueError(f"unknown op {op!r}")

    # ------------------------------------------------------------------------------------------ forking
    def _make_workdir(self, uid: int | None) -> str | None:
        """A host directory for the call when there is no private tmpfs (degraded mode)."""
        if self.sandbox.calls_dir is None:
            return None
        import tempfile  # degraded mode only: warm workers keep their imports (and forks) lean

        workdir = tempfile.mkdtemp(dir=self.sandbox.calls_dir)
        if uid is not None:
            os.chown(workdir, uid, uid)
        return workdir

    def _plan(
        self, *, uid, netns_fd, fresh_netns, workdir, memory_mb, cgroup_fd=None, cpu_cgroup_fd=None
    ) -> CallSandbox:
        return CallSandbox.plan(
            self.sandbox,
            self.config,
            uid=uid,
            netns_fd=netns_fd,
            fresh_netns=fresh_netns,
            workdir=workdir,
            memory_mb=memory_mb,
            native=self.native_unavailable is None,
            cgroup_fd=cgroup_fd,
            cpu_cgroup_fd=cpu_cgroup_fd,
        )

    def _slot_plan(self, slot: int, workdir: str | None) -> CallSandbox:
        """The isolation plan of a one-shot call in ``slot`` (prepared once per slot unless degraded)."""
        if workdir is None and slot in self.slot_plans:
            return self.slot_plans[slot]
        uid = None if self.sandbox.uid_base is None else self.sandbox.uid_base + slot
        netns = self.sandbox.slot_netns_fds[slot] if self.sandbox.slot_netns_fds else None
        cgroups = self.sandbox.slot_cgroups
        plan = self._plan(
            uid=uid,
            netns_fd=netns,
            fresh_netns=False,
            workdir=workdir,
            memory_mb=self.config["memory_mb"],
            cgroup_fd=cgroups[slot][0] if cgroups else None,
            cpu_cgroup_fd=self.sandbox.slot_cpu_fds[slot] if self.sandbox.slot_cpu_fds else None,
        )
        if workdir is None:
            self.slot_plans[slot] = plan
        return plan

    def _spawn(self, plan: CallSandbox, payload: list, cpu_seconds: int, control_r: int | None = None):
        """Fork an isolated child that runs ``payload`` (``_enter_call``); returns its ``Child``."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        rec_r, rec_w = os.pipe()
        targets = (1, out_w, 2, err_w, runner.RECORD_FD, rec_w, WORKER_PIDFD, self.worker_pidfd)
        if control_r is not None:
            targets += (runner.CONTROL_FD, control_r)
        try:
            if self.fork_server is not None and plan.native_plan is not None:
                pid = self.fork_server.fork(plan, targets, cpu_seconds, pack(payload))
            else:
                pid = plan.fork(self.sandbox, targets, cpu_seconds)
                if pid == 0:
                    self._enter_call(payload)
        except ConnectionError as error:
            self._fork_server_lost(f"unreachable ({error})")
        except OSError:
            for fd in (out_r, out_w, err_r, err_w, rec_r, rec_w):
                os.close(fd)
            raise
        for fd in (out_w, err_w, rec_w):
            os.close(fd)
        child = Child(
            pid=pid,
            pidfd=os.pidfd_open(pid),
            fds={out_r: "stdout", err_r: "stderr", rec_r: "record"},
            uid=plan.uid,
        )
        on_output = functools.partial(self._on_output, child)
        for fd in child.fds:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ, on_output)
        self.selector.register(child.pidfd, selectors.EVENT_READ, functools.partial(self._on_exit, child))
        return child

    def _start_call(self, message: dict) -> None:
        call = self._new_call(message)
        slot = self.free_slots.pop()
        workdir = self._make_workdir(None if self.sandbox.uid_base is None else self.sandbox.uid_base + slot)
        plan = self._slot_plan(slot, workdir)
        code, stdin = message["code"], message["stdin"]
        call.fork_start = time.monotonic()
        try:
            payload = ["run", plan.workdir, code, stdin, message["compiled"]]
            child = self._spawn(plan, payload, math.ceil(call.timeout) + 1)
        except OSError as error:  # e.g. EAGAIN: the host is out of processes
            self.free_slots.append(slot)
            _remove_workdir(workdir)
            self._send_result(call, "internal", stderr=f"sandbox: could not start the call: {error}\n")
            return
        call.fork_end = time.monotonic()
        child.slot, child.workdir = slot, workdir
        if self.sandbox.slot_cgroups:
            child.oom_counter_fd = self.sandbox.slot_cgroups[slot][1]
        self._attach(child, call)

    def _start_session_call(self, message: dict) -> None:
        call = self._new_call(message)
        sid = message["session"]
        child = self.sessions.get(sid)
        call.fork_start = time.monotonic()
        if message["create"] and child is not None:  # the front end forgot it; start over
            self._kill(self.sessions.pop(sid), "closed")
            child = None
        if child is None and not message["create"]:
            # The session process died between calls (e.g. its CPU budget ran out in a background thread).
            reason = self.lost_sessions.pop(sid, "ended")
            note = f"sandbox: session {sid!r} was terminated ({reason}); its state is lost\n"
            self._send_result(call, "killed", stderr=note, error_type="SessionLost", session_ended=reason)
            return
        self.lost_sessions.pop(sid, None)
        if child is None:
            child = self._start_session(sid, message["uid"])
            if child is None:
                self._send_result(call, "internal", stderr="sandbox: could not start the session process\n")
                return
        call.fork_end = time.monotonic()
        self._attach(child, call)
        if self._over_budget(child):  # used up between calls (only where its processes cannot be stopped)
            self._kill(child, "cpu_budget")
            return
        if child.control is not None:
            child.control.freeze(False)
            self.metered.add(child)
        request = runner.encode_control_message(
            {"id": call.id, "code": message["code"], "stdin": message["stdin"]}
        )
        try:
            _write_all(child.control_fd, request)
        except OSError:
            self._kill(child, None)  # the session process is gone; its exit event reports the call and why

    def _start_session(self, session: str, uid: int | None) -> Child | None:
        message_uid = uid
        cgroup = None
        if self.sandbox.session_cgroups and self.session_uid_base is not None:
            cgroup = self.sandbox.session_cgroups[uid - self.session_uid_base]
        uid = uid if self.sandbox.uid_base is not None else None
        workdir = self._make_workdir(uid)
        plan = self._plan(
            cgroup_fd=cgroup[0] if cgroup else None,
            uid=uid,
            netns_fd=None,
            fresh_netns="network_namespace" in self.sandbox.mechanisms,
            workdir=workdir,
            memory_mb=self.config["session_memory_mb"],
        )
        control_r, control_w = os.pipe()
        try:
            payload = ["session", plan.workdir]
            child = self._spawn(plan, payload, self.config["session_cpu_seconds"], control_r=control_r)
        except OSError:
            os.close(control_w)
            _remove_workdir(workdir)
            return None
        finally:
            os.close(control_r)
        child.session, child.control_fd, child.workdir = session, control_w, workdir
        child.oom_counter_fd = cgroup[1] if cgroup else None
        controls = self.sandbox.session_controls
        if controls and self.session_uid_base is not None and message_uid is not None:
            # before the session runs any code: everything it starts is frozen and counted with it
            child.control = controls[message_uid - self.session_uid_base]
            try:
                child.control.join(child.pid)
                child.cpu_base = child.control.cpu_seconds() or 0.0
            except OSError:
                self._kill(child, "closed")
                return None
        self.sessions[session] = child
        return child

    def _enter_call(self, payload: list) -> None:
        """In a new call, once isolated: run what ``payload`` says. Never returns."""
        kind, workdir = payload[0], payload[1]
        if workdir != SANDBOX_TMP:  # degraded mode; the worker's environment is already scrubbed for /tmp
            os.environ.update(HOME=workdir, TMPDIR=workdir)
        if kind == "run":
            runner.run_once(payload[2], payload[3], self.stdio, payload[4])
        else:
            runner.serve_session()

    def _new_call(self, message: dict) -> Call:
        keep = self.config["max_output_bytes"]
        return Call(
            id=message["id"],
            timeout=message["timeout"],
            stdout=StreamCapture(keep),
            stderr=StreamCapture(keep),
            received=time.monotonic(),
        )

    def _attach(self, child: Child, call: Call) -> None:
        child.call = call
        call.deadline = time.monotonic() + call.timeout
        heapq.heappush(self.deadlines, (call.deadline, call.id, child))

    # ------------------------------------------------------------------------------------------- events
    def _on_output(self, child: Child, fd: int, mask) -> None:
        if fd not in child.fds:  # closed by an earlier event of the same select() batch
            return
        self._read_fd(child, fd)
        if child.session is not None and child.call is not None and not child.exited:
            record = _take_record(child.record_buffer, child.call.id)
            if record is not None:
                self._drain(child)  # output written before the record is already in the pipes
                if self._over_budget(child):  # its exit reports the call
                    self._kill(child, "cpu_budget")
                    return
                call, child.call = child.call, None
                self.metered.discard(child)
                if child.control is not None:  # nothing of the session runs until its next call
                    child.control.freeze(True)
                self._finish(call, child, record=record, exit_status=None, session_ended=None)

    def _read_fd(self, child: Child, fd: int) -> int:
        """Read what is available on one of ``child``'s pipes: bytes read, 0 if none, -1 at end of stream."""
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return 0
        if not data:
            self.selector.unregister(fd)
            os.close(fd)
            del child.fds[fd]
            return -1
        kind = child.fds[fd]
        call = child.call
        if kind == "record":
            _feed_records(child, data)
        elif call is not None:  # a session's background output between calls is dropped
            (call.stdout if kind == "stdout" else call.stderr).feed(data)
            if call.stdout.total + call.stderr.total > self.config["output_limit_bytes"]:
                self._kill(child, "output_limit")
        return len(data)

    def _drain(self, child: Child) -> None:
        """Read what is already in the child's pipes, without blocking (bounded, for a live writer)."""
        reads = self.config["output_limit_bytes"] // READ_CHUNK + 2
        for fd in list(child.fds):
            for _ in range(reads):
                if fd not in child.fds or self._read_fd(child, fd) <= 0:
                    break

    def _on_exit(self, child: Child, pidfd: int, mask) -> None:
        self.selector.unregister(pidfd)
        _, status, usage = os.wait4(child.pid, 0)
        os.close(pidfd)
        child.exited = True
        self.metered.discard(child)
        self.sandbox.kill_leftovers(child.pid, child.uid)
        self._drain(child)
        for fd in child.fds:
            self.selector.unregister(fd)
            os.close(fd)
        child.fds.clear()
        if child.control_fd is not None:
            os.close(child.control_fd)
        if child.session is not None and self.sessions.get(child.session) is child:
            del self.sessions[child.session]
            if child.call is None:  # died while idle: tell the next call to this session
                self.lost_sessions[child.session] = _describe_exit(status)
        if child.slot is not None:
            self.free_slots.append(child.slot)
        _remove_workdir(child.workdir)
        call, child.call = child.call, None
        if call is None:
            return
        record = _take_record(child.record_buffer, call.id if child.session is not None else None)
        ended = None
        if child.session is not None and record is None:
            ended = call.kill_reason or _describe_exit(status)
        call.cpu_seconds = usage.ru_utime + usage.ru_stime  # the call's process tree, reaped ones included
        call.page_faults = usage.ru_minflt  # mostly copy-on-write copies of the warm parent's pages
        self._finish(call, child, record=record, exit_status=status, session_ended=ended)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, call_id, child = heapq.heappop(self.deadlines)
            if child.call is not None and child.call.id == call_id and not child.exited:
                self._kill(child, "timeout")

    def _kill(self, child: Child, reason: str | None) -> None:
        if child.call is not None and child.call.kill_reason is None:
            child.call.kill_reason = reason
        if child.exited:
            return
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        if child.control is not None:
            child.control.freeze(False)  # a frozen process dies of SIGKILL only once thawed
        if self.sandbox.own_pidns_fd is None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass

    # ------------------------------------------------------------------------------------------ results
    def _finish(
        self,
        call: Call,
        child: Child,
        *,
        record: dict | None,
        exit_status: int | None,
        session_ended: str | None,
    ) -> None:
        exit_code = record["exit_code"] if record is not None else None
        if exit_status is not None:
            exit_code = os.waitstatus_to_exitcode(exit_status)
        stderr = call.stderr.text()
        error_type = None
        if call.kill_reason is not None:
            status = {"output_limit": "output_limit", "closed": "killed"}.get(call.kill_reason, "timeout")
            error_type = {"output_limit": "OutputLimit", "closed": "SessionClosed"}.get(
                call.kill_reason, "Timeout"
            )
        elif record is not None:
            status, error_type = record["status"], wire_text(record["error_type"])
        elif exit_code is not None and exit_code < 0:
            status, error_type = self._classify_signal(-exit_code, child.oom_counter_fd)
        elif exit_code == SETUP_FAILED_EXIT and stderr.startswith(SETUP_FAILED_MESSAGE):
            status, error_type = "internal", "SandboxSetupFailed"
        else:
            status = "ok" if exit_code == 0 else "error"
        if call.kill_reason == "timeout":
            stderr += f"sandbox: killed after the {call.timeout:g} s timeout\n"
        elif call.kill_reason == "cpu_budget":
            stderr += (
                f"sandbox: killed: the session's processes used its {self.config['session_cpu_seconds']} s "
                "CPU budget\n"
            )
        elif call.kill_reason == "output_limit":
            stderr += f"sandbox: killed after more than {self.config['output_limit_bytes']} bytes of output\n"
        elif status == "timeout":
            stderr += "sandbox: killed at the CPU-time limit\n"
        elif status == "memory_limit" and record is None:
            stderr += "sandbox: killed by the out-of-memory killer (memory cgroup limit)\n"
        if session_ended is not None:
            stderr += (
                f"sandbox: session {child.session!r} was terminated ({session_ended}); its state is lost and "
                "the next call with this id starts a fresh session\n"
            )
        exit_seen = time.monotonic()
        timings = {
            "received": call.received,
            "fork_start": call.fork_start,
            "fork_end": call.fork_end,
            "exit_seen": exit_seen,
        }
        if record is not None:
            timings.update(exec_start=record["exec_start"], exec_end=record["exec_end"])
        if call.cpu_seconds is not None:
            timings.update(cpu_seconds=call.cpu_seconds, page_faults=call.page_faults)
        self._send_result(
            call,
            status,
            stdout=call.stdout.text(),
            stderr=stderr,
            exit_code=exit_code,
            error_type=error_type,
            duration=exit_seen - call.fork_start,
            timings=timings,
            session_ended=session_ended,
        )

    def _over_budget(self, child: Child) -> bool:
        """Whether a session's processes, all of them, have used its CPU budget."""
        if child.control is None or child.exited:
            return False
        used = child.control.cpu_seconds()
        return used is not None and used - child.cpu_base >= self.config["session_cpu_seconds"]

    def _classify_signal(self, signum: int, counter_fd: int | None) -> tuple[str, str]:
        name = _signal_name(signum)
        if signum == signal.SIGXCPU:
            return "timeout", name
        if signum == signal.SIGKILL:
            # The call's own cgroup (exact: nothing else runs in it), else the server's (any call's kill).
            oom_kills = self.sandbox.oom_kills(counter_fd)
            if oom_kills > self.oom_kills_seen.get(counter_fd, 0):
                self.oom_kills_seen[counter_fd] = oom_kills
                return "memory_limit", "OutOfMemory"
        return "killed", name

    def _send_result(
        self,
        call: Call,
        status: str,
        *,
        stdout="",
        stderr="",
        exit_code=None,
        error_type=None,
        duration=0.0,
        timings=None,
        session_ended=None,
    ) -> None:
        message = {
            "op": "result",
            "id": call.id,
            "status": status,
            "stdout": stdout,
            "stderr": stderr,
            "exit_code": exit_code,
            "error_type": error_type,
            "duration": duration,
            "timings": timings or {},
            "session_ended": session_ended,
        }
        try:
            self._send(message)
        except (ValueError, TypeError, OverflowError) as error:  # never one call's result kills the worker
            note = f"sandbox: the call's result could not be sent: {error}\n"
            self._send_result(call, "internal", stderr=note, error_type="BadResult")


def wire_text(text: str | None) -> str | None:
    """``text`` as valid UTF-8 for the wire: lone surrogates (an exception type may be named
    ``"\\ud800"``) become ``\\ud800`` escapes."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _remove_workdir(workdir: str | None) -> None:
    if workdir is not None:
        import shutil  # degraded mode only

        shutil.rmtree(workdir, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


def _describe_exit(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"


def _feed_records(child: Child, data: bytes) -> None:
    """Append ``data`` to the child's record buffer, bounded: past ``MAX_RECORD_BYTES`` only valid records
    (the last few) are kept, and an over-long line is dropped, so code writing junk to the record pipe can
    neither grow the worker nor push out the runner's own record."""
    if child.skipping_record:
        end = data.find(b"\n")
        if end < 0:
            return
        data, child.skipping_record = data[end + 1 :], False
    buffer = child.record_buffer
    buffer += data
    if len(buffer) <= MAX_RECORD_BYTES:
        return
    *lines, rest = bytes(buffer).split(b"\n")
    kept = [line for line in lines if _parse_record(line) is not None][-4:]
    if len(rest) > MAX_RECORD_BYTES:
        rest, child.skipping_record = b"", True
    buffer[:] = b"".join(line + b"\n" for line in kept) + rest


def _parse_record(line: bytes) -> dict | None:
    if len(line) > MAX_RECORD_BYTES:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if _valid_record(record) else None


def _take_record(buffer: bytearray, session_call_id: int | None) -> dict | None:
    """Consume the complete lines of ``buffer``; return the last valid outcome record among them.

    For a session only a record carrying the current call's id counts. A record is one JSON line
    written by the runner; anything else the code wrote to that descriptor is ignored.
    """
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest
    found = None
    for line in lines:
        record = _parse_record(line)
        if record is not None and (session_call_id is None or record.get("id") == session_call_id):
            found = record
    return found


def _valid_record(record) -> bool:
    """Whether ``record`` is a well-formed outcome record. The code runs in the process that writes the
    record, so it can write one too: only its own call's result can change, and only to a value that is
    valid here (a status it could reach anyway, bounded integers, finite times, a short error type name)."""
    if not isinstance(record, dict) or record.get("status") not in ("ok", "error", "memory_limit"):
        return False
    error_type, exit_code = record.get("error_type"), record.get("exit_code")
    if error_type is not None and not (isinstance(error_type, str) and 0 < len(error_type) <= MAX_ERROR_TYPE):
        return False
    if type(exit_code) is not int or not 0 <= exit_code <= 255:
        return False
    if "id" in record and (type(record["id"]) is not int or not 0 <= record["id"] < 2**63):
        return False
    return all(
        type(record.get(k)) in (int, float) and math.isfinite(record[k]) and abs(record[k]) < 1e12
        for k in ("exec_start", "exec_end")
    )


def main(argv=None) -> None:
    """Entry point; the single argument is a JSON spec written by the front end (``pool.WorkerProcess``):
    channel fd, tier, name, parent pid, temporary root, first uid, memory cgroup and the worker config.
    """
    spec = json.loads((argv or sys.argv[1:])[0])
    # Every call is a fork of this process: its code must not find the configuration in sys.argv.
    del sys.argv[1:]
    sys.orig_argv[:] = [arg for arg in sys.orig_argv if not arg.startswith("{")]
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != spec["parent_pid"]:
        sys.exit("sandbox worker: front end already gone")
    for module in TIER_PRELOAD[spec["tier"]]:
        importlib.import_module(module)
    exec(compile(TIER_WARMUP[spec["tier"]], "<warm-up>", "exec"), {})
    config = spec["config"]
    devnull = os.open(os.devnull, os.O_RDONLY)  # fd 0 of every one-shot call with an empty stdin
    os.dup2(devnull, 0)
    os.close(devnull)
    sandbox = WorkerSandbox.prepare(
        name=spec["name"],
        temp_root=spec["temp_root"],
        slots=config["slots"],
        uid_base=spec["uid_base"],
        cgroup_dir=spec["cgroup"],
        call_memory_bytes=((config["memory_mb"] + config["tmp_mb"]) << 20) * config["call_memory_cgroups"],
        sessions=config["max_sessions"] if spec["session_uid_base"] is not None else 0,
        session_memory_bytes=(config["session_memory_mb"] + config["tmp_mb"]) << 20,
        session_cgroup_dirs=spec.get("session_cgroups") or {},
        call_cpu_cgroups=bool(config["call_cpu_cgroups"]),
    )
    stdio = runner.make_stdio()
    runner.rehearse()
    gc.collect()
    gc.freeze()  # keep the collector from touching (and copying) the parent's objects in every child
    Worker(spec["channel"], sandbox, config, spec["tier"], stdio, spec["session_uid_base"]).serve()


if __name__ == "__main__":
    main()
