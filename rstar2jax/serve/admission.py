"""Which requests the server takes, and how it lets them go (:class:`Admission`).

A request the server accepts is *waiting* from its arrival (its body read, its prompt rendered, then in the
engine's queue) until the engine gives it its slots, then *running* until it is answered. At most
``max_waiting`` requests wait at once: one more is answered 429 with OpenAI's error object and a
``Retry-After`` of the mean request latency times the waiting requests per slot (1 to 60 s), so a burst is
told when to come back instead of queueing for minutes.

A drain (:meth:`Admission.drain`: SIGTERM, Ctrl-C) answers new requests 503, lets the ones in flight finish
up to a deadline, then ends the rest: a running choice finishes with ``finish_reason`` ``"abort"``
(:meth:`~rstar2jax.serve.choice.ChoiceStream.abort`), a waiting request gets 503.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable

from rstar2jax.serve.choice import ChoiceStream
from rstar2jax.serve.metrics import ServerMetrics
from rstar2jax.serve.protocol import RequestError

__all__ = ["Admission", "InFlight", "shutting_down"]

#: How long a drain waits, after ending what remained, for those requests' last events.
ANSWER_GRACE_S = 10.0


def shutting_down(what: str) -> RequestError:
    """The 503 of a request a drain refused or ended (OpenAI's error object, ``server_shutting_down``)."""
    return RequestError(f"the server is shutting down: {what}", type="server_error",
                        code="server_shutting_down", status=503)


class InFlight:
    """A request the server accepted: waiting (``opening``: its engine admission) until the engine gives it
    its slots, then running (``choices``)."""

    def __init__(self):
        self.arrived = time.perf_counter()
        self.opening: asyncio.Future | None = None
        self.choices: list[ChoiceStream] | None = None
        self.aborted = False

    def abort(self) -> None:
        """A drain's deadline: running choices end now (``abort``), a waiting request gets 503."""
        self.aborted = True
        for choice in self.choices or ():
            choice.abort()
        if self.choices is None and self.opening is not None:
            self.opening.cancel()


class Admission:
    """Accepts, bounds, tracks and drains the requests of one server; keeps ``metrics``' running and waiting
    gauges, refusals, queue time, end-to-end latency and finish reasons.

    Args:
      metrics: the server's metrics.
      max_waiting: most requests waiting at once.
      num_slots: the engine's slots (for the ``Retry-After`` estimate).
      drain_timeout_s: how long :meth:`drain` lets the requests in flight finish.
    """

    def __init__(self, metrics: ServerMetrics, *, max_waiting: int, num_slots: int, drain_timeout_s: float):
        self.metrics, self.max_waiting, self.num_slots = metrics, max_waiting, num_slots
        self.drain_timeout_s = drain_timeout_s
        self._in_flight: set[InFlight] = set()
        self._end_now = False

    @property
    def in_flight(self) -> int:
        """Requests accepted and not answered yet (waiting or running)."""
        return len(self._in_flight)

    def accept(self) -> InFlight:
        """A new request, counted as waiting; RequestError 503 while draining, 429 when ``max_waiting``
        requests wait already."""
        metrics = self.metrics
        if metrics.draining:
            metrics.rejected["draining"] += 1
            raise shutting_down("it takes no new requests")
        if metrics.waiting >= self.max_waiting:
            metrics.rejected["queue_full"] += 1
            mean = metrics.histograms["e2e_request_latency_seconds"].mean or 1.0
            retry = min(60, max(1, math.ceil(mean * metrics.waiting / self.num_slots)))
            raise RequestError(f"the server is busy: {metrics.waiting} requests are waiting (max_waiting="
                               f"{self.max_waiting}); retry in {retry} s", type="requests",
                               code="rate_limit_exceeded", status=429, headers={"Retry-After": str(retry)})
        entry = InFlight()
        metrics.waiting += 1
        self._in_flight.add(entry)
        return entry

    async def admit(self, entry: InFlight, opening: Awaitable):
        """What ``opening`` (the engine's admission of the request) returns; RequestError 503 when a drain
        ended the wait. The caller then calls :meth:`running`, with no ``await`` between."""
        if entry.aborted:
            if asyncio.iscoroutine(opening):
                opening.close()  # never started: nothing to cancel
            raise shutting_down("the request ended before it started")
        entry.opening = asyncio.ensure_future(opening)
        try:
            admitted = await entry.opening
        except asyncio.CancelledError:
            if entry.aborted and not asyncio.current_task().cancelling():  # abort(), not the client
                raise shutting_down("the request ended before it started") from None
            raise
        self.metrics.observe("request_queue_time_seconds", time.perf_counter() - entry.arrived)
        return admitted

    def running(self, entry: InFlight, choices: list[ChoiceStream]) -> None:
        """The request's choices generate: it counts as running (aborted at once when a drain's deadline
        passed while the engine admitted it)."""
        self.metrics.waiting -= 1
        self.metrics.running += 1
        entry.choices = choices
        if entry.aborted:
            entry.abort()

    def release(self, entry: InFlight) -> None:
        """The request is answered (or its client went away): its choices closed, counted and forgotten."""
        metrics = self.metrics
        if entry.choices is None:
            metrics.waiting -= 1
        else:
            metrics.running -= 1
            metrics.observe("e2e_request_latency_seconds", time.perf_counter() - entry.arrived)
            for choice in entry.choices:
                choice.close()
                metrics.finished[choice.finish_reason or "cancelled"] += 1
                metrics.counts["cancelled_choices"] += not choice.finished
        self._in_flight.discard(entry)

    async def drain(self, timeout: float | None = None) -> int:
        """Stops taking requests (503), waits up to ``timeout`` (default ``drain_timeout_s``; :meth:`end_now`
        cuts it short) for the requests in flight, then ends what remains and waits (up to
        :data:`ANSWER_GRACE_S`) for their answers. Returns how many it ended."""
        self.metrics.draining = True
        deadline = time.monotonic() + (self.drain_timeout_s if timeout is None else timeout)
        while self._in_flight and time.monotonic() < deadline and not self._end_now:
            await asyncio.sleep(0.05)
        ended = list(self._in_flight)
        for entry in ended:
            entry.abort()
        answered = time.monotonic() + ANSWER_GRACE_S  # their last events, or a 503: a few engine steps
        while self._in_flight and time.monotonic() < answered:
            await asyncio.sleep(0.01)
        return len(ended)

    def end_now(self) -> None:
        """Ends a drain's wait now (a second Ctrl-C)."""
        self._end_now = True
