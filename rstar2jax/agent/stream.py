"""Rollouts as a stream (:meth:`PolicyRollout.stream <rstar2jax.agent.PolicyRollout.stream>`): one engine
that runs from the stream's opening to its close, groups started whenever they are submitted, finished groups
handed back as they finish, new weights taken in flight. The producer of the trainer's asynchronous schedule
(``rstar2jax.schedules.async_schedule``, whose module doc gives the protocol)::

    stream = rollout_fn.stream(params, policy_version=0, samples_per_problem=8, max_response_length=256,
                               max_turns=3)
    stream.submit(key, problem, seed=seed, index=0)   # group 0 of a call seeded ``seed``: the same tokens
    stream.update_weights(new_params, 1)              # sessions go on; new tokens carry version 1
    for key, trajectories in stream.wait(timeout=1.0): ...
    stream.close()

The stream is built from a :class:`StreamSpec` (an engine factory, a session factory and the event loop),
which :meth:`PolicyRollout.stream <rstar2jax.agent.PolicyRollout.stream>` makes of the rollout. Each group
runs the session loop of a rollout call (:class:`~rstar2jax.agent.session.SessionLoop`): tool calls in the
sandbox under the rollout's outage policy (one outage tracker for the stream), answers graded, trajectories
whose tool call failed for the sandbox's own reasons dropped from their group. A sandbox down past the
outage budget fails the stream: :meth:`RolloutStream.wait` raises its
:class:`~rstar2jax.agent.outage.SandboxUnavailable`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import queue
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Protocol

import jax

from rstar2jax.agent.rollout_types import RolloutEngine, drop_infra_failures
from rstar2jax.agent.session import SessionLoop
from rstar2jax.data.problems import Problem


class EventLoop(Protocol):
    """What a stream needs of the event loop its sessions run on (``multi_turn.BackgroundLoop`` has it)."""

    def start(self, coroutine: Coroutine) -> concurrent.futures.Future: ...

    def run(self, coroutine: Coroutine) -> Any: ...


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """What a :class:`RolloutStream` needs of the rollout that opens it
    (:meth:`PolicyRollout.stream <rstar2jax.agent.PolicyRollout.stream>` makes it of itself).

    Attributes:
      engine: ``engine(params, max_response_length, policy_version)``: an engine, not started, long enough
        for a prompt and that response budget (``PolicyRollout.engine_for``).
      sessions: ``sessions(engine, max_response_length, max_turns)``: the session loop of the stream's
        groups on ``engine``, with no call seed (each group is seeded when submitted).
      loop: the event loop the sessions run on (the rollout's: its sandbox client is bound to it).
    """

    engine: Callable[[Any, int, int], RolloutEngine]
    sessions: Callable[[RolloutEngine, int, int], SessionLoop]
    loop: EventLoop


class RolloutStream:
    """Rollouts as a stream (module doc) on the engine ``spec.engine`` builds on ``device`` (None: the
    default device) with ``params`` (its own copy: the engine keeps the buffers), sampling at
    ``policy_version``; ``on_update``: what running sequences do when new weights arrive
    (:meth:`~rstar2jax.engine.EngineCore.update_weights`)."""

    def __init__(self, spec: StreamSpec, params, *, policy_version: int, samples_per_problem: int,
                 max_response_length: int, max_turns: int, on_update: str = "keep", device=None):
        self.loop, self.samples_per_problem, self.on_update = spec.loop, samples_per_problem, on_update
        with jax.default_device(device) if device is not None else contextlib.nullcontext():
            self.engine = spec.engine(params, max_response_length, policy_version)
        self.core = self.engine.core
        self.run = spec.sessions(self.engine, max_response_length, max_turns)
        self.finished: queue.Queue = queue.Queue()
        self.futures: dict[Hashable, object] = {}
        self.tasks: set[asyncio.Task] = set()
        self.dropped = 0
        self.loop.run(self.engine.__aenter__())

    def submit(self, key: Hashable, problem: Problem, *, seed: int, index: int) -> None:
        """Start ``problem``'s group (``samples_per_problem`` sessions), seeded as group ``index`` of a
        rollout call seeded ``seed``; it comes back from :meth:`wait` under ``key``."""
        self.futures[key] = self.loop.start(self._group(key, problem, seed, index))

    async def _group(self, key: Hashable, problem: Problem, seed: int, index: int) -> None:
        self.tasks.add(asyncio.current_task())
        try:
            trajectories = await self.run.problem(index, problem, self.samples_per_problem, seed=seed)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the sandbox gone past its budget, a bug: the trainer hears of it
            self.finished.put(error)
            raise
        finally:
            self.tasks.discard(asyncio.current_task())
        kept, dropped = drop_infra_failures(trajectories)
        self.dropped += dropped
        self.finished.put((key, kept))

    def update_weights(self, params, policy_version: int) -> None:
        """Sample with ``params`` (version ``policy_version``) from the engine's next step on; returns once
        the engine has queued them (the step in flight keeps the old ones)."""
        self.loop.run(self.engine.update_weights(params, policy_version, on_update=self.on_update))

    def wait(self, timeout: float | None) -> list[tuple[Hashable, list]]:
        """The groups finished since the last call, waiting up to ``timeout`` seconds (None: until one) for
        the first; raises what failed a group."""
        found = []
        try:
            found.append(self.finished.get(timeout=timeout) if timeout != 0.0 else self.finished.get_nowait())
            while True:
                found.append(self.finished.get_nowait())
        except queue.Empty:
            pass
        for item in found:
            if isinstance(item, BaseException):
                raise item
            self.futures.pop(item[0], None)
        return found

    def stats(self) -> dict[str, float]:
        """Counts since the stream opened: ``busy_s`` (seconds the engine's step loop had work),
        ``generated_tokens``, the sandbox's (``sandbox_outage_s``, ``sandbox_retried_calls``, ...) and
        ``trajectories_dropped_for_sandbox_failures``."""
        counts = collections.Counter(self.run.outage.stats())
        counts.update(busy_s=float(self.core.stats["busy_s"]),
                      generated_tokens=float(self.core.stats["sampled_tokens"]),
                      trajectories_dropped_for_sandbox_failures=float(self.dropped))
        return dict(counts)

    def close(self) -> None:
        """Cancel the groups in flight (their sessions and tool calls stop) and stop the engine; closing
        twice is harmless."""
        for future in self.futures.values():
            future.cancel()
        self.futures = {}
        if self.engine is not None:
            self.loop.run(self._stop())
            self.engine = None

    async def _stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.engine.__aexit__(None, None, None)
