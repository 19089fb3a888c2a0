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
engines stop (the next stage has its own budgets). What waits is checkpointed (``rollout_carry``): the
released groups not yet trained, with the finished ones' trajectories; a resumed run trains the finished
ones and issues the unfinished ones again, from scratch, at the resumed version. Every released group is
trained once or counted dropped (``async/groups_dropped``: no trajectory left, every one lost to the
sandbox).

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
import time
from collections.abc import Hashable, Sequence
from typing import Any

import jax

from rstar2jax.data.problems import Problem, ProblemIterator
from rstar2jax.data.rollout_contract import SupportsPolicyParams, SupportsStream
from rstar2jax.schedules.multihost import gather_to_all_processes
from rstar2jax.schedules.placement import engine_copy
from rstar2jax.schedules.schedule import (
    _CarryingSchedule,
    seed_from_key,
    tag_versions,
    unique_problems,
)

#: The checkpoint meta key of the asynchronous schedule's counts over the run (``AsyncSchedule.ledger``).
LEDGER_META_KEY = "async_groups"
#: Seconds between looks at the other processes' finished groups (several processes only).
POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A released group: ``index``-th problem of the stage's ``batch``-th batch, rolled out by process
    ``owner`` as group ``group_index`` of a call seeded ``seed``; ``version``: the policy version at release
    (its tokens are at least that new)."""

    batch: int
    index: int
    problem: Problem
    seed: int
    group_index: int
    owner: int
    version: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.batch, self.index)


def choose_batch(tickets: dict[Hashable, Ticket], complete: set, size: int, version: int,
                 max_staleness: int) -> list | None:
    """The keys of the groups a step at ``version`` trains (release order), or None while they are not
    complete: every unconsumed group released at version <= ``version - max_staleness`` and, up to ``size``
    groups, the other ``complete`` ones oldest first."""
    due = {key for key, t in tickets.items() if t.version <= version - max_staleness}
    if len(due) > size:
        raise RuntimeError(f"{len(due)} groups are due at version {version}, more than a batch of {size}: "
                           "the release throttle was broken")
    if not due <= complete or len(complete) < size:
        return None
    others = sorted(complete - due, key=lambda key: tickets[key].key)
    return sorted(due | set(others[: size - len(due)]), key=lambda key: tickets[key].key)


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


class AsyncSchedule(_CarryingSchedule):
    """``rl.schedule="async"`` (see the module doc); the rollout needs ``stream`` (``SupportsStream``).

    Args:
      max_staleness: eta, the most policy versions a trained token may lag the parameters it updates.
      devices: this process's rollout devices, one engine each (``placement.rollout_devices``).
      dtype: the engines' compute dtype (their copies of the weights are cast to it; None: kept).
      on_update: what running sequences do when new weights arrive ("keep" or "recompute").

    Attributes:
      tickets: the released groups not yet trained, by key; ``complete``: this process's finished ones.
      ledger: over the run, groups ``released``, ``trained`` and ``dropped`` (no trajectory left).
    """

    needs = SupportsStream

    def __init__(self, max_staleness: int, *, devices: Sequence[Any], dtype=None, on_update: str = "keep"):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.eta, self.devices, self.dtype, self.on_update = max_staleness, list(devices), dtype, on_update
        self.producer: Producer | None = None
        self.ledger = collections.Counter(released=0, trained=0, dropped=0)
        self.stage_steps, self.consumed = 0, 0
        self.end_stage()

    def begin_stage(self, steps: int, done: int) -> None:
        """The stage has ``steps`` steps to run in all (its own, or fewer when the run stops earlier), of
        which ``done`` ran already (a resumed run)."""
        self.stage_steps, self.consumed = steps, done

    def draw(self, iterator: ProblemIterator, *, stage_last: bool) -> list[Problem]:
        """The batches the throttle lets out now: up to ``consumed + eta + 1`` in the stage, at most its
        steps."""
        allowed = min(self.consumed + self.eta + 1, self.stage_steps)
        while self.released < allowed:
            self.drawn.append(unique_problems(next(iterator)))
            self.released += 1
        return [p for batch in self.drawn for p in batch]

    def rollouts(self, rollout_fn, params, problems, *, options, rollout_key, version, stats):
        """Starts the producer (a stage's first step), releases this step's new batches (batch j of them
        seeded as the synchronous schedule's rollout, ``fold_in(rollout_key, j)`` after the first), waits for
        the step's groups and returns them (release order), with the schedule's counts."""
        del problems  # what ``draw`` gave: its batches are in ``self.drawn``
        if self.producer is None:
            self.producer = Producer(rollout_fn, params, version, options, devices=self.devices,
                                     dtype=self.dtype, on_update=self.on_update)
            for key in self._reissue:  # a resumed run: what was in flight is issued again, at this version
                self.tickets[key] = dataclasses.replace(self.tickets[key], version=version)
                if self.tickets[key].owner == jax.process_index():
                    self.producer.submit(self.tickets[key])
            self._reissue = []
        for j, batch in enumerate(self.drawn):
            key = rollout_key if j == 0 else jax.random.fold_in(rollout_key, j)
            self._release(batch, self.released - len(self.drawn) + j, seed_from_key(key), version)
        self.drawn = []
        start = time.perf_counter()
        keys = self._wait(version)
        groups = self._take(keys, version)
        counts, seconds = self.producer.counts()
        stats.update({k: v for k, v in counts.items() if k not in ("busy_s", "generated_tokens")})
        self._window_counts.update(counts)
        self._window_seconds += seconds
        self.consumed += 1
        return [self._taken[k].problem for k in keys], groups, self._metrics(time.perf_counter() - start)

    def _release(self, batch: list[Problem], number: int, seed: int, version: int) -> None:
        processes, me = jax.process_count(), jax.process_index()
        self.batch_sizes[number] = len(batch)
        for i, problem in enumerate(batch):
            ticket = Ticket(number, i, problem, seed + i % processes, i // processes, i % processes, version)
            self.tickets[ticket.key] = ticket
            self.ledger["released"] += 1
            if ticket.owner == me:
                self.producer.submit(ticket)

    def _wait(self, version: int) -> list:
        """The keys of this step's groups, once complete (every process agrees on them)."""
        size = self.batch_sizes[self.consumed]  # step c of the stage takes as many groups as batch c holds
        several = jax.process_count() > 1
        timeout = 0.0
        while True:
            for key, group in self.producer.finished(timeout):
                self.complete[key] = group
            complete = set(_global(sorted(self.complete))) if several else set(self.complete)
            keys = choose_batch(self.tickets, complete, size, version, self.eta)
            if keys is not None:
                return keys
            if not several and not any(self.producer.in_flight):
                raise RuntimeError(f"step at version {version} waits for {size} groups but none is in flight "
                                   f"({len(complete)} complete of {len(self.tickets)} released)")
            timeout = POLL_S if several else None

    def _take(self, keys: list, version: int) -> list[list]:
        """The groups of ``keys`` (gathered from the processes that own them), tagged with versions; they
        leave the tickets, counted trained or dropped."""
        mine = [(key, self.complete.pop(key)) for key in keys if key in self.complete]
        found = dict(_global(mine))
        self._taken = {key: self.tickets.pop(key) for key in keys}
        groups = [tag_versions(found[key], self._taken[key].version) for key in keys]
        self.ledger["trained"] += sum(1 for g in groups if g)
        self.ledger["dropped"] += sum(1 for g in groups if not g)
        self._dropped_now = sum(1 for g in groups if not g)
        return groups

    def _metrics(self, wait_seconds: float) -> dict[str, float]:
        complete = len(_global(sorted(self.complete))) if jax.process_count() > 1 else len(self.complete)
        return {
            "async/wait_s": wait_seconds,
            "async/buffer_depth": float(complete),  # finished groups waiting for a later step
            "async/in_flight": float(len(self.tickets) - complete),
            "async/groups_dropped": float(self._dropped_now),
            **{f"async/groups_{name}_total": float(count) for name, count in self.ledger.items()},
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
        return not self.tickets and not self.drawn

    def end_stage(self) -> None:
        """The stage is over (or the run stops): the engines stop; what was released and not trained is
        dropped (at a stage's end there is none)."""
        self.close()
        self.tickets: dict[Hashable, Ticket] = {}
        self.complete: dict[Hashable, list] = {}
        self.batch_sizes: dict[int, int] = {}
        self.drawn: list[list[Problem]] = []
        self._reissue: list[Hashable] = []
        self.released = 0
        self._taken: dict[Hashable, Ticket] = {}
        self._dropped_now = 0
        self._window_counts, self._window_seconds = collections.Counter(), 0.0

    def close(self) -> None:
        """Stops the engines, cancelling what they run (the checkpoint keeps it to issue again)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def checkpoint_meta(self) -> dict[str, Any]:
        return {**super().checkpoint_meta(), LEDGER_META_KEY: dict(self.ledger)}

    def _carried(self) -> dict[str, Any]:
        complete = dict(_global(sorted(self.complete.items())))
        return {"tickets": list(self.tickets.values()), "complete": complete,
                "batch_sizes": self.batch_sizes, "released": self.released}

    def restore(self, meta: dict[str, Any]) -> None:
        super().restore(meta)
        self.ledger = collections.Counter(meta.get(LEDGER_META_KEY) or dict(released=0, trained=0, dropped=0))

    def _take_up(self, carried: dict[str, Any]) -> None:
        me = jax.process_index()
        self.tickets = {t.key: t for t in carried["tickets"]}
        self.complete = {k: g for k, g in carried["complete"].items() if self.tickets[k].owner == me}
        self._reissue = sorted(k for k in self.tickets if k not in carried["complete"])
        self.batch_sizes, self.released = carried["batch_sizes"], carried["released"]
