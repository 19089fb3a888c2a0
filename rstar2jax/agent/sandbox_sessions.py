"""The sandbox client's sessions: the caller's session names and the server sessions they stand for.

A session name is the client's own (see ``agent.sandbox_client``): its first call opens a session on the
server the name hashes to (``POST /sessions``; concurrent first calls share one open), and the client keeps
the server's id and token, which every later call and ``close_session`` present. A session the server has
closed or lost is forgotten, so that the next call with its name opens a fresh one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import urllib.parse
import zlib

import aiohttp

from rstar2jax.agent.sandbox_http import SandboxConnection
from rstar2jax.agent.sandbox_wire import SandboxResult, decode_body
from sandbox_server import schema


@dataclasses.dataclass(frozen=True)
class SessionHandle:
    """A session opened on ``url``: the server's id for it and the token that proves it is ours."""

    url: str
    id: str
    token: str


class ClientSessions:
    """The sessions one :class:`~rstar2jax.agent.sandbox_client.SandboxClient` opened, by the caller's name.
    Opening and closing go through the client's connection (HTTP session, headers, retry settings);
    ``open_timeout``: seconds one ``POST /sessions`` may take."""

    def __init__(self, connection: SandboxConnection, open_timeout: float):
        self._connection = connection
        self._open_timeout = open_timeout
        self.opened: dict[str, SessionHandle] = {}  # the caller's session name -> the server's
        self._opening: dict[str, asyncio.Future] = {}  # names whose session is being opened

    def server_of(self, name: str) -> str:
        """The server the session ``name`` lives on: chosen by hashing the name, as a session lives in one."""
        urls = self._connection.urls
        return urls[zlib.crc32(name.encode("utf-8", "surrogatepass")) % len(urls)]

    async def handle(self, name: str) -> SessionHandle | SandboxResult:
        """The server session behind ``name``, opened on first use (concurrent first calls share one open);
        a failure result if it cannot be opened."""
        handle = self.opened.get(name)
        if handle is not None:
            return handle
        opening = self._opening.get(name)
        if opening is not None:
            return await asyncio.shield(opening)
        opening = asyncio.get_running_loop().create_future()
        self._opening[name] = opening
        try:
            opened = await self._open(self.server_of(name))
        except BaseException:
            opening.set_result(SandboxResult.failure("opening the session was cancelled"))
            raise
        finally:
            del self._opening[name]
        if isinstance(opened, SessionHandle):
            self.opened[name] = opened
        opening.set_result(opened)
        return opened

    def forget(self, name: str, handle: SessionHandle) -> None:
        """Drops ``handle``, gone on the server, if it is still ``name``'s: the next call opens a new one."""
        if self.opened.get(name) is handle:
            del self.opened[name]

    async def close(self, name: str) -> bool:
        """Closes the session ``name`` on its server; whether it existed (a name never used, or whose session
        has already ended, is False)."""
        opening = self._opening.get(name)
        if opening is not None:
            await asyncio.shield(opening)
        handle = self.opened.pop(name, None)
        if handle is None:
            return False
        http = await self._connection.session()
        path = f"{schema.PATH_SESSIONS}/{urllib.parse.quote(handle.id, safe='')}"
        headers = {**self._connection.headers(), schema.SESSION_TOKEN_HEADER: handle.token}
        async with http.delete(handle.url + path, headers=headers) as response:
            return response.status == 200

    async def _open(self, url: str) -> SessionHandle | SandboxResult:
        """``POST /sessions`` on ``url``, retrying refused connections and 503 like calls are retried."""
        connection = self._connection
        http = await connection.session()
        delay = connection.backoff[0]
        for attempt in range(connection.connect_attempts):
            if attempt:
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(2 * delay, connection.backoff[1])
            try:
                async with http.post(
                    url + schema.PATH_SESSIONS,
                    headers=connection.headers(),
                    timeout=aiohttp.ClientTimeout(
                        total=self._open_timeout, connect=connection.connect_timeout
                    ),
                ) as response:
                    status, raw = response.status, await response.read()
            except (aiohttp.ClientConnectorError, ConnectionRefusedError) as error:
                failure = SandboxResult.failure(
                    f"cannot open a session on {url}: {error} (is the server down?)", error_type="Unreachable"
                )
                continue
            except (TimeoutError, aiohttp.ClientError, OSError) as error:
                return SandboxResult.failure(
                    f"opening a session on {url} failed: {error!r}", error_type="ConnectionError"
                )
            decoded = decode_body(raw, response.content_type)
            if status == 200 and isinstance(decoded, dict):
                session_id, token = decoded.get(schema.SESSION_KEY), decoded.get(schema.SESSION_TOKEN_KEY)
                if isinstance(session_id, str) and isinstance(token, str):
                    return SessionHandle(url, session_id, token)
            message = decoded.get("error") if isinstance(decoded, dict) else raw[:200]
            failure = SandboxResult.failure(
                f"HTTP {status} from {url} opening a session: {message!r}", error_type=f"HTTP{status}"
            )
            if status != 503:
                return failure
        return failure
