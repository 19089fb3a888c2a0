"""Riding out sandbox outages: a tool call the service could not answer waits and is tried again.

A multi-day run makes tens of thousands of tool calls per step, and the sandbox service will blink (killed and
restarted, a host rebooted, a network hiccup). What a call's result says decides what happens
(:func:`failure_kind`):

* ``"outage"``: the service did not answer (connection refused or reset, no result before the call's
  deadline, a 5xx answer, a malformed one, or the server's own ``internal`` status): the call waits, with
  exponential back-off and jitter, and is tried again until the service answers or the outage has lasted
  :attr:`OutagePolicy.budget_s`; then :class:`SandboxUnavailable` stops the rollout. Every waiting call wakes
  as soon as one of them gets through. Nothing the model wrote is lost while it waits: its session holds its
  place (and its KV pages) in the engine, as during any long tool call.
* ``"worker"``: the service answered that the call's worker died under it (``killed`` / ``WorkerDied``; the
  server restarts its workers): the call runs again at once, at most ``worker_retries`` times (a call that
  kills its worker every time is left with its ``internal`` outcome, which
  :class:`~rstar2jax.agent.PolicyRollout` drops rather than count against the model).
* ``"rejected"``: the service refuses the calls themselves (HTTP 4xx: a wrong token or URL): no wait helps,
  :class:`SandboxUnavailable` at once.
* None: a result to show the model (its own errors and timeouts included).

A session call (``RolloutConfig.stateful_tool``) is tried again only when it certainly never reached the
server (the connection was refused): anything else may have changed its state.

A sandbox the run started itself can be restarted: :attr:`OutagePolicy.restart` is called (on a worker
thread, one call at a time) when a call finds the service down, and again while it stays down; it returns a
line for the log when it restarted something (``sandbox_server.LocalServer.restart_if_dead``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["OutagePolicy", "OutageTracker", "SandboxUnavailable", "failure_kind"]

logger = logging.getLogger(__name__)

_WORKER_DIED = "WorkerDied"
_NEVER_DELIVERED = "Unreachable"  # the client's word for "every connection was refused"


class SandboxUnavailable(RuntimeError):
    """The sandbox did not come back within the outage budget, or refuses every call. The message is one
    line naming the sandbox, how long the rollout waited and what it tried."""


def failure_kind(result: Any) -> str | None:
    """``"outage"``, ``"worker"``, ``"rejected"`` or None for a sandbox result (see the module doc)."""
    error_type = result.error_type or ""
    if result.status == "internal":
        if error_type.startswith("HTTP") and error_type[4:].isdigit():
            return "rejected" if 400 <= int(error_type[4:]) < 500 else "outage"
        if error_type == "ClientClosed":  # the run is shutting down: not something to wait out
            return None
        return "outage"  # the client's own failures (no answer, a malformed one) and the server's "could not
        # run it" (its own internal status: safe to retry)
    if result.status == "killed" and error_type == _WORKER_DIED:
        return "worker"
    return None


@dataclasses.dataclass(frozen=True)
class OutagePolicy:
    """How long and how a rollout waits for its sandbox (see the module doc).

    Attributes:
      budget_s: seconds an outage may last, counted from the first call that found the service down, before
        :class:`SandboxUnavailable` stops the rollout (``rollout.sandbox_outage_s``).
      backoff: (first, largest) seconds a waiting call sleeps before its next try; doubled after each try,
        each sleep jittered by a factor in [0.5, 1.5].
      restart: for a sandbox the run owns: restarts it if it died and returns a line saying so, else None.
      log: where the lines about outages go (default: this module's logger, at WARNING).
    """

    budget_s: float = 300.0
    backoff: tuple[float, float] = (0.5, 10.0)
    restart: Callable[[], str | None] | None = None
    log: Callable[[str], None] | None = None

    def __post_init__(self):
        if not self.budget_s > 0:
            raise ValueError(f"OutagePolicy.budget_s must be > 0 seconds, got {self.budget_s!r}")
        if not 0 < self.backoff[0] <= self.backoff[1]:
            raise ValueError(f"OutagePolicy.backoff must be (first, largest) with 0 < first <= largest, "
                             f"got {self.backoff!r}")


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no message")


class OutageTracker:
    """One rollout call's view of its sandbox: runs every tool call under an :class:`OutagePolicy`, shares
    the outage clock between them and counts what happened (:meth:`stats`). ``where`` names the sandbox in
    the lines it logs; ``worker_retries``: times a call whose worker died under it is run again
    (``RolloutConfig.tool_infra_retries``). Use it from one event loop."""

    def __init__(self, policy: OutagePolicy, where: str, *, worker_retries: int = 2):
        self.policy, self.where, self.worker_retries = policy, where, worker_retries
        self.down_since: float | None = None  # monotonic time the current outage was first seen
        self.outage_seconds = 0.0  # of outages that ended
        self.outages = 0
        self.retried_calls = 0  # calls tried more than once
        self.attempts = 0  # tries after the first, over all calls
        self.restarts = 0
        self.worker_deaths = 0
        self._back = asyncio.Event()  # set when the service answers again: wakes every waiting call
        self._restarting = False
        self._last_error = ""

    def _log(self, line: str) -> None:
        if self.policy.log is not None:
            self.policy.log(line)
        else:
            logger.warning("%s", line)

    def stats(self) -> dict[str, float]:
        """``sandbox_outage_s`` (seconds the service was down, an outage still going included),
        ``sandbox_outages``, ``sandbox_retried_calls``, ``sandbox_restarts``, ``sandbox_worker_deaths``."""
        ongoing = 0.0 if self.down_since is None else time.monotonic() - self.down_since
        return {
            "sandbox_outage_s": self.outage_seconds + ongoing,
            "sandbox_outages": float(self.outages + (self.down_since is not None)),
            "sandbox_retried_calls": float(self.retried_calls),
            "sandbox_restarts": float(self.restarts),
            "sandbox_worker_deaths": float(self.worker_deaths),
        }

    def _answered(self) -> None:
        if self.down_since is None:
            return
        seconds = time.monotonic() - self.down_since
        self.outage_seconds += seconds
        self.outages += 1
        self.down_since = None
        self._back.set()
        self._back = asyncio.Event()
        self._log(f"sandbox {self.where} answers again after {seconds:.1f} s; the waiting calls are retried")

    async def call(self, attempt: Callable[[], Awaitable[Any]], *, session: bool = False) -> Any:
        """The result of ``attempt()`` (one sandbox call), tried again as the policy says; ``session``: a
        session call (tried again only if it was never delivered)."""
        policy = self.policy
        delay, tries = policy.backoff[0], 0
        while True:
            result = await attempt()
            kind = failure_kind(result)
            if kind is None:
                self._answered()
                return result
            reason = f"{result.error_type or result.status}: {_first_line(result.stderr)}"
            if kind == "rejected":
                raise SandboxUnavailable(f"the sandbox {self.where} rejects the calls ({reason}): no wait "
                                         "helps; check its URL and token")
            if session and not (kind == "outage" and result.error_type == _NEVER_DELIVERED):
                return result  # it may have run: its session's state may have moved
            if kind == "worker":
                self._answered()  # the service itself answered
                self.worker_deaths += 1
                if self.worker_deaths == 1:
                    self._log(f"sandbox {self.where}: a worker died under a call; the server restarts its "
                              "workers and the call runs again")
                if tries >= self.worker_retries:
                    return result
            if not tries:
                self.retried_calls += 1
            self.attempts += 1
            tries += 1
            if kind == "outage":
                await self._wait(reason, delay)
                delay = min(2 * delay, policy.backoff[1])

    async def _wait(self, reason: str, delay: float) -> None:
        """One back-off sleep of a call that found the service down (cut short when it answers again);
        raises :class:`SandboxUnavailable` once the outage has lasted the budget."""
        budget = self.policy.budget_s
        now = time.monotonic()
        self._last_error = reason
        if self.down_since is None:
            self.down_since = now
            self._log(f"sandbox {self.where} is not answering ({reason}); the calls wait for it, up to "
                      f"{budget:g} s")
        waited = now - self.down_since
        if waited >= budget:
            self._raise_unavailable(waited)
        back = self._back
        await self._maybe_restart()
        try:
            await asyncio.wait_for(back.wait(), min(delay * random.uniform(0.5, 1.5), budget - waited + 0.01))
        except TimeoutError:
            pass

    def _raise_unavailable(self, waited: float) -> None:
        restarts = f", restarted it {self.restarts} times" if self.restarts else ""
        backoff = self.policy.backoff
        raise SandboxUnavailable(
            f"the sandbox {self.where} did not answer for {waited:.0f} s (outage budget "
            f"{self.policy.budget_s:g} s): {self.retried_calls} calls were tried {self.attempts} more times "
            f"with back-off from {backoff[0]:g} to {backoff[1]:g} s{restarts}; last error: "
            f"{self._last_error}")

    async def _maybe_restart(self) -> None:
        """Run the policy's ``restart`` (one at a time, on a worker thread; the calls that find it running go
        on waiting); after a restart every waiting call tries again at once."""
        if self.policy.restart is None or self._restarting:
            return
        self._restarting = True
        try:
            line = await asyncio.get_running_loop().run_in_executor(None, self.policy.restart)
        except Exception as error:  # noqa: BLE001  (a failed restart is one more thing the calls wait out)
            self._last_error = f"restarting it failed: {type(error).__name__}: {_first_line(str(error))}"
            self._log(f"sandbox {self.where}: {self._last_error}")
            return
        finally:
            self._restarting = False
        if line:
            self.restarts += 1
            self._log(line)
            self._back.set()
            self._back = asyncio.Event()
