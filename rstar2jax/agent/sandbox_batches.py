"""Calls waiting for a sandbox result (:class:`PendingCall`) and the delivery of one batch of them
(:func:`deliver`): attempted on a server until every call has a result or its deadline has passed.

Between attempts the delay doubles (from ``backoff[0]`` up to ``backoff[1]``, or the server's
``Retry-After``) with random jitter; a server that failed a batch sits out that delay. A call the server may
already have run is not retried if it belongs to a session (running it twice would change the session's
state). Calls whose servers all refuse connections ``connect_attempts`` times in a row get an
``Unreachable`` result at once; a batch the server finds too large (413) is split in halves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

from rstar2jax.agent.sandbox_http import BatchTooLarge, RetryableFailure, SandboxConnection
from rstar2jax.agent.sandbox_wire import SandboxResult


@dataclasses.dataclass(eq=False)
class PendingCall:
    """One call: its request body, the future its caller awaits, its deadline (monotonic) and, for a
    session call, the server its session lives on."""

    request: dict
    future: asyncio.Future
    deadline: float
    url: str | None = None

    def resolve(self, result: SandboxResult) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def deadline_result(self) -> SandboxResult:
        limit = self.request["timeout"]
        return SandboxResult.failure(
            f"no result before the call's deadline (timeout {limit:g} s + slack); the service may be "
            "overloaded",
            error_type="DeadlineExceeded",
        )


def closed_result() -> SandboxResult:
    return SandboxResult.failure("client closed", error_type="ClientClosed")


async def deliver(connection: SandboxConnection, calls: list[PendingCall], fixed_url: str | None) -> None:
    """Sends one batch (to ``fixed_url``, or the least loaded server) until every call has a result or its
    deadline has passed; a cancelled delivery (the client is closing) leaves nobody waiting."""
    try:
        await _deliver_until_done(connection, calls, fixed_url)
    except asyncio.CancelledError:
        for call in calls:
            call.resolve(closed_result())
        raise


async def _deliver_until_done(connection: SandboxConnection, calls: list[PendingCall], fixed_url: str | None):
    delay = connection.backoff[0]
    refusals = 0  # consecutive attempts that found no server listening
    while True:
        calls = _unexpired(calls)
        if not calls:
            return
        url = fixed_url or connection.pick_url()
        outcome = await _attempt(connection, url, calls)
        if isinstance(outcome, list):
            for call, result in zip(calls, outcome, strict=True):
                call.resolve(result)
            return
        if isinstance(outcome, BatchTooLarge):
            await _split(connection, calls, fixed_url)
            return
        if outcome.delivered:  # the server may have run them: re-running a session call is not safe
            _fail_session_calls(calls, outcome)
        else:
            connection.avoid(url, delay)
        refusals = refusals + 1 if outcome.refused else 0
        if refusals >= connection.connect_attempts * (1 if fixed_url else len(connection.urls)):
            down = SandboxResult.failure(f"{outcome} (is the server down?)", error_type="Unreachable")
            for call in calls:  # nothing listens: say so now, not at the deadline
                call.resolve(down)
            return
        wait = delay if outcome.wait is None else min(outcome.wait, connection.backoff[1])
        await asyncio.sleep(wait * random.uniform(0.5, 1.5))
        delay = min(2 * delay, connection.backoff[1])


def _unexpired(calls: list[PendingCall]) -> list[PendingCall]:
    """The calls still waiting, after giving those past their deadline a ``DeadlineExceeded`` result."""
    now = time.monotonic()
    for call in calls:
        if call.deadline <= now:
            call.resolve(call.deadline_result())
    return [c for c in calls if not c.future.done()]


async def _attempt(
    connection: SandboxConnection, url: str, calls: list[PendingCall]
) -> list[SandboxResult] | RetryableFailure | BatchTooLarge:
    """One batch attempt on ``url``, its calls counted as in flight there meanwhile."""
    connection.outstanding[url] += len(calls)
    try:
        return await connection.post_batch(url, [c.request for c in calls], max(c.deadline for c in calls))
    except (RetryableFailure, BatchTooLarge) as error:
        return error
    finally:
        connection.outstanding[url] -= len(calls)


async def _split(connection: SandboxConnection, calls: list[PendingCall], fixed_url: str | None) -> None:
    """A batch too large for the server: its halves are delivered on their own; a single call that is too
    large fails as an invalid request."""
    if len(calls) == 1:
        failure = SandboxResult.failure(
            "request larger than the server accepts", status="invalid_request", error_type="RequestTooLarge"
        )
        calls[0].resolve(failure)
        return
    half = len(calls) // 2
    await asyncio.gather(
        deliver(connection, calls[:half], fixed_url), deliver(connection, calls[half:], fixed_url)
    )


def _fail_session_calls(calls: list[PendingCall], outcome: RetryableFailure) -> None:
    for call in calls:
        if call.request["session"] is not None:
            call.resolve(
                SandboxResult.failure(f"{outcome}; session call not retried", error_type="ConnectionError")
            )
