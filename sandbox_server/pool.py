"""The front end's side of the workers: spawning, routing, the bounded queue, sessions and restarts.

Everything here runs on the front end's event loop and never blocks on execution: a call is a future that
a worker's result frame resolves. Each worker set has one warm process per tier and ``slots`` calls in
flight across them; calls beyond that wait in one FIFO queue bounded by ``max_queue`` (``QueueFull``
makes the HTTP layer answer 503). Session calls bypass the queue (their count is bounded by
``max_sessions``) and always go to the full tier of the worker set that holds the session.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from sandbox_server import runner, schema
from sandbox_server.config import ServerConfig, choose_tier
from sandbox_server.framing import encode_frame, read_frame
from sandbox_server.isolation import MALLOC_ENV
from sandbox_server.metrics import Metrics

WORKER_START_TIMEOUT_S = 120.0
STUCK_GRACE_S = 10.0  # beyond a call's timeout, before its silent worker is declared stuck
WATCHDOG_PERIOD_S = 1.0  # how often each worker's overdue calls are looked for
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
TOMBSTONES_KEPT = 4096
WORKER_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "PYTHONHASHSEED")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _same_token(expected: str, supplied: str) -> bool:
    """Constant-time comparison; a supplied token may hold any characters, lone surrogates included."""
    return hmac.compare_digest(expected.encode(), supplied.encode("utf-8", "surrogatepass"))


def _fresh_note(sid: str, reason: str) -> str:
    return f"sandbox: note: session {sid!r} was {reason}; this call started a fresh session\n"


class QueueFull(Exception):
    """The bounded queue cannot take these calls now; retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: float):
        super().__init__(f"queue full, retry after {retry_after:g} s")
        self.retry_after = retry_after


def _internal(message: str, status: str = "internal", error_type: str | None = None) -> dict:
    return schema.make_result(status, stderr=f"sandbox: {message}\n", error_type=error_type)


class WorkerProcess:
    """One warm process (one tier of one worker set) and the socket to it."""

    def __init__(self, pool: Pool, index: int, tier: str, tier_position: int):
        self.pool = pool
        self.index = index
        self.tier = tier
        self.name = f"w{index}-{tier}"
        self.uid_base = pool.first_uid + (index * len(pool.tiers) + tier_position) * pool.config.slots
        self.process: subprocess.Popen | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.pending: dict[int, tuple[asyncio.Future, float]] = {}  # call id -> (result, stuck after)
        self.ready = False
        self.pid: int | None = None
        self.mechanisms: dict = {}
        self.call_setup: str | None = None  # "native" (a fork server) or "python: <why>" (the worker forks)
        self.fork_server_pid: int | None = None
        self.huge_page_mib = 0  # of the warm heap the fork server forks from
        self.generation = 0

    async def start(self) -> None:
        parent_end, child_end = socket.socketpair()
        spec = {
            "channel": child_end.fileno(),
            "tier": self.tier,
            "name": f"{self.name}.{self.generation}",
            "parent_pid": os.getpid(),
            "temp_root": self.pool.temp_root,
            "uid_base": self.uid_base,
            "cgroup": self.pool.cgroup_dir,
            "session_cgroups": self.pool.session_cgroup_dirs,
            "session_uid_base": self.pool.session_uid_base if self.tier == "full" else None,
            "config": self.pool.config.worker_payload(),
        }
        args = [sys.executable, "-m", "sandbox_server.worker", json.dumps(spec)]
        # Only what Python needs: a worker's environment is inherited by every call (scrubbed again there).
        env = {name: os.environ[name] for name in WORKER_ENV if name in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")]))
        env.update(MALLOC_ENV)  # read by glibc at start-up, so it has to be set before the worker starts
        # Bind every library symbol at start-up: a call that first used one would bind it lazily, looking it
        # up through every loaded library and writing (copying) a GOT page. Calls never see this variable.
        env["LD_BIND_NOW"] = "1"
        self.generation += 1
        try:
            # A plain Popen watched through a pidfd: no asyncio child watcher, which would race with Popen.
            self.process = subprocess.Popen(
                args, pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, env=env
            )
        finally:
            child_end.close()
        reader, self.writer = await asyncio.open_unix_connection(sock=parent_end)
        try:
            hello = await asyncio.wait_for(read_frame(reader), WORKER_START_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as error:
            await self._reap()
            raise RuntimeError(f"worker {self.name} did not start: {error!r}") from error
        self.pid, self.mechanisms, self.call_setup = hello["pid"], hello["mechanisms"], hello["call_setup"]
        self.fork_server_pid, self.huge_page_mib = hello["fork_server_pid"], hello["huge_page_mib"]
        self.ready = True
        self.pool.spawn_background(self._read_results(reader))
        self.pool.spawn_background(self._watch())

    def send(self, message: dict) -> asyncio.Future:
        """Hand a call to the worker; the future gets its result frame. A worker that has not answered
        ``STUCK_GRACE_S`` after the call's timeout (stopped, wedged) is killed: its running calls are
        answered ``killed``/``WorkerDied`` and it is restarted, while other workers' calls, finished ones of
        the same batch included, are unaffected."""
        future = asyncio.get_running_loop().create_future()
        self.pending[message["id"]] = (future, time.monotonic() + message["timeout"] + STUCK_GRACE_S)
        self.writer.write(encode_frame(message))
        return future

    async def _watch(self) -> None:
        """Kill the worker once a call of it is overdue (one periodic check, not a timer per call: the
        deadline needs no more precision than a second on top of ``STUCK_GRACE_S``)."""
        process = self.process
        while self.process is process and process.poll() is None:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = time.monotonic()
            if any(deadline < now for _, deadline in self.pending.values()) and process.poll() is None:
                print(
                    f"sandbox_server: worker {self.name} did not answer in time; killing it", file=sys.stderr
                )
                process.send_signal(signal.SIGKILL)  # _read_results answers its calls and restarts it
                return

    def notify(self, message: dict) -> None:
        if self.ready:
            self.writer.write(encode_frame(message))

    async def _read_results(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message = await read_frame(reader)
                message["returned"] = time.monotonic()
                future, _ = self.pending.pop(message["id"], (None, None))
                if future is not None and not future.done():
                    future.set_result(message)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            self.ready = False
            pending, self.pending = self.pending, {}
            for future, _ in pending.values():
                if not future.done():
                    future.set_result(_internal("its worker died; it was replaced", "killed", "WorkerDied"))
            await self._reap()
            self.pool.on_worker_exit(self)

    async def _reap(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.kill()
        await self.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)

    async def wait(self) -> None:
        """Wait for the process to exit (without blocking the event loop) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            pidfd = os.pidfd_open(self.process.pid)
        except ProcessLookupError:
            self.process.wait()
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            await exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self.process.wait()


@dataclasses.dataclass
class WorkerSet:
    index: int
    processes: dict  # tier -> WorkerProcess
    inflight: int = 0
    sessions: int = 0

    def tiers_ready(self) -> tuple[str, ...]:
        return tuple(tier for tier, process in self.processes.items() if process.ready)


@dataclasses.dataclass
class Session:
    id: str
    token: str  # the capability: every call and the close must present it
    worker: WorkerSet
    uid_index: int
    last_used: float
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    busy: int = 0
    started: bool = False  # the worker has a process for it (False: the next call starts one)
    note: str = ""  # why its process ended, told to the next call (which starts a fresh one)


class SessionsFull(Exception):
    """``max_sessions`` sessions are open (none is evicted to make room)."""


def _session_not_found(sid: str) -> dict:
    # The same answer for an unknown id and a wrong token: it tells a guesser nothing.
    return _internal(
        f"no session {sid!r} with this token (open one with POST {schema.PATH_SESSIONS} and present its "
        "token as 'session_token')",
        "invalid_request",
        schema.SESSION_NOT_FOUND,
    )


@dataclasses.dataclass
class QueuedCall:
    request: dict
    future: asyncio.Future
    stamps: dict


class Pool:
    def __init__(
        self,
        config: ServerConfig,
        temp_root: str,
        cgroup_dir: str | None,
        metrics: Metrics,
        session_cgroup_dirs: dict | None = None,
    ):
        self.config = config
        self.temp_root = temp_root
        self.cgroup_dir = cgroup_dir
        self.session_cgroup_dirs = session_cgroup_dirs or {}  # controller -> the server's v1 cgroup
        self.metrics = metrics
        self.tiers = config.tier_list
        self.first_uid = config.first_uid(os.getpid())
        self.worker_sets = [
            WorkerSet(i, {tier: WorkerProcess(self, i, tier, n) for n, tier in enumerate(self.tiers)})
            for i in range(config.workers)
        ]
        self.queue: collections.deque[QueuedCall] = collections.deque()
        self.call_ids = itertools.count(1)
        self.sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()  # LRU order
        self.free_session_uids = list(range(config.max_sessions))[::-1]
        # closed sessions: id -> (token, why), so that their owner (only) learns why
        self.tombstones: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.closing = False
        self._background: set[asyncio.Task] = set()

    @property
    def session_uid_base(self) -> int:
        return self.first_uid + self.config.workers * len(self.tiers) * self.config.slots

    def uid_ranges(self) -> dict:
        """Half-open uid ranges: one uid per slot of each warm process, one per session."""
        return {
            "calls": [self.first_uid, self.session_uid_base],
            "sessions": [self.session_uid_base, self.session_uid_base + self.config.max_sessions],
        }

    def processes(self):
        for worker_set in self.worker_sets:
            yield from worker_set.processes.values()

    async def start(self) -> None:
        await asyncio.gather(*(process.start() for process in self.processes()))
        self.spawn_background(self._expire_sessions())

    def mechanisms(self) -> dict:
        """What the workers report (they all run the same probes; the first ready one speaks for all, a
        ``full`` tier one first: only those hold sessions and report the session mechanisms)."""
        for process in sorted(self.processes(), key=lambda p: p.tier != "full"):
            if process.mechanisms:
                return process.mechanisms
        return {"active": [], "inactive": {}}

    async def close(self) -> None:
        """Stop everything; calls still queued or running are answered (``internal`` / ``killed``)."""
        self.closing = True
        for task in self._background:
            task.cancel()
        while self.queue:
            queued = self.queue.popleft()
            if not queued.future.done():
                queued.future.set_result(_internal("the server is shutting down"))
        for process in self.processes():
            process.kill()
        await asyncio.gather(*(process.wait() for process in self.processes()))

    def spawn_background(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----------------------------------------------------------------------------------------- one-shot
    def free_slots(self) -> int:
        return sum(max(0, self.config.slots - ws.inflight) for ws in self.worker_sets if ws.tiers_ready())

    def admit(self, requests: list[dict]) -> None:
        """Raise ``QueueFull`` unless every one-shot call in ``requests`` can run or wait in the queue."""
        one_shot = sum(1 for r in requests if r["session"] is None)
        overflow = max(0, one_shot - self.free_slots())
        if overflow and len(self.queue) + overflow > self.config.max_queue:
            raise QueueFull(retry_after=1.0)

    async def run(self, request: dict, admitted: float) -> dict:
        """Run one validated request (after ``admit``); returns the wire result."""
        stamps = {"admitted": admitted}
        if request["session"] is not None:
            message = await self._run_in_session(request, stamps)
        else:
            future = asyncio.get_running_loop().create_future()
            self.queue.append(QueuedCall(request, future, stamps))
            self._pump()
            message = await future
        result = schema.make_result(**{name: message[name] for name in schema.RESULT_FIELDS})
        stamps.update(message.get("timings") or {}, returned=message.get("returned"))
        self.metrics.observe_call(result["status"], time.monotonic() - admitted, stamps)
        return result

    def _pump(self) -> None:
        """Dispatch queued calls, oldest first, each to the least busy worker set that can serve it."""
        while self.queue:
            queued = self.queue[0]
            best = None
            for worker_set in self.worker_sets:
                if worker_set.inflight >= self.config.slots:
                    continue
                tier = choose_tier(queued.request["code"], worker_set.tiers_ready())
                if tier is not None and (best is None or worker_set.inflight < best[0].inflight):
                    best = (worker_set, tier)
            if best is None:  # all busy, or the tier it needs is restarting everywhere
                return
            self.queue.popleft()
            worker_set, tier = best
            worker_set.inflight += 1
            queued.stamps["dispatched"] = time.monotonic()
            code = queued.request["code"]
            future = worker_set.processes[tier].send(
                {
                    "op": "run",
                    "id": next(self.call_ids),
                    "code": code,
                    "compiled": runner.precompile(code, self.config.precompile_max_chars),
                    "stdin": queued.request["stdin"],
                    "timeout": queued.request["timeout"],
                }
            )
            future.add_done_callback(lambda f, ws=worker_set, q=queued: self._on_done(ws, q, f))

    def _on_done(self, worker_set: WorkerSet, queued: QueuedCall, future: asyncio.Future) -> None:
        worker_set.inflight -= 1
        if not queued.future.done():
            queued.future.set_result(future.result())
        self._pump()

    # ----------------------------------------------------------------------------------------- sessions
    def _owned(self, sid: str, token: str | None) -> Session | None:
        """The session ``sid`` if ``token`` is its token (compared in constant time), else None."""
        session = self.sessions.get(sid)
        if session is None or token is None or not _same_token(session.token, token):
            return None
        return session

    async def _run_in_session(self, request: dict, stamps: dict) -> dict:
        sid, token = request["session"], request["session_token"]
        session = self._owned(sid, token)
        if session is None:
            tomb = self.tombstones.get(sid)
            if tomb is not None and token is not None and _same_token(tomb[0], token):
                return _internal(
                    f"session {sid!r} was {tomb[1]}; its state is lost (open a new session)",
                    "killed",
                    schema.SESSION_CLOSED,
                )
            return _session_not_found(sid)
        session.busy += 1
        try:
            async with session.lock:
                if self.sessions.get(sid) is not session:  # closed while this call waited for the lock
                    reason = self.tombstones.get(sid, (None, "closed"))[1]
                    return _internal(f"session {sid!r} was {reason}", "killed", schema.SESSION_CLOSED)
                self.sessions.move_to_end(sid)
                process = session.worker.processes["full"]
                stamps["dispatched"] = time.monotonic()
                note, session.note = session.note, ""
                if not process.ready:
                    message = _internal(
                        "the session's worker is restarting; the session's state is lost",
                        "killed",
                        "WorkerDied",
                    )
                    session.started, session.note = False, _fresh_note(sid, "lost when its worker restarted")
                else:
                    create, session.started = not session.started, True  # before awaiting: a close kills it
                    message = await process.send(
                        {
                            "op": "session_run",
                            "id": next(self.call_ids),
                            "session": sid,
                            "code": request["code"],
                            "stdin": request["stdin"],
                            "timeout": request["timeout"],
                            "uid": self.session_uid_base + session.uid_index,
                            "create": create,
                        }
                    )
                    if message.get("session_ended"):
                        reason = f"terminated earlier ({message['session_ended']})"
                        session.started, session.note = False, _fresh_note(sid, reason)
                if note:
                    message = dict(message, stderr=note + message["stderr"])
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()
        return message

    def open_session(self) -> dict:
        """A new session: ``{"session": id, "token": token}`` (both unguessable). With ``max_sessions``
        open, sessions idle past ``session_ttl`` are closed first; if none is, ``SessionsFull``: a client
        opening sessions never closes another client's (idle is not abandoned: a rollout's session idles
        while its model generates)."""
        if len(self.sessions) >= self.config.max_sessions:
            self._close_expired()
        if len(self.sessions) >= self.config.max_sessions:
            raise SessionsFull(f"all {self.config.max_sessions} sessions are open; retry later")
        worker_set = min(
            (ws for ws in self.worker_sets if "full" in ws.tiers_ready()),
            key=lambda ws: ws.sessions,
            default=self.worker_sets[0],
        )
        sid = secrets.token_urlsafe(12)
        while sid in self.sessions or sid in self.tombstones:
            sid = secrets.token_urlsafe(12)
        session = Session(
            sid, secrets.token_urlsafe(32), worker_set, self.free_session_uids.pop(), time.monotonic()
        )
        worker_set.sessions += 1
        self.sessions[sid] = session
        return {schema.SESSION_KEY: sid, schema.SESSION_TOKEN_KEY: session.token}

    def _close(self, session: Session, reason: str) -> None:
        """End ``session``: its process is killed (resources freed with it), its owner learns ``reason``."""
        if self.sessions.get(session.id) is not session:
            return
        del self.sessions[session.id]
        session.worker.sessions -= 1
        self.free_session_uids.append(session.uid_index)
        self.tombstones[session.id] = (session.token, reason)
        while len(self.tombstones) > TOMBSTONES_KEPT:
            self.tombstones.popitem(last=False)
        if session.started:
            session.worker.processes["full"].notify({"op": "session_close", "session": session.id})

    def close_session(self, sid: str, token: str | None) -> bool:
        """Close ``sid`` if ``token`` is its token; False (and nothing touched) otherwise."""
        session = self._owned(sid, token)
        if session is None:
            return False
        self._close(session, "closed by its client")
        return True

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.session_ttl / 4, 5.0))
            self._close_expired()

    def _close_expired(self) -> None:
        ttl, now = self.config.session_ttl, time.monotonic()
        for session in list(self.sessions.values()):
            if not session.busy and now - session.last_used > ttl:
                self._close(session, f"closed after {ttl:g} s idle")

    # ------------------------------------------------------------------------------------------ restarts
    def on_worker_exit(self, process: WorkerProcess) -> None:
        if self.closing:
            return
        self.metrics.worker_restarts += 1
        if process.tier == "full":
            for session in self.sessions.values():
                if session.worker.processes["full"] is process and session.started:
                    session.started = False
                    session.note = _fresh_note(session.id, "lost when its worker restarted")
        self.spawn_background(self._restart(process))

    async def _restart(self, process: WorkerProcess) -> None:
        for delay in itertools.chain(RESTART_BACKOFF_S, itertools.repeat(RESTART_BACKOFF_S[-1])):
            if self.closing:
                return
            try:
                await process.start()
                self._pump()
                return
            except (OSError, RuntimeError) as error:
                print(
                    f"sandbox_server: restarting {process.name} failed: {error}", file=sys.stderr, flush=True
                )
                await asyncio.sleep(delay)

    def describe_workers(self) -> list[dict]:
        return [
            {
                "worker": p.index,
                "tier": p.tier,
                "pid": p.pid,
                "ready": p.ready,
                "inflight": len(p.pending),
                "call_setup": p.call_setup,
                "fork_server_pid": p.fork_server_pid,
                "huge_page_mib": p.huge_page_mib,
            }
            for p in self.processes()
        ]
