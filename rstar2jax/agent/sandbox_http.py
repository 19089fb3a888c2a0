"""The sandbox client's HTTP side (:class:`SandboxConnection`): its servers, the pooled ``aiohttp`` session
and request headers, which server a batch goes to, and one ``POST /run/batch`` attempt.

A batch attempt returns one :class:`~rstar2jax.agent.sandbox_wire.SandboxResult` per call, or raises
:class:`RetryableFailure` (worth another attempt: a refused connection, a 503, a broken connection; it says
whether the server may have run the calls) or :class:`BatchTooLarge` (413: the caller splits the batch).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import aiohttp

from rstar2jax.agent.sandbox_wire import SandboxResult, batch_results, encode_batch, retry_after_seconds
from sandbox_server import schema

WIRES = ("msgpack", "json")


class RetryableFailure(Exception):
    """A batch attempt failed in a way worth retrying.

    Attributes:
      delivered: the server may have run the calls (a session call must not run twice).
      wait: the server's ``Retry-After`` in seconds, if it sent one.
      refused: no server accepted the connection.
    """

    def __init__(self, message: str, *, delivered: bool, wait: float | None = None, refused: bool = False):
        super().__init__(message)
        self.delivered = delivered
        self.wait = wait
        self.refused = refused


class BatchTooLarge(Exception):
    """The server answered 413 for a batch."""


class SandboxConnection:
    """The servers a client talks to and how (see ``SandboxClient`` for the arguments): one pooled HTTP
    session, the bearer token, the wire format, and the calls in flight per server, by which a batch goes to
    the least loaded server that has not refused a connection lately."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        wire: str = "msgpack",
        backoff: tuple[float, float] = (0.05, 2.0),
        connect_timeout: float = 5.0,
        connect_attempts: int = 3,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("need at least one server URL")
        if any(not u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"server URLs must start with http:// or https://, got {urls}")
        if connect_attempts < 1:
            raise ValueError(f"need connect_attempts >= 1, got {connect_attempts}")
        if wire not in WIRES:
            raise ValueError(f"wire must be 'msgpack' or 'json', got {wire!r}")
        if not 0 < backoff[0] <= backoff[1]:
            raise ValueError(f"backoff must be (first, largest) with 0 < first <= largest, got {backoff}")
        self.urls = [u.rstrip("/") for u in urls]
        self.token = token
        self.wire = wire
        self.backoff = backoff
        self.connect_timeout = connect_timeout
        self.connect_attempts = connect_attempts
        self.outstanding = dict.fromkeys(self.urls, 0)  # calls in flight per server
        self._avoid_until = dict.fromkeys(self.urls, 0.0)  # back-off after connection failures
        self._round_robin = itertools.count()
        self._http: aiohttp.ClientSession | None = None

    async def session(self) -> aiohttp.ClientSession:
        """The pooled HTTP session, opened on first use."""
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            self._http = aiohttp.ClientSession(connector=connector)
        return self._http

    def headers(self, content_type: str | None = None) -> dict:
        headers = {}
        if content_type is not None:
            headers["Content-Type"] = content_type
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def get_json(self, url: str, path: str) -> dict:
        http = await self.session()
        async with http.get(url + path, headers=self.headers()) as response:
            response.raise_for_status()
            return await response.json()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def pick_url(self) -> str:
        """The least loaded server among those not backing off (all of them if every one is), ties taken
        in turn."""
        now = time.monotonic()
        usable = [u for u in self.urls if self._avoid_until[u] <= now] or self.urls
        least = min(self.outstanding[u] for u in usable)
        tied = [u for u in usable if self.outstanding[u] == least]
        return tied[next(self._round_robin) % len(tied)]

    def avoid(self, url: str, seconds: float) -> None:
        """Keeps ``url`` out of :meth:`pick_url`'s choice for ``seconds`` (it refused or failed a batch)."""
        self._avoid_until[url] = time.monotonic() + seconds

    async def post_batch(self, url: str, requests: list[dict], deadline: float) -> list[SandboxResult]:
        """One ``POST /run/batch`` of ``requests`` to ``url``, given until ``deadline`` (monotonic)."""
        http = await self.session()
        body, content_type = encode_batch(requests, self.wire)
        budget = deadline - time.monotonic()
        try:
            async with http.post(
                url + schema.PATH_BATCH,
                data=body,
                headers=self.headers(content_type),
                timeout=aiohttp.ClientTimeout(total=budget, connect=self.connect_timeout),
            ) as response:
                raw = await response.read()
                status = response.status
                retry_after = response.headers.get("Retry-After")
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as error:
            message = f"cannot connect to {url}: {error}"
            raise RetryableFailure(message, delivered=False, refused=True) from error
        except (TimeoutError, aiohttp.ClientError, OSError) as error:
            raise RetryableFailure(f"request to {url} failed: {error!r}", delivered=True) from error
        if status == 503:
            wait = retry_after_seconds(retry_after)
            raise RetryableFailure(f"{url} is busy (503)", delivered=False, wait=wait)
        if status == 413:
            raise BatchTooLarge()
        return batch_results(status, raw, content_type, url, len(requests))
