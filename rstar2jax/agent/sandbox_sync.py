"""Blocking use of the sandbox client, for notebooks and scripts.

:class:`SyncSandboxClient` runs a :class:`~rstar2jax.agent.sandbox_client.SandboxClient` on an event loop
of its own, on a background thread that the wrapper starts and its ``close()`` stops;
:func:`run_code_sync` runs one snippet.

    with SyncSandboxClient("http://127.0.0.1:8088") as client:
        print(client.run("2 ** 10").stdout)
    run_code_sync("print(3)", url="http://127.0.0.1:8088")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence

from rstar2jax.agent.sandbox_client import SandboxClient
from rstar2jax.agent.sandbox_wire import SandboxResult

__all__ = ["SyncSandboxClient", "run_code_sync"]


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
