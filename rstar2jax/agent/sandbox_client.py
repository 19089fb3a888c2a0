"""Async client for ``sandbox_server``: micro-batching, least-loaded routing, retries, deadlines.

    async with SandboxClient(["http://127.0.0.1:8088"]) as client:
        result = await client.run("print(1 + 1)", timeout=5.0)  # status "ok", stdout "2\\n"
        results = await client.run_many(["1 + 1", "import sympy"])  # in order

    with SyncSandboxClient("http://127.0.0.1:8088") as client:  # notebooks and scripts
        print(client.run("2 ** 10").stdout)
    run_code_sync("print(3)", url="http://127.0.0.1:8088")  # one-off

How it behaves:
    * one pooled ``aiohttp`` session per client;
    * concurrent ``run`` calls are gathered into ``POST /run/batch`` requests of up to ``max_batch`` calls,
      sent when a batch is full or ``batch_window`` seconds after its first call;
    * with several server URLs each batch goes to the one with the fewest calls outstanding (a server that
      refused a connection sits out a back-off period); calls with a ``session`` always go to the same
      server, chosen by hashing the session name, because a session lives in one server;
    * a ``session`` name is the client's own: its first call opens a session on the server
      (``POST /sessions``) and the client keeps the server's id and token, which every later call and
      ``close_session`` present; another client using the same name gets a session of its own. A call that
      finds its session closed or expired (``SessionClosed``) says so, and the next call with that name
      opens a fresh session;
    * connection errors and 503 (queue full) are retried with exponential back-off and jitter; a session
      call is retried only if it was certainly not delivered (connection refused, 503);
    * every call has a deadline, ``timeout + deadline_slack``; a call that cannot get a result by then
      returns ``status="internal", error_type="DeadlineExceeded"``; one whose servers all refuse
      connections ``connect_attempts`` times in a row returns at once with ``error_type="Unreachable"``;
    * each result of a batch is decoded on its own: a malformed one is ``BadResponse`` for that call only,
      and text that is not valid UTF-8 has its bad bytes replaced by U+FFFD.
    ``run`` never hangs and never raises for service failures: they come back as ``internal`` results
    whose ``stderr`` says what happened.

:class:`SandboxResult` and the wire format (request bodies, decoding answers) live in ``agent.sandbox_wire``;
the HTTP side (servers, pooled session, routing, one batch attempt) in ``agent.sandbox_http``; the delivery
of a batch with its retries and deadlines in ``agent.sandbox_batches``; the session names and the server
sessions behind them in ``agent.sandbox_sessions``. This module holds the client and its blocking wrapper
(:class:`SyncSandboxClient`, :func:`run_code_sync`). The only thing imported from the server package is its
dependency-free wire schema.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable, Sequence

from rstar2jax.agent.sandbox_batches import PendingCall, closed_result, deliver
from rstar2jax.agent.sandbox_http import SandboxConnection
from rstar2jax.agent.sandbox_sessions import ClientSessions
from rstar2jax.agent.sandbox_wire import SandboxResult
from sandbox_server import schema

__all__ = ["SandboxClient", "SyncSandboxClient", "run_code_sync"]

CLIENT_REQUEST_FIELDS = ("code", "stdin", "timeout", "session")


class SandboxClient:
    """Async client for one or more sandbox servers (see the module docstring).

    Args:
        urls: a base URL (``"http://127.0.0.1:8088"``) or several.
        token: bearer token, if the servers require one.
        max_batch: most calls per ``/run/batch`` request (the issue's micro-batch size is 64).
        batch_window: seconds to wait for more calls before sending a partial batch.
        default_timeout: execution timeout (s) when ``run`` is not given one.
        deadline_slack: extra seconds beyond the timeout a call may spend queueing, in transit and retrying.
        backoff: (first, largest) retry delays in seconds; delays double with random jitter.
        wire: ``"msgpack"`` (default, faster) or ``"json"``.
        connect_timeout: seconds to establish a connection.
        connect_attempts: a call whose server refused this many connections in a row (each server, when
          several can serve it) returns at once ``internal`` / ``Unreachable`` instead of waiting for its
          deadline.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        max_batch: int = 64,
        batch_window: float = 0.002,
        default_timeout: float = 10.0,
        deadline_slack: float = 60.0,
        backoff: tuple[float, float] = (0.05, 2.0),
        wire: str = "msgpack",
        connect_timeout: float = 5.0,
        connect_attempts: int = 3,
    ):
        self.connection = SandboxConnection(
            urls, token=token, wire=wire, backoff=backoff, connect_timeout=connect_timeout,
            connect_attempts=connect_attempts,
        )  # fmt: skip
        if max_batch < 1 or min(batch_window, deadline_slack) < 0 or default_timeout <= 0:
            raise ValueError(
                "need max_batch >= 1, batch_window >= 0, default_timeout > 0, deadline_slack >= 0; got "
                f"{max_batch}, {batch_window}, {default_timeout}, {deadline_slack}"
            )
        self.urls = self.connection.urls
        self.max_batch = max_batch
        self.batch_window = batch_window
        self.default_timeout = default_timeout
        self.deadline_slack = deadline_slack
        self._pending: list[PendingCall] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._sessions = ClientSessions(self.connection, open_timeout=deadline_slack + 5)

    async def run(
        self, code: str, stdin: str = "", timeout: float | None = None, session: str | None = None
    ) -> SandboxResult:
        """Execute ``code`` (with ``stdin``) and return its result; never raises for service failures."""
        if self._closed:
            raise RuntimeError("SandboxClient is closed")
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError("code and stdin must be strings")
        timeout = self.default_timeout if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        request = {"code": code, "stdin": stdin, "timeout": timeout, "session": None}
        handle = None
        if session is not None:
            handle = await self._sessions.handle(session)
            if isinstance(handle, SandboxResult):  # could not open it
                return handle
            request.update(session=handle.id, session_token=handle.token)
        call = PendingCall(
            request=request,
            future=asyncio.get_running_loop().create_future(),
            deadline=time.monotonic() + timeout + self.deadline_slack,
            url=None if handle is None else handle.url,
        )
        self._submit(call)
        try:
            result = await asyncio.wait_for(
                asyncio.shield(call.future), max(0.0, call.deadline - time.monotonic()) + 1.0
            )
        except TimeoutError:
            return call.deadline_result()
        if handle is not None and result.error_type in (schema.SESSION_CLOSED, schema.SESSION_NOT_FOUND):
            self._sessions.forget(session, handle)  # gone on the server: the next call opens a new one
        return result

    async def run_many(
        self, requests: Iterable[str | dict], *, timeout: float | None = None, session: str | None = None
    ) -> list[SandboxResult]:
        """Run many snippets concurrently; results in input order.

        Each item is a code string or a dict with ``code`` and optionally ``stdin``, ``timeout``, ``session``
        (the keyword arguments are defaults for items that do not set them).
        """
        specs = []
        for item in requests:
            spec = {"code": item} if isinstance(item, str) else dict(item)
            unknown = set(spec) - set(CLIENT_REQUEST_FIELDS)
            if "code" not in spec or unknown:
                raise ValueError(
                    f"each request needs 'code' and only {CLIENT_REQUEST_FIELDS}; got {sorted(spec)}"
                )
            specs.append({"timeout": timeout, "session": session, **spec})
        return list(await asyncio.gather(*(self.run(**spec) for spec in specs)))

    async def close_session(self, session: str) -> bool:
        """Close a session on its server; returns whether it existed (a name this client never used, or
        whose session has already ended, is False)."""
        return await self._sessions.close(session)

    async def health(self, url: str | None = None) -> dict:
        return await self.connection.get_json(url or self.urls[0], schema.PATH_HEALTH)

    async def metrics(self, url: str | None = None) -> dict:
        return await self.connection.get_json(url or self.urls[0], schema.PATH_METRICS)

    async def close(self) -> None:
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        for call in self._pending:
            call.resolve(closed_result())
        self._pending.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.connection.close()

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _submit(self, call: PendingCall) -> None:
        """Queues ``call``: its batch goes out when full, or ``batch_window`` seconds after its first call."""
        self._pending.append(call)
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(self.batch_window, self._flush)

    def _flush(self) -> None:
        """Sends the queued calls: a batch of up to ``max_batch`` per target (a session's server, or any)."""
        self._flush_handle = None
        pending, self._pending = self._pending, []
        by_target: dict[str | None, list[PendingCall]] = {}
        for call in pending:
            by_target.setdefault(call.url, []).append(call)
        for url, calls in by_target.items():
            for start in range(0, len(calls), self.max_batch):
                batch = calls[start : start + self.max_batch]
                task = asyncio.get_running_loop().create_task(deliver(self.connection, batch, url))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)


class SyncSandboxClient:
    """Blocking wrapper for notebooks and scripts: a private event loop on a background thread.

    Works whether or not the caller already runs an event loop (as Jupyter does). Same arguments as
    ``SandboxClient``. The loop and its thread belong to this object: :meth:`close` stops both (calls after
    it raise ``RuntimeError``), and a new client in the same process starts its own.
    """

    def __init__(self, urls: str | Sequence[str], **kwargs):
        self._client = SandboxClient(urls, **kwargs)  # first: bad arguments must not leave a thread running
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-client", daemon=True)
        self._thread.start()

    def _call(self, coroutine):
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("SyncSandboxClient is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def run(
        self, code: str, stdin: str = "", timeout: float | None = None, session: str | None = None
    ) -> SandboxResult:
        return self._call(self._client.run(code, stdin=stdin, timeout=timeout, session=session))

    def run_many(
        self, requests: Iterable[str | dict], *, timeout: float | None = None, session: str | None = None
    ) -> list[SandboxResult]:
        return self._call(self._client.run_many(list(requests), timeout=timeout, session=session))

    def close_session(self, session: str) -> bool:
        return self._call(self._client.close_session(session))

    def health(self) -> dict:
        return self._call(self._client.health())

    def close(self) -> None:
        """Closes the client, then stops and closes the event loop and joins its thread; idempotent."""
        if self._loop.is_closed():
            return
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncSandboxClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def run_code_sync(
    code: str, url: str, stdin: str = "", timeout: float | None = None, **kwargs
) -> SandboxResult:
    """Run one snippet on the server at ``url`` and wait for its result (opens and closes a client)."""
    with SyncSandboxClient(url, **kwargs) as client:
        return client.run(code, stdin=stdin, timeout=timeout)
