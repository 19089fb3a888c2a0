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

:class:`SandboxResult` and the wire format (request bodies, decoding answers) live in ``agent.sandbox_wire``,
the blocking wrapper (:class:`SyncSandboxClient`, :func:`run_code_sync`) in ``agent.sandbox_sync``; this
module re-exports them. ``agent.sandbox_sessions`` keeps the session names and the server sessions behind
them. The only thing imported from the server package is its dependency-free wire schema.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Iterable, Sequence

import aiohttp

from rstar2jax.agent.sandbox_sessions import ClientSessions
from rstar2jax.agent.sandbox_wire import (
    SandboxResult,
    batch_results,
    encode_batch,
    retry_after_seconds,
)
from sandbox_server import schema

__all__ = ["SandboxClient", "SandboxResult", "SyncSandboxClient", "run_code_sync"]  # noqa: F822 (see __getattr__)

#: Names of ``rstar2jax.agent.sandbox_sync``, re-exported here on first use: that module builds on this one.
_SYNC_NAMES = ("SyncSandboxClient", "run_code_sync")


def __getattr__(name: str):
    if name in _SYNC_NAMES:
        from rstar2jax.agent import sandbox_sync

        return getattr(sandbox_sync, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(eq=False)
class _Call:
    request: dict
    future: asyncio.Future
    deadline: float
    url: str | None = None  # the server a session call must go to


CLIENT_REQUEST_FIELDS = ("code", "stdin", "timeout", "session")


class _Retry(Exception):
    """A batch attempt failed in a way worth retrying (``delivered``: the server may have run it)."""

    def __init__(self, message: str, *, delivered: bool, wait: float | None = None, refused: bool = False):
        super().__init__(message)
        self.delivered = delivered
        self.wait = wait
        self.refused = refused  # no server accepted the connection


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
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("need at least one server URL")
        if any(not u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"server URLs must start with http:// or https://, got {self.urls}")
        if min(max_batch, connect_attempts) < 1 or (
            min(batch_window, deadline_slack) < 0 or default_timeout <= 0
        ):
            raise ValueError(
                "need max_batch >= 1, batch_window >= 0, default_timeout > 0, deadline_slack >= 0, "
                "connect_attempts >= 1"
            )
        if wire not in ("msgpack", "json"):
            raise ValueError(f"wire must be 'msgpack' or 'json', got {wire!r}")
        if not 0 < backoff[0] <= backoff[1]:
            raise ValueError(f"backoff must be (first, largest) with 0 < first <= largest, got {backoff}")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.token = token
        self.max_batch = max_batch
        self.batch_window = batch_window
        self.default_timeout = default_timeout
        self.deadline_slack = deadline_slack
        self.backoff = backoff
        self.wire = wire
        self.connect_timeout = connect_timeout
        self.connect_attempts = connect_attempts
        self.outstanding = dict.fromkeys(self.urls, 0)  # calls in flight per server
        self._avoid_until = dict.fromkeys(self.urls, 0.0)  # back-off after connection failures
        self._round_robin = itertools.count()
        self._pending: list[_Call] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self._sessions = ClientSessions(self)

    # ------------------------------------------------------------------------------------------ public
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
        loop = asyncio.get_running_loop()
        request = {"code": code, "stdin": stdin, "timeout": timeout, "session": None}
        handle = None
        if session is not None:
            handle = await self._sessions.handle(session)
            if isinstance(handle, SandboxResult):  # could not open it
                return handle
            request.update(session=handle.id, session_token=handle.token)
        call = _Call(
            request=request,
            future=loop.create_future(),
            deadline=time.monotonic() + timeout + self.deadline_slack,
            url=None if handle is None else handle.url,
        )
        self._pending.append(call)
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = loop.call_later(self.batch_window, self._flush)
        try:
            result = await asyncio.wait_for(
                asyncio.shield(call.future), max(0.0, call.deadline - time.monotonic()) + 1.0
            )
        except TimeoutError:
            return _deadline_result(call)
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
        return await self._get(url or self.urls[0], schema.PATH_HEALTH)

    async def metrics(self, url: str | None = None) -> dict:
        return await self._get(url or self.urls[0], schema.PATH_METRICS)

    async def close(self) -> None:
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        for call in self._pending:
            if not call.future.done():
                call.future.set_result(SandboxResult.failure("client closed", error_type="ClientClosed"))
        self._pending.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # ---------------------------------------------------------------------------------------- batching
    def _flush(self) -> None:
        self._flush_handle = None
        pending, self._pending = self._pending, []
        by_target: dict[str | None, list[_Call]] = {}
        for call in pending:
            by_target.setdefault(call.url, []).append(call)
        for url, calls in by_target.items():
            for start in range(0, len(calls), self.max_batch):
                task = asyncio.get_running_loop().create_task(
                    self._deliver(calls[start : start + self.max_batch], url)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _pick_url(self) -> str:
        now = time.monotonic()
        usable = [u for u in self.urls if self._avoid_until[u] <= now] or self.urls
        least = min(self.outstanding[u] for u in usable)
        tied = [u for u in usable if self.outstanding[u] == least]
        return tied[next(self._round_robin) % len(tied)]

    async def _deliver(self, calls: list[_Call], fixed_url: str | None) -> None:
        """Send one batch until every call has a result or its deadline has passed."""
        try:
            await self._deliver_until_done(calls, fixed_url)
        except asyncio.CancelledError:  # the client is closing: nobody may be left waiting
            for call in calls:
                _resolve(call, SandboxResult.failure("client closed", error_type="ClientClosed"))
            raise

    async def _deliver_until_done(self, calls: list[_Call], fixed_url: str | None) -> None:
        delay = self.backoff[0]
        refusals = 0  # consecutive attempts that found no server listening
        while True:
            now = time.monotonic()
            for call in calls:
                if call.deadline <= now:
                    _resolve(call, _deadline_result(call))
            calls = [c for c in calls if not c.future.done()]
            if not calls:
                return
            url = fixed_url or self._pick_url()
            self.outstanding[url] += len(calls)
            try:
                outcome = await self._post_batch(url, calls)
            except (_Retry, _TooLarge) as error:
                outcome = error
            finally:
                self.outstanding[url] -= len(calls)
            if isinstance(outcome, list):
                for call, result in zip(calls, outcome, strict=True):
                    _resolve(call, result)
                return
            if isinstance(outcome, _TooLarge):
                if len(calls) == 1:
                    failure = SandboxResult.failure(
                        "request larger than the server accepts",
                        status="invalid_request",
                        error_type="RequestTooLarge",
                    )
                    _resolve(calls[0], failure)
                    return
                half = len(calls) // 2
                await asyncio.gather(
                    self._deliver(calls[:half], fixed_url), self._deliver(calls[half:], fixed_url)
                )
                return
            if outcome.delivered:  # the server may have run them: re-running a session call is not safe
                for call in calls:
                    if call.request["session"] is not None:
                        failure = SandboxResult.failure(
                            f"{outcome}; session call not retried", error_type="ConnectionError"
                        )
                        _resolve(call, failure)
            else:
                self._avoid_until[url] = time.monotonic() + delay
            refusals = refusals + 1 if outcome.refused else 0
            if refusals >= self.connect_attempts * (1 if fixed_url else len(self.urls)):
                down = SandboxResult.failure(f"{outcome} (is the server down?)", error_type="Unreachable")
                for call in calls:  # nothing listens: say so now, not at the deadline
                    _resolve(call, down)
                return
            wait = delay if outcome.wait is None else min(outcome.wait, self.backoff[1])
            await asyncio.sleep(wait * random.uniform(0.5, 1.5))
            delay = min(2 * delay, self.backoff[1])

    async def _post_batch(self, url: str, calls: list[_Call]) -> list[SandboxResult]:
        http = await self._session()
        body, content_type = encode_batch([c.request for c in calls], self.wire)
        budget = max(c.deadline for c in calls) - time.monotonic()
        try:
            async with http.post(
                url + schema.PATH_BATCH,
                data=body,
                headers=self._headers(content_type),
                timeout=aiohttp.ClientTimeout(total=budget, connect=self.connect_timeout),
            ) as response:
                raw = await response.read()
                status = response.status
                retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as error:
            raise _Retry(f"cannot connect to {url}: {error}", delivered=False, refused=True) from error
        except (TimeoutError, aiohttp.ClientError, OSError) as error:
            raise _Retry(f"request to {url} failed: {error!r}", delivered=True) from error
        if status == 503:
            raise _Retry(f"{url} is busy (503)", delivered=False, wait=retry_after_seconds(retry_after))
        if status == 413:
            raise _TooLarge()
        return batch_results(status, raw, content_type, url, len(calls))

    # ------------------------------------------------------------------------------------------- plumbing
    async def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            self._http = aiohttp.ClientSession(connector=connector)
        return self._http

    def _headers(self, content_type: str | None = None) -> dict:
        headers = {}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def _get(self, url: str, path: str) -> dict:
        http = await self._session()
        async with http.get(url + path, headers=self._headers()) as response:
            response.raise_for_status()
            return await response.json()


class _TooLarge(Exception):
    """The server answered 413 for a batch."""


def _resolve(call: _Call, result: SandboxResult) -> None:
    if not call.future.done():
        call.future.set_result(result)


def _deadline_result(call: _Call) -> SandboxResult:
    limit = call.request["timeout"]
    return SandboxResult.failure(
        f"no result before the call's deadline (timeout {limit:g} s + slack); the service may be overloaded",
        error_type="DeadlineExceeded",
    )
