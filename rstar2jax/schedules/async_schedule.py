"""The asynchronous schedule (``rl.schedule="async"``): a producer rolls out continuously beside the trainer,
at most ``rl.max_staleness`` (eta) policy versions behind, and the trainer takes its next batch as soon as
enough complete groups wait.

The producer is the rollout's engine and its agent sessions (``rollout_fn.stream``, below), one engine per
rollout device (``rstar2jax.schedules.placement``), running in the background from a stage's first step to its
last. The trainer releases problems to it a batch at a time: at version v (the trainer's step, the version of
the weights the engine samples with) it may have released batches 0 .. v - s0 + eta of the stage (s0: the
stage's first step), so a group's *release version* r, below which none of its tokens was sampled, is at
least its batch's number minus eta. Each step takes the oldest unconsumed batch's size in complete groups
(all 2G rollouts finished and scored): every group released at r <= v - eta (it could not be trained later)
and, to fill it, the other complete groups oldest first; it waits until those are complete. At most a
batch's worth of groups is ever that old (count the groups released by version v - eta against those
consumed), so the batch always fits them, and no trained token was sampled more than eta versions before
the parameters it updates: a guarantee, not a tendency. ``max_staleness=0`` releases one batch per step
after the update, with the synchronous schedule's seeds: the synchronous schedule's batches and losses.

After every update the new weights go to the engines in flight (``updated``: copied into each engine's
layout, ``placement.engine_copy``; ``rollout.on_update`` says what running sequences do) and every token
keeps the version that sampled it. At a stage's end every released group has been consumed and the
engines stop (the next stage has its own budgets). The schedule's state between steps is one value
(``rstar2jax.schedules.schedule_state.AsyncState``: batches released and consumed, their sizes, the released
groups not yet trained and the finished ones' trajectories, the run's counts), checkpointed at every step as
versioned JSON; a resumed run trains the finished groups and issues the unfinished ones again, from scratch,
at the resumed version. Every released group is trained once or counted dropped with its reason
(``async/groups_dropped_total{reason="no_trajectory"}``: every rollout lost to the sandbox;
``{reason="stage_end"}``: released and not trained when its stage ended, said in the log).

The stream a ``rollout_fn`` offers (``SupportsStream`` and ``TrajectoryStream`` of
``rstar2jax.data.rollout_contract``; ``rstar2jax.agent.PolicyRollout.stream``)::

    stream = rollout_fn.stream(params, policy_version=, samples_per_problem=, max_response_length=,
                               max_turns=, on_update=, device=)
    stream.submit(key, problem, seed=, index=)   # one group: group ``index`` of a call seeded ``seed``
    stream.update_weights(params, policy_version) # from the engine's next step on; returns once queued
    stream.wait(timeout) -> [(key, trajectories)] # groups finished since the last call (raises its error)
    stream.stats() -> {name: count}               # cumulative: busy_s, generated_tokens, sandbox counts
    stream.close()                                # cancels what runs, stops the engine

A ``rollout_fn`` with ``policy_params(params)`` (``SupportsPolicyParams``, a LoRA run's) gives the weights
the engine samples with.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from rstar2jax.data.problems import Problem, ProblemIterator
from rstar2jax.data.rollout_contract import SupportsPolicyParams, SupportsStream
from rstar2jax.schedules.multihost import gather_to_all_processes
from rstar2jax.schedules.placement import engine_copy
from rstar2jax.schedules.schedule import (
    CARRY_META_KEY,
    RolloutSchedule,
    seed_from_key,
    tag_versions,
    unique_problems,
)
from rstar2jax.schedules.schedule_state import (
    STATE_META_KEY,
    AsyncState,
    ScheduleInvariantError,
    Ticket,
    legacy_async_state,
)

logger = logging.getLogger(__name__)

#: The checkpoint meta key of the run's group counts before ``AsyncState`` (read from old checkpoints).
LEGACY_LEDGER_META_KEY = "async_groups"
#: Seconds between looks at the other processes' finished groups (several processes only).
POLL_S = 0.05


class Producer:
    """The open streams of a stage (one per rollout device), what is in flight on each, and their counts."""

    def __init__(self, rollout_fn: SupportsStream, params, version: int, options: dict[str, int], *,
                 devices: Sequence[Any], dtype, on_update: str):
        self.devices, self.dtype = list(devices), dtype
        # The weights the engines sample with: the trainer's, or the rollout's of them (LoRA: merged).
        merges = isinstance(rollout_fn, SupportsPolicyParams)
        self.policy_params = rollout_fn.policy_params if merges else None
        copies = self.place(params)
        self.streams = [rollout_fn.stream(copy, policy_version=version, **options, on_update=on_update,
                                          device=device) for copy, device in zip(copies, self.devices,
                                                                                 strict=True)]
        self.in_flight = [set() for _ in self.streams]
        self.seen = collections.Counter()  # the streams' counts at the last look
        self.window = time.perf_counter()

    def place(self, params) -> list:
        """The engines' copies of the trainer's ``params`` (LoRA: merged), one per rollout device."""
        params = self.policy_params(params) if self.policy_params is not None else params
        return [engine_copy(params, device, self.dtype) for device in self.devices]

    def submit(self, ticket: Ticket) -> None:
        """Start ``ticket``'s group on the least loaded engine."""
        index = min(range(len(self.streams)), key=lambda i: len(self.in_flight[i]))
        self.streams[index].submit(ticket.key, ticket.problem, seed=ticket.seed, index=ticket.group_index)
        self.in_flight[index].add(ticket.key)

    def finished(self, timeout: float | None) -> list[tuple[Hashable, list]]:
        """Groups finished since the last look, waiting up to ``timeout`` (None: until one) for the first."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            done = []
            for stream, flight in zip(self.streams, self.in_flight, strict=True):
                for key, group in stream.wait(0.0 if done or len(self.streams) > 1 else timeout):
                    flight.discard(key)
                    done.append((key, group))
            if done or (deadline is not None and time.perf_counter() >= deadline):
                return done
            if len(self.streams) > 1:
                time.sleep(0.005)

    def update(self, params, version: int) -> float:
        """Copy the new weights into every engine (they decode meanwhile); seconds until all are queued."""
        start = time.perf_counter()
        copies = jax.block_until_ready(self.place(params))
        for stream, copy in zip(self.streams, copies, strict=True):
            stream.update_weights(copy, version)
        return time.perf_counter() - start

    def counts(self) -> tuple[collections.Counter, float]:
        """The streams' counts since the last look and the seconds that window lasted."""
        now, total = time.perf_counter(), collections.Counter()
        for stream in self.streams:
            total.update(stream.stats())
        delta = collections.Counter({k: v - self.seen[k] for k, v in total.items()})
        seconds, self.seen, self.window = now - self.window, total, now
        return delta, seconds

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
        self.streams = []


def _global(items: list) -> list:
    """Every process's ``items`` (in process order); the items themselves with one process."""
    return gather_to_all_processes(items) if jax.process_count() > 1 else items


class AsyncSchedule(RolloutSchedule):
    """``rl.schedule="async"`` (see the module doc); the rollout needs ``stream`` (``SupportsStream``). A
    shell around ``state`` (an ``AsyncState``) that runs the producer and gathers the processes' finished
    groups.

    Args:
      max_staleness: eta, the most policy versions a trained token may lag the parameters it updates.
      devices: this process's rollout devices, one engine each (``placement.rollout_devices``).
      dtype: the engines' compute dtype (their copies of the weights are cast to it; None: kept).
      on_update: what running sequences do when new weights arrive ("keep" or "recompute").
    """

    needs = SupportsStream

    def __init__(self, max_staleness: int, *, devices: Sequence[Any], dtype=None, on_update: str = "keep"):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.eta, self.devices, self.dtype, self.on_update = max_staleness, list(devices), dtype, on_update
        self.producer: Producer | None = None
        self.state = AsyncState()
        self.stage_steps = 0
        self.drawn: list[list[Problem]] = []  # drawn this step, released by its rollouts
        self.taken: tuple[Ticket, ...] = ()  # the last step's groups, in its order
        self._reissue: tuple = ()  # a resumed stage: the groups in flight when it stopped
        self._dropped_now = 0
        self._window_counts, self._window_seconds = collections.Counter(), 0.0

    def begin_stage(self, steps: int, done: int) -> None:
        """The stage has ``steps`` steps to run in all (its own, or fewer when the run stops earlier), of
        which ``done`` ran already (a resumed run)."""
        self.stage_steps, self.state = steps, self.state.at_step(done)
        self.state.check(self.eta)

    def draw(self, iterator: ProblemIterator, *, stage_last: bool) -> list[Problem]:
        """The batches the throttle lets out now: up to ``consumed + eta + 1`` in the stage, at most its
        steps."""
        allowed = self.state.allowed(self.stage_steps, self.eta)
        while self.state.released + len(self.drawn) < allowed:
            self.drawn.append(unique_problems(next(iterator)))
        return [p for batch in self.drawn for p in batch]

    def rollouts(self, rollout_fn, params, problems, *, options, rollout_key, version, stats):
        """Starts the producer (a stage's first step), releases this step's new batches (batch j of them
        seeded as the synchronous schedule's rollout, ``fold_in(rollout_key, j)`` after the first), waits for
        the step's groups and returns them (release order), with the schedule's counts."""
        del problems  # what ``draw`` gave: its batches are in ``self.drawn``
        me = jax.process_index()
        if self.producer is None:
            self.producer = Producer(rollout_fn, params, version, options, devices=self.devices,
                                     dtype=self.dtype, on_update=self.on_update)
            self.state, again = self.state.reissue(self._reissue, version)  # from scratch, at this version
            self._reissue = ()
            for ticket in again:
                if ticket.owner == me:
                    self.producer.submit(ticket)
        for j, batch in enumerate(self.drawn):
            key = rollout_key if j == 0 else jax.random.fold_in(rollout_key, j)
            self.state, new = self.state.release(batch, seed=seed_from_key(key), version=version,
                                                 processes=jax.process_count())
            for ticket in new:
                if ticket.owner == me:
                    self.producer.submit(ticket)
        self.drawn = []
        start = time.perf_counter()
        keys = self._wait(version)
        groups = self._take(keys, version)
        counts, seconds = self.producer.counts()
        stats.update({k: v for k, v in counts.items() if k not in ("busy_s", "generated_tokens")})
        self._window_counts.update(counts)
        self._window_seconds += seconds
        self.state.check(self.eta)
        return [t.problem for t in self.taken], groups, self._metrics(time.perf_counter() - start)

    def release_versions(self, groups, version: int) -> list[int]:
        """The versions the last step's groups were released (or issued again) at."""
        del groups, version
        return [t.version for t in self.taken]

    def _complete(self) -> set:
        """The keys of every process's finished groups."""
        finished = sorted(self.state.finished)
        return set(_global(finished) if jax.process_count() > 1 else finished)

    def _wait(self, version: int) -> list:
        """The keys of this step's groups, once complete (every process agrees on them)."""
        several = jax.process_count() > 1
        timeout = 0.0
        while True:
            for key, group in self.producer.finished(timeout):
                self.state = self.state.finish(key, group)
            complete = self._complete()
            keys = self.state.choose(complete, version, self.eta)
            if keys is not None:
                return keys
            if not several and not any(self.producer.in_flight):
                raise ScheduleInvariantError(
                    "a waiting step has groups in flight", f"step at version {version} waits for "
                    f"{self.state.step_size()} groups, {len(complete)} complete of {len(self.state.tickets)} "
                    "released")
            timeout = POLL_S if several else None

    def _take(self, keys: list, version: int) -> list[list]:
        """The groups of ``keys`` (gathered from the processes that own them), tagged with versions; they
        leave the tickets, counted trained or dropped."""
        mine = [(key, self.state.finished[key]) for key in keys if key in self.state.finished]
        found = dict(_global(mine))
        self.taken = tuple(self.state.ticket(key) for key in keys)
        before = self.state.ledger.dropped_by("no_trajectory")
        self.state = self.state.take(keys, found)
        self._dropped_now = self.state.ledger.dropped_by("no_trajectory") - before
        return [tag_versions(found.get(t.key, ()), t.version) for t in self.taken]

    def _metrics(self, wait_seconds: float) -> dict[str, float]:
        complete = len(self._complete())
        return {
            "async/wait_s": wait_seconds,
            "async/buffer_depth": float(complete),  # finished groups waiting for a later step
            "async/in_flight": float(len(self.state.tickets) - complete),
            "async/groups_dropped": float(self._dropped_now),
            **self.state.ledger.metrics(),
        }

    def updated(self, params, version: int, *, update_seconds: float, trained_tokens: float) -> dict:
        """The update to ``version`` is done: its weights go to the engines in flight. Returns the step's
        producer figures: weight-update seconds, the fractions of the step the engines' step loops had work
        (``rollout_busy``) and the trainer updated (``trainer_busy``), tokens generated and trained per
        second."""
        if self.producer is None:
            return {}
        weight_seconds = self.producer.update(params, version)
        counts, seconds = self.producer.counts()
        counts.update(self._window_counts)
        self._window_counts = collections.Counter()
        seconds = max(seconds + self._window_seconds, 1e-9)
        self._window_seconds = 0.0
        busy = counts["busy_s"] / len(self.producer.streams)
        return {
            "async/weight_update_s": weight_seconds,
            "async/rollout_busy": min(busy / seconds, 1.0),
            "async/trainer_busy": min(update_seconds / seconds, 1.0),
            "throughput/generated_tokens_per_s": counts["generated_tokens"] / seconds,
            "throughput/trained_tokens_per_s": trained_tokens / seconds,
        }

    @property
    def empty(self) -> bool:
        return self.state.empty and not self.drawn

    def end_stage(self) -> None:
        """The stage is over (or the run stops): the engines stop; what was released and not trained is
        dropped, counted (reason ``stage_end``) and said once in the log (the throttle releases no more than
        the stage trains, so there is none unless it broke)."""
        self.close()
        self.state, dropped = self.state.end_stage()  # a fresh stage's state, the run's counts kept
        self.drawn, self._reissue = [], ()
        if dropped and jax.process_index() == 0:
            logger.warning("the stage ended with %d released groups untrained: counted in "
                           'async/groups_dropped_total{reason="stage_end"}', dropped)

    def close(self) -> None:
        """Stops the engines, cancelling what they run (the checkpoint keeps it to issue again)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def checkpoint_meta(self) -> dict[str, Any]:
        """The state, every process's finished groups gathered, as versioned JSON."""
        state = self.state
        if jax.process_count() > 1:
            state = dataclasses.replace(state, finished=dict(_global(sorted(state.finished.items()))))
        return {STATE_META_KEY: state.to_dict()}

    def restore(self, meta: dict[str, Any]) -> None:
        """Takes up the state ``checkpoint_meta`` saved (or, of a checkpoint written before it, the pickled
        carry); the groups no process had finished are issued again when the producer starts."""
        self.close()
        self.drawn = []
        if meta.get(STATE_META_KEY) is not None:
            state = AsyncState.from_dict(meta[STATE_META_KEY])
        else:
            state = legacy_async_state(meta.get(CARRY_META_KEY), meta.get(LEGACY_LEDGER_META_KEY))
        self._reissue = state.unfinished()
        me = jax.process_index()
        self.state = dataclasses.replace(state, finished={k: g for k, g in state.finished.items()
                                                          if state.ticket(k).owner == me})
