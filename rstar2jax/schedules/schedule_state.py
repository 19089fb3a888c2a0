"""The asynchronous schedule's state between steps as one value (``AsyncState``) with pure transitions, and
its checkpoint form: versioned JSON, trajectories as declared records (``trajectory_to_dict``).

The producer and the gathering across processes (``rstar2jax.schedules.async_schedule``) are a shell around
it: they submit what ``release`` / ``reissue`` return, hand finished groups to ``finish``, ask ``choose``
which groups a step trains and ``take`` them. The state says, at every step boundary, everything a resumed
run needs: the stage's batches released and consumed, each released batch's size, the released groups not
trained yet (``tickets``), the finished ones among them with their trajectories, and the run's counts.

Invariants (a broken one raises ``ScheduleInvariantError`` naming it):
  * ``consumed <= released <= consumed + eta + 1`` (the release throttle) and ``released <= stage steps``;
  * at most one batch's worth of groups is due (released ``eta`` or more versions ago);
  * the tickets are exactly the released groups not yet trained or dropped (the ledger adds up).

A checkpoint written before this state existed kept the untrained groups as a pickle (``rollout_carry``);
``legacy_async_state`` reads it once (only ``Ticket``, ``Problem`` and ``Trajectory`` are let out of it) and
a checkpoint without one (nothing waited) starts the stage's counts at its steps done.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from rstar2jax.data.problems import Problem
from rstar2jax.data.rollout_contract import record_types
from rstar2jax.data.trajectory import Trajectory, trajectory_from_dict, trajectory_to_dict

#: The format of ``AsyncState.to_dict`` (a later format reads the earlier ones).
STATE_FORMAT = 1
#: The checkpoint meta key of the asynchronous schedule's state.
STATE_META_KEY = "async_state"
#: Why a released group was not trained: all its rollouts lost (to the sandbox), or its stage ended first.
DROP_REASONS = ("no_trajectory", "stage_end")

Key = tuple[int, int]


class ScheduleInvariantError(RuntimeError):
    """A schedule invariant broke (a bug, not a user error): ``invariant`` names it; a one-line message."""

    def __init__(self, invariant: str, detail: str):
        super().__init__(f"schedule invariant broken: {invariant} ({detail})")
        self.invariant, self.detail = invariant, detail


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
    def key(self) -> Key:
        return (self.batch, self.index)

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "index": self.index, "problem": self.problem.to_dict(),
                "seed": self.seed, "group_index": self.group_index, "owner": self.owner,
                "version": self.version}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Ticket:
        return cls(record["batch"], record["index"], Problem.from_dict(record["problem"]), record["seed"],
                   record["group_index"], record["owner"], record["version"])


@dataclasses.dataclass(frozen=True)
class Ledger:
    """Over the run: groups released, trained, and dropped per reason (``DROP_REASONS``)."""

    released: int = 0
    trained: int = 0
    dropped: tuple[tuple[str, int], ...] = tuple((reason, 0) for reason in DROP_REASONS)

    def drop(self, reason: str, count: int) -> Ledger:
        if reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {reason!r}; expected one of {DROP_REASONS}")
        dropped = tuple((r, n + count * (r == reason)) for r, n in self.dropped)
        return dataclasses.replace(self, dropped=dropped)

    def dropped_by(self, reason: str) -> int:
        return dict(self.dropped)[reason]

    @property
    def dropped_total(self) -> int:
        return sum(n for _, n in self.dropped)

    def metrics(self) -> dict[str, float]:
        """``async/groups_{released,trained,dropped}_total`` and the drops by reason, Prometheus-style:
        ``async/groups_dropped_total{reason="stage_end"}``."""
        return {"async/groups_released_total": float(self.released),
                "async/groups_trained_total": float(self.trained),
                "async/groups_dropped_total": float(self.dropped_total),
                **{f'async/groups_dropped_total{{reason="{r}"}}': float(n) for r, n in self.dropped}}

    def to_dict(self) -> dict[str, Any]:
        return {"released": self.released, "trained": self.trained, "dropped": dict(self.dropped)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Ledger:
        dropped = record.get("dropped", {})
        if not isinstance(dropped, Mapping):  # before drop reasons: every drop was a lost group
            dropped = {"no_trajectory": dropped}
        counts = tuple((r, int(dropped.get(r, 0))) for r in DROP_REASONS)
        return cls(record["released"], record["trained"], counts)


@dataclasses.dataclass(frozen=True)
class AsyncState:
    """The asynchronous schedule between two steps of a stage.

    Attributes:
      released: the stage's batches released so far; ``consumed``: its steps taken (batch ``c`` of the stage
        sets how many groups step ``c`` takes).
      batch_sizes: the groups in each released batch, in order.
      tickets: the released groups not yet taken, in release order.
      finished: the finished groups among them, by key (this process's own; a checkpoint's: every process's).
      ledger: the run's group counts.
    """

    released: int = 0
    consumed: int = 0
    batch_sizes: tuple[int, ...] = ()
    tickets: tuple[Ticket, ...] = ()
    finished: Mapping[Key, tuple[Trajectory, ...]] = dataclasses.field(default_factory=dict)
    ledger: Ledger = Ledger()

    @property
    def empty(self) -> bool:
        """Nothing released waits to be trained."""
        return not self.tickets

    def ticket(self, key: Key) -> Ticket:
        return next(t for t in self.tickets if t.key == key)

    def at_step(self, done: int) -> AsyncState:
        """The state of a stage ``done`` steps in: itself, or (an empty state of a stage start or of a
        checkpoint whose schedule kept nothing) one whose counts start there."""
        if self.consumed == done:
            return self
        if self.empty and self.released == self.consumed:
            return dataclasses.replace(self, released=done, consumed=done, batch_sizes=())
        raise ScheduleInvariantError("the schedule state belongs to its checkpoint's step",
                                     f"{self.consumed} batches consumed, the stage is {done} steps in")

    def allowed(self, stage_steps: int, eta: int) -> int:
        """How many of the stage's batches may be out now: ``consumed + eta + 1``, at most ``stage_steps``
        (its steps left to run, ``max_steps`` included: nothing is released that the stage cannot train)."""
        return min(self.consumed + eta + 1, stage_steps)

    def release(self, problems: Sequence[Problem], *, seed: int, version: int,
                processes: int) -> tuple[AsyncState, tuple[Ticket, ...]]:
        """Releases one batch at ``version``: problem ``i`` is group ``i // processes`` of process
        ``i % processes``'s call seeded ``seed + i % processes``. Returns the state and the new tickets."""
        number = self.released
        new = tuple(Ticket(number, i, p, seed + i % processes, i // processes, i % processes, version)
                    for i, p in enumerate(problems))
        state = dataclasses.replace(
            self, released=number + 1, batch_sizes=(*self.batch_sizes, len(problems)),
            tickets=self.tickets + new,
            ledger=dataclasses.replace(self.ledger, released=self.ledger.released + len(new)))
        return state, new

    def unfinished(self) -> tuple[Key, ...]:
        """The tickets without a finished group (of a checkpoint's state: in no process)."""
        return tuple(t.key for t in self.tickets if t.key not in self.finished)

    def reissue(self, keys: Sequence[Key], version: int) -> tuple[AsyncState, tuple[Ticket, ...]]:
        """A resumed stage: the groups ``keys`` (what was in flight when it stopped) run again from scratch
        at ``version``. Returns the state and their tickets."""
        keys = set(keys)
        tickets = tuple(dataclasses.replace(t, version=version) if t.key in keys else t for t in self.tickets)
        return dataclasses.replace(self, tickets=tickets), tuple(t for t in tickets if t.key in keys)

    def finish(self, key: Key, group: Sequence[Trajectory]) -> AsyncState:
        """Group ``key`` finished with ``group``."""
        if not any(t.key == key for t in self.tickets):
            raise ScheduleInvariantError("a finished group is one released and not taken", f"group {key}")
        return dataclasses.replace(self, finished={**self.finished, key: tuple(group)})

    def step_size(self) -> int:
        """How many groups the next step takes: as many as the stage's batch ``consumed`` holds."""
        if self.consumed >= self.released:
            raise ScheduleInvariantError("a step takes a batch that was released", f"step {self.consumed} "
                                         f"of the stage, {self.released} batches released")
        return self.batch_sizes[self.consumed]

    def choose(self, complete: set, version: int, eta: int) -> list[Key] | None:
        """The keys of the groups a step at ``version`` trains (release order), or None while they are not
        complete: every ticket released at version <= ``version - eta`` (it could not be trained later) and,
        up to the step's size, the other ``complete`` ones oldest first."""
        size = self.step_size()
        due = {t.key for t in self.tickets if t.version <= version - eta}
        if len(due) > size:
            raise ScheduleInvariantError(
                "the release throttle lets at most a batch of groups fall due",
                f"{len(due)} groups are due at version {version}, more than a batch of {size}; "
                f"{self.released} batches released, {self.consumed} consumed")
        if not due <= complete or len(complete) < size:
            return None
        others = sorted(complete - due)
        return sorted(due | set(others[: size - len(due)]))

    def take(self, keys: Sequence[Key], groups: Mapping[Key, Sequence[Trajectory]]) -> AsyncState:
        """Step ``consumed`` trained ``keys`` (their gathered ``groups``; an empty one is dropped: no
        trajectory left): they leave the tickets and the next batch is the next step's."""
        keys = set(keys)
        lost = sum(1 for k in keys if not groups.get(k))
        ledger = dataclasses.replace(self.ledger, trained=self.ledger.trained + len(keys) - lost)
        return dataclasses.replace(
            self, consumed=self.consumed + 1, tickets=tuple(t for t in self.tickets if t.key not in keys),
            finished={k: g for k, g in self.finished.items() if k not in keys},
            ledger=ledger.drop("no_trajectory", lost))

    def end_stage(self) -> tuple[AsyncState, int]:
        """The stage is over: a fresh stage's state (the ledger kept) and how many released groups it drops
        untrained (counted, reason ``stage_end``)."""
        dropped = len(self.tickets)
        return AsyncState(ledger=self.ledger.drop("stage_end", dropped)), dropped

    def check(self, eta: int) -> None:
        """Raises ``ScheduleInvariantError`` if the throttle or the ledger does not add up."""
        if not self.consumed <= self.released <= self.consumed + eta + 1:
            raise ScheduleInvariantError("the release throttle holds", f"{self.released} batches released, "
                                         f"{self.consumed} consumed, eta {eta}")
        waiting = sum(self.batch_sizes[self.consumed:])
        if len(self.tickets) != waiting:
            raise ScheduleInvariantError("the tickets are the released groups not taken",
                                         f"{len(self.tickets)} tickets, {waiting} released and not taken")

    def to_dict(self) -> dict[str, Any]:
        """The state as versioned JSON data (``finished`` as given: gather every process's first)."""
        return {"format": STATE_FORMAT, "released": self.released, "consumed": self.consumed,
                "batch_sizes": list(self.batch_sizes), "tickets": [t.to_dict() for t in self.tickets],
                "finished": [{"key": list(k), "group": [trajectory_to_dict(t) for t in g]}
                             for k, g in sorted(self.finished.items())],
                "ledger": self.ledger.to_dict()}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], *, owner: int | None = None) -> AsyncState:
        """The state ``to_dict`` wrote; with ``owner``, only that process's finished groups."""
        if record.get("format") != STATE_FORMAT:
            raise ValueError(f"asynchronous schedule state format {record.get('format')!r}; this code reads "
                             f"format {STATE_FORMAT}")
        tickets = tuple(Ticket.from_dict(t) for t in record["tickets"])
        owners = {t.key: t.owner for t in tickets}
        finished = {tuple(f["key"]): tuple(trajectory_from_dict(t) for t in f["group"])
                    for f in record["finished"]}
        if owner is not None:
            finished = {k: g for k, g in finished.items() if owners[k] == owner}
        return cls(record["released"], record["consumed"], tuple(record["batch_sizes"]), tickets, finished,
                   Ledger.from_dict(record["ledger"]))


class _LegacyUnpickler(pickle.Unpickler):
    """Reads the pickled carry of checkpoints written before the declared forms (``AsyncState``, partial
    rollouts' JSON): only the record types it held (by class name, wherever they live now: these, and the
    unfinished rollouts' declared with ``declare_record_types``), builtin values and containers come out."""

    ALLOWED = {"Ticket": Ticket, "Problem": Problem, "Trajectory": Trajectory}
    BUILTINS = {("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset", "float", "int",
                                                "str", "bool")} | {("collections", "defaultdict")}

    def find_class(self, module: str, name: str):
        allowed = {**record_types(), **self.ALLOWED}
        if name in allowed:
            return allowed[name]
        if (module, name) in self.BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a legacy schedule carry holds {module}.{name}, not a schedule record "
                                     f"(allowed: {sorted(allowed)})")


def read_legacy_carry(text: str) -> dict[str, Any]:
    """The pickled, compressed, base64'd ``rollout_carry`` of a checkpoint written before this format."""
    return _LegacyUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(text)))).load()


def legacy_async_state(carry: str | None, ledger: Mapping[str, Any] | None) -> AsyncState:
    """The state of a checkpoint written before ``AsyncState``: its pickled ``carry`` (None: nothing waited,
    every released batch was consumed: ``AsyncState.at_step`` starts the counts at the stage's steps done) and
    its ledger counts."""
    counts = Ledger.from_dict(ledger) if ledger else Ledger()
    if not carry:
        return AsyncState(ledger=counts)
    old = read_legacy_carry(carry)
    sizes = tuple(old["batch_sizes"][b] for b in range(old["released"]))
    tickets = tuple(sorted(old["tickets"], key=lambda t: t.key))
    # The old carry kept no consumed count: the steps taken are the batches whose groups no ticket waits for
    # (a step takes its batch's size in groups, from any batch, so count from the back).
    consumed = next((c for c in range(len(sizes) + 1) if sum(sizes[c:]) == len(tickets)), None)
    if consumed is None:
        raise ValueError(f"the checkpoint's rollout carry holds {len(tickets)} groups, no tail of its "
                         f"batches {sizes}")
    finished = {k: tuple(g) for k, g in old["complete"].items()}
    return AsyncState(old["released"], consumed, sizes, tickets, finished, counts)
