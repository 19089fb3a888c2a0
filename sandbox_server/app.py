"""The aiohttp front end: wire decoding, validation, admission, and the server's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import msgpack
from aiohttp import web

from sandbox_server import schema
from sandbox_server.config import ServerConfig
from sandbox_server.metrics import Metrics
from sandbox_server.pool import Pool, QueueFull, SessionsFull


def _decode_body(body: bytearray, content_type: str):
    """The request object; a body that does not decode is ``_BadRequest`` (400) with the decoder's message."""
    try:
        if content_type == schema.CONTENT_TYPE_MSGPACK:
            return msgpack.unpackb(body, raw=False, unicode_errors="surrogatepass", max_array_len=1 << 20)
        return json.loads(body)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as error:
        # malformed, nested too deep, or a map whose keys cannot be keys (mixed or unhashable)
        kind = "msgpack" if content_type == schema.CONTENT_TYPE_MSGPACK else "JSON"
        raise _BadRequest(f"malformed {kind}: {error}") from error


def _finite(value):
    """``value`` with NaN and infinities replaced by None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _encode(payload, request: web.Request, status: int = 200, headers: dict | None = None) -> web.Response:
    if request.content_type == schema.CONTENT_TYPE_MSGPACK:
        body = msgpack.packb(payload, use_bin_type=True, unicode_errors="surrogatepass")
        return web.Response(
            body=body, status=status, content_type=schema.CONTENT_TYPE_MSGPACK, headers=headers
        )
    try:
        text = json.dumps(payload, allow_nan=False)
    except ValueError:  # a non-finite number somewhere: never answer invalid JSON
        text = json.dumps(_finite(payload), allow_nan=False)
    return web.Response(text=text, status=status, content_type="application/json", headers=headers)


async def _send(response: web.StreamResponse, request: web.Request) -> None:
    await response.prepare(request)
    await response.write_eof()


def _error(request: web.Request, status: int, message: str, headers: dict | None = None) -> web.Response:
    return _encode({"error": message}, request, status, headers)


class _BadRequest(Exception):
    """Answered with 400 and a body naming the problem (plus a result object for ``/run``)."""

    def __init__(self, message: str, result: dict | None = None):
        super().__init__(message)
        self.body = dict(result or {}, error=message)


class _BodyBudgetFull(Exception):
    """Answered with 503 + Retry-After: request bodies already being read use the in-flight budget."""


class SandboxServer:
    """Owns the worker pool, the memory cgroup, the temporary root and the HTTP site."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.metrics = Metrics()
        self.body_bytes_in_flight = 0  # of the requests whose bodies are being read and decoded
        _sweep_dead_servers()  # what a server killed with SIGKILL left behind
        self.temp_root = tempfile.mkdtemp(prefix=f"sandbox_server-{os.getpid()}-")
        os.chmod(self.temp_root, 0o755)
        self.cgroup_dir, self.cgroup_problem = _create_memory_cgroup(config.total_memory_mb)
        # cgroup v1: the freezer and cpuacct hierarchies hold one cgroup per session (stopped between its
        # calls, its CPU counted over all its processes); on v2 the sessions' memory cgroups do both
        self.session_cgroup_dirs = _create_session_cgroups()
        self.pool = Pool(config, self.temp_root, self.cgroup_dir, self.metrics, self.session_cgroup_dirs)
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    # --------------------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await self.pool.start()
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=[self._middleware])
        app.add_routes(
            [
                web.post(schema.PATH_RUN, self.handle_run),
                web.post(schema.PATH_BATCH, self.handle_batch),
                web.get(schema.PATH_HEALTH, self.handle_health),
                web.get(schema.PATH_METRICS, self.handle_metrics),
                web.post(schema.PATH_SESSIONS, self.handle_open_session),
                web.delete(schema.PATH_SESSIONS + "/{session}", self.handle_close_session),
            ]
        )
        # aiohttp closes a connection that has not delivered a complete request head within
        # keepalive_timeout of connecting (or of the previous answer): a header read timeout, so a client
        # trickling header bytes (slowloris) is disconnected. Tested in test_hardening.
        # auto_decompress=False: aiohttp would inflate a compressed body as it arrives, before any size
        # check, so a 1 MB gzip body of zeros held ~300 MB; compressed bodies are refused (415) instead.
        self.runner = web.AppRunner(
            app, access_log=None, keepalive_timeout=self.config.header_timeout, auto_decompress=False
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self.pool.close()  # first, so that open requests get their (killed) answers at once
        if self.runner is not None:
            await self.runner.cleanup()
        for path in [
            *dict.fromkeys(self.session_cgroup_dirs.values()),
            self.cgroup_dir,
        ]:  # freezer first: thaws
            if path is not None:
                _remove_cgroup(path)
        shutil.rmtree(self.temp_root, ignore_errors=True)

    def startup_report(self) -> str:
        mechanisms = self.pool.mechanisms()
        inactive = dict(mechanisms["inactive"])
        active = list(mechanisms["active"])
        lines = ["sandbox_server isolation mechanisms:"]
        lines += [f"  [active]   {name}" for name in active]
        lines += [f"  [inactive] {name}: {reason}" for name, reason in inactive.items()]
        if self.cgroup_problem:
            lines.append(f"  (memory cgroup: {self.cgroup_problem})")
        setups = sorted({w["call_setup"] for w in self.pool.describe_workers() if w["call_setup"]})
        lines.append(f"sandbox_server: calls set up after the fork by: {'; '.join(setups)}")
        c = self.config
        lines.append(
            f"sandbox_server: {c.workers} workers x {c.slots} slots, tiers {','.join(self.pool.tiers)}; "
            f"limits: {c.memory_mb} MiB address space, {c.nproc} processes, {c.file_size_mb} MiB files, "
            f"{c.tmp_mb} MiB tmpfs, output kept {c.max_output_bytes} B/stream, "
            f"killed past {c.output_limit_bytes} B"
        )
        return "\n".join(lines)

    # ---------------------------------------------------------------------------------------- handlers
    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        """Authentication, the JSON/msgpack error answers (400, 401, 413) for every route, and the write
        timeout: an answer the client has not taken within ``write_timeout`` s drops its connection, so a
        client that never reads cannot hold the answer's memory."""
        self.metrics.http_requests[request.path] += 1
        if self.config.token and request.path != schema.PATH_HEALTH:
            supplied = request.headers.get("Authorization", "")
            expected = f"Bearer {self.config.token}".encode()
            if not hmac.compare_digest(supplied.encode("utf-8", "surrogatepass"), expected):
                self.metrics.rejected[401] += 1
                return _error(request, 401, "missing or wrong bearer token")
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            self.metrics.rejected[415] += 1
            return _error(
                request, 415, f"compressed request bodies are not accepted (Content-Encoding: {encoding})"
            )
        try:
            response = await handler(request)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejected[413] += 1
            response = _error(request, 413, f"request body larger than {self.config.max_request_bytes} bytes")
        except _BadRequest as error:
            self.metrics.rejected[400] += 1
            response = _encode(error.body, request, 400)
        except _BodyBudgetFull as error:
            self.metrics.rejected[503] += 1
            message = (
                f"sandbox busy: {error} bytes of request bodies are being received "
                f"(--max-body-bytes-in-flight {self.config.max_body_bytes_in_flight})"
            )
            response = _error(request, 503, message, {"Retry-After": "1"})
        try:  # sent here, under the timeout; aiohttp then finds it sent (prepare, write_eof are idempotent)
            async with asyncio.timeout(self.config.write_timeout):  # not wait_for: no task per request
                await _send(response, request)
        except TimeoutError:
            self.metrics.rejected["write_timeout"] += 1
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:
            pass
        return response

    async def _read_payload(self, request: web.Request):
        """The decoded body; a decoding error becomes 400 with the decoder's message.

        The bytes received count against ``max_body_bytes_in_flight`` (all bodies being received and
        decoded at once) until the body is decoded; a body that would take the total past it, unless it is
        the only one, ends with ``_BodyBudgetFull`` (503). What was actually received counts, not what
        Content-Length claims: a client that announces a large body and sends nothing holds no budget."""
        received = 0
        try:
            # no timer for a body that arrived with the head (the usual small call): nothing to wait for
            loop = asyncio.get_running_loop()
            deadline = None if request.content.is_eof() else loop.time() + self.config.body_timeout
            async with asyncio.timeout_at(deadline):
                body = bytearray()  # not a list of chunks joined at the end: that holds the body twice
                while chunk := await request.content.readany():
                    received += len(chunk)
                    self.body_bytes_in_flight += len(chunk)
                    if received > self.config.max_request_bytes:
                        raise web.HTTPRequestEntityTooLarge(
                            max_size=self.config.max_request_bytes, actual_size=received
                        )
                    if self.body_bytes_in_flight > max(received, self.config.max_body_bytes_in_flight):
                        raise _BodyBudgetFull(self.body_bytes_in_flight - received)
                    body += chunk
            return _decode_body(body, request.content_type)
        except TimeoutError as error:
            raise _BadRequest(f"request body not received within {self.config.body_timeout:g} s") from error
        finally:
            self.body_bytes_in_flight -= received

    def _validate(self, obj) -> dict:
        """``schema.validate_run_request``; any failure of it is a ``SchemaError`` for this request alone."""
        c = self.config
        try:
            return schema.validate_run_request(
                obj,
                default_timeout=c.default_timeout,
                max_timeout=c.max_timeout,
                max_code_chars=c.max_code_chars,
                max_stdin_chars=c.max_stdin_chars,
            )
        except schema.SchemaError:
            raise
        except Exception as error:  # defence in depth: one odd item must not fail its whole batch
            raise schema.SchemaError(f"invalid request ({type(error).__name__}: {error})") from error

    def _busy(self, request: web.Request, error: QueueFull) -> web.Response:
        self.metrics.rejected[503] += 1
        headers = {"Retry-After": str(max(1, round(error.retry_after)))}
        return _error(request, 503, f"sandbox busy: {error}", headers)

    async def handle_run(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        payload = await self._read_payload(request)
        try:
            call = self._validate(payload)
        except schema.SchemaError as error:
            result = schema.make_result("invalid_request", stderr=f"sandbox: {error}\n")
            raise _BadRequest(str(error), result) from error
        try:
            self.pool.admit([call])
        except QueueFull as error:
            return self._busy(request, error)
        admitted = time.monotonic()
        result = await self.pool.run(call, admitted)
        collected = time.monotonic()
        not_found = result["error_type"] == schema.SESSION_NOT_FOUND and result["status"] == "invalid_request"
        response = _encode(result, request, 404 if not_found else 200)
        self.metrics.frontend_seconds += (admitted - started) + (time.monotonic() - collected)
        return response

    async def handle_batch(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        payload = await self._read_payload(request)
        try:
            raw = schema.validate_batch_request(payload, max_batch=self.config.max_batch)
        except schema.SchemaError as error:
            raise _BadRequest(str(error)) from error
        results: list = [None] * len(raw)
        valid = {}
        for position, item in enumerate(raw):
            try:
                valid[position] = self._validate(item)
            except schema.SchemaError as error:
                results[position] = schema.make_result("invalid_request", stderr=f"sandbox: {error}\n")
        try:
            self.pool.admit(list(valid.values()))
        except QueueFull as error:
            return self._busy(request, error)
        admitted = time.monotonic()
        outcomes = await asyncio.gather(*(self.pool.run(call, admitted) for call in valid.values()))
        collected = time.monotonic()
        for position, result in zip(valid, outcomes, strict=True):
            results[position] = result
        response = _encode({schema.BATCH_RESULTS_KEY: results}, request)
        self.metrics.frontend_seconds += (admitted - started) + (time.monotonic() - collected)
        return response

    async def handle_health(self, request: web.Request) -> web.Response:
        workers = self.pool.describe_workers()
        healthy = all(w["ready"] for w in workers)
        return _encode(
            {
                "status": "ok" if healthy else "degraded",
                "server_pid": os.getpid(),
                "workers": workers,
                "mechanisms": self.pool.mechanisms(),
                "uid_ranges": self.pool.uid_ranges(),
                "temp_root": self.temp_root,
                "cgroup": self.cgroup_dir,
                "session_cgroups": self.session_cgroup_dirs,
            },
            request,
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        snapshot = self.metrics.snapshot()
        snapshot.update(
            queue_depth=len(self.pool.queue),
            inflight=sum(ws.inflight for ws in self.pool.worker_sets),
            free_slots=self.pool.free_slots(),
            sessions=len(self.pool.sessions),
            body_bytes_in_flight=self.body_bytes_in_flight,
        )
        return _encode(snapshot, request)

    async def handle_open_session(self, request: web.Request) -> web.Response:
        try:
            opened = self.pool.open_session()
        except SessionsFull as error:
            self.metrics.rejected[503] += 1
            return _error(request, 503, f"sandbox busy: {error}", {"Retry-After": "1"})
        return _encode(opened, request)

    async def handle_close_session(self, request: web.Request) -> web.Response:
        """Closes the session if the ``X-Session-Token`` header holds its token; an unknown id and a wrong or
        missing token get the same 404."""
        token = request.headers.get(schema.SESSION_TOKEN_HEADER)
        closed = self.pool.close_session(request.match_info["session"], token)
        if closed:
            return _encode({"closed": True}, request)
        return _encode({"closed": False, "error": "no session with this id and token"}, request, 404)


def _memory_cgroup_parent() -> tuple[str, str]:
    """(directory of this process's memory cgroup, events file name) for cgroup v1 or v2."""
    with open("/proc/self/cgroup") as f:
        entries = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            return os.path.join("/sys/fs/cgroup/memory", path.lstrip("/")), "memory.limit_in_bytes"
    for hierarchy, _, path in entries:
        if hierarchy == "0":
            return os.path.join("/sys/fs/cgroup", path.lstrip("/")), "memory.max"
    raise OSError("no memory cgroup hierarchy")


def _create_memory_cgroup(limit_mb: int) -> tuple[str | None, str | None]:
    """A child memory cgroup for all workers and calls, or (None, reason)."""
    if limit_mb == 0:
        return None, "disabled (--total-memory-mb 0)"
    if os.geteuid() != 0:
        return None, "needs root"
    try:
        parent, limit_file = _memory_cgroup_parent()
        path = os.path.join(parent, f"sandbox_server-{os.getpid()}")
        os.mkdir(path)
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(str(limit_mb << 20))
        return path, None
    except OSError as error:
        return None, str(error)


SESSION_CONTROLLERS = ("freezer", "cpuacct", "cpu")  # cpu: also one cgroup per call slot


def _v1_controller_parent(controller: str) -> str | None:
    """This process's cgroup directory in the cgroup v1 hierarchy of ``controller``, or None."""
    mount = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 3 and fields[2] == "cgroup" and controller in fields[3].split(","):
                mount = fields[1]
                break
    if mount is None:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in controllers.split(","):
                return os.path.join(mount, path.lstrip("/"))
    return None


def _create_session_cgroups() -> dict:
    """``{controller: directory}``: this server's cgroups in the v1 freezer and cpuacct hierarchies (those
    that exist and can be made; none without root). The workers make one per session under each."""
    made = {}
    if os.geteuid() != 0:
        return made
    for controller in SESSION_CONTROLLERS:
        try:
            parent = _v1_controller_parent(controller)
            if parent is not None:
                path = os.path.join(parent, f"sandbox_server-{os.getpid()}")
                if path not in made.values():  # "cpu,cpuacct" is often one hierarchy
                    os.mkdir(path)
                made[controller] = path
        except OSError:
            continue
    return made


def _release(path: str) -> None:
    """Kill what is left in a cgroup and thaw it (a frozen process dies of SIGKILL only once thawed)."""
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs")) as f:
        for pid in f.read().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
    for name, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        with contextlib.suppress(OSError), open(os.path.join(path, name), "w") as f:
            f.write(thawed)


def _remove_cgroup(path: str) -> None:
    """Remove a cgroup and the per-call cgroups under it (their last processes may still be exiting; frozen
    session cgroups are thawed and their processes killed)."""
    with contextlib.suppress(OSError):
        for child in os.scandir(path):
            if child.is_dir() and "session" in child.name:
                _release(child.path)
    for _ in range(50):
        try:
            for child in os.scandir(path):
                if child.is_dir():
                    with contextlib.suppress(FileNotFoundError):
                        os.rmdir(child.path)
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _sweep_dead_servers() -> None:
    """Remove the temporary roots and memory cgroups of servers that are gone (a SIGKILL skips ``stop``).

    Both carry the server's pid in their names; only those of pids that no longer exist are removed.
    """
    places = [(tempfile.gettempdir(), re.compile(r"sandbox_server-(\d+)-\w+"))]
    for controller in SESSION_CONTROLLERS:  # the freezer first: a frozen process dies only once thawed
        with contextlib.suppress(OSError):
            parent = _v1_controller_parent(controller)
            if parent is not None:
                places.append((parent, re.compile(r"sandbox_server-(\d+)")))
    with contextlib.suppress(OSError):
        places.append((_memory_cgroup_parent()[0], re.compile(r"sandbox_server-(\d+)")))
    for place, pattern in places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if not match or not entry.is_dir(follow_symlinks=False) or _pid_alive(int(match.group(1))):
                continue
            if place == tempfile.gettempdir():
                shutil.rmtree(entry.path, ignore_errors=True)
            elif os.geteuid() == 0:
                _remove_cgroup(entry.path)


async def serve(config: ServerConfig, *, stop_at_stdin_eof: bool = False) -> None:
    """Run until SIGTERM/SIGINT, printing the isolation report and the listening address.

    With ``stop_at_stdin_eof`` it also stops when standard input (a pipe from the starting process, which
    never writes to it) reaches end of file: the kernel closes the pipe when that process dies, however it
    dies.
    """
    server = SandboxServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if stop_at_stdin_eof:

        def on_stdin() -> None:
            if not os.read(0, 1 << 12):
                loop.remove_reader(0)
                stop.set()

        loop.add_reader(0, on_stdin)
    try:
        await server.start()
        print(server.startup_report(), flush=True)
        print(f"sandbox_server listening on http://{config.host}:{server.port}", flush=True)
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await server.stop()
        print("sandbox_server stopped", file=sys.stderr, flush=True)
