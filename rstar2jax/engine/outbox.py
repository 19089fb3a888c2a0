"""What the host owes the device with its next step: slot records, page-table entries, forks, page copies
and freed pages. The scheduler queues them in a :class:`StepOutbox` as it admits, forks and releases
sequences, and drains them into a frozen :class:`StepUpdates` when it plans a step; the runner writes that
into the step's :class:`~rstar2jax.engine.step.StepBuilder`."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.records import Phase, SlotSequence
from rstar2jax.engine.state import FREE, NO_TOKEN, PAUSED, RUNNING
from rstar2jax.engine.step import StepBuilder

__all__ = ["ForkRow", "PageCopy", "PageEntry", "SlotWrite", "StepOutbox", "StepUpdates"]


class PageEntry(NamedTuple):
    """A page given to a slot: ``page`` goes at ``column`` of the slot's page-table row."""

    slot: int
    column: int
    page: int


class PageCopy(NamedTuple):
    """A page's keys/values copied on the device (a sibling's private copy of its prompt's last page)."""

    source: int
    destination: int


class ForkRow(NamedTuple):
    """``slot``'s page-table row becomes ``source_slot``'s (as the earlier steps left it) but for ``page`` at
    ``column`` (its private copy)."""

    source_slot: int
    slot: int
    column: int
    page: int


@dataclasses.dataclass(frozen=True)
class SlotWrite:
    """Every per-slot field the device keeps for a slot it does not run (which the host therefore knows
    exactly), as the host knew them when the step was planned; ``clear_row`` empties the slot's page-table
    row first (a new sequence, a freed slot)."""

    slot: int
    clear_row: bool
    status: int
    seq_len: int = 0
    last_token: int = 0
    recent: np.ndarray | int = NO_TOKEN  # the last ``max_stop_len`` tokens, right-aligned
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    budget_end: int = 0
    segment_start: int = 0
    segment_end: int = 0
    stop_seqs: np.ndarray | int = NO_TOKEN

    @classmethod
    def of(cls, slot: int, seq: SlotSequence | None, clear_row: bool,
           engine_config: EngineConfig) -> SlotWrite:
        """FREE for None, else ``seq`` running its segment or paused."""
        if seq is None:
            return cls(slot, clear_row, FREE)
        W = engine_config.max_stop_len
        recent = np.full((W,), NO_TOKEN, np.int32)
        tail = seq.tokens[-W:]
        recent[W - len(tail):] = tail
        running = seq.phase is Phase.RUNNING
        sampling = seq.sampling
        return cls(
            slot, clear_row, RUNNING if running else PAUSED, seq_len=len(seq.tokens),
            last_token=seq.tokens[-1], recent=recent, seed=seq.seed, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, budget_end=min(seq.budget_end, engine_config.max_len),
            segment_start=seq.segment_start if running else len(seq.tokens),
            segment_end=seq.segment_end if running else 0,
            stop_seqs=seq.stop_table if running else NO_TOKEN)

    def write(self, builder: StepBuilder) -> None:
        builder.update(
            self.slot, clear=self.clear_row, status=self.status, seq_len=self.seq_len,
            last_token=self.last_token, recent=self.recent, seed=self.seed, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, budget_end=self.budget_end, segment_start=self.segment_start,
            segment_end=self.segment_end, stop_seqs=self.stop_seqs)


@dataclasses.dataclass(frozen=True)
class StepUpdates:
    """The update data one step carries, applied on the device before its tokens in this order: slot records,
    forks, page-table entries, freed pages (poisoned when ``EngineConfig.poison_freed_pages``), copies."""

    slots: tuple[SlotWrite, ...] = ()
    forks: tuple[ForkRow, ...] = ()
    entries: tuple[PageEntry, ...] = ()
    copies: tuple[PageCopy, ...] = ()
    freed: tuple[int, ...] = ()

    def write(self, builder: StepBuilder) -> None:
        for slot in self.slots:
            slot.write(builder)
        for entry in self.entries:
            builder.entry(*entry)
        for fork in self.forks:
            builder.fork(*fork)
        for copy in self.copies:
            builder.copy(*copy)
        builder.poison(self.freed)


class _SlotChange(NamedTuple):
    seq: SlotSequence | None  # None: the slot is freed
    clear_row: bool


class StepOutbox:
    """Update data queued for the next steps. Slot records are written from their sequence as it stands when
    a step is planned; a step takes as many page-table entries as fit (``room``) and the rest wait for the
    next; freed pages alone need no step."""

    def __init__(self):
        self._slots: dict[int, _SlotChange] = {}
        self._entries: list[PageEntry] = []
        self._forks: list[ForkRow] = []
        self._copies: list[PageCopy] = []
        self._freed: list[int] = []

    def __bool__(self) -> bool:
        """Whether a step must go out for this data."""
        return bool(self._slots or self._entries or self._copies or self._forks)

    @property
    def num_forks(self) -> int:
        return len(self._forks)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def slots_past(self, room: int) -> set[int]:
        """Slots with page-table entries beyond the first ``room`` (their pages reach the device later)."""
        return {entry.slot for entry in self._entries[room:]}

    def admitted(self, seq: SlotSequence) -> None:
        """A new sequence in its slot (its page-table row cleared first)."""
        self._slots[seq.slot] = _SlotChange(seq, True)

    def changed(self, seq: SlotSequence) -> None:
        """``seq``'s record changed (a segment begins, pauses, resumes); a queued row clear stays."""
        queued = self._slots.get(seq.slot)
        self._slots[seq.slot] = _SlotChange(seq, queued is not None and queued.clear_row)

    def released(self, slot: int, freed: list[int]) -> None:
        """``slot`` is free (its row cleared); ``freed`` pages went back to the pool."""
        self._slots[slot] = _SlotChange(None, True)
        self._freed += freed

    def returned(self, freed: list[int]) -> None:
        """Pages given back to the pool by a sequence that keeps its slot."""
        self._freed += freed

    def entries(self, slot: int, new: list[tuple[int, int]]) -> None:
        """Pages given to ``slot``: ``(column, page)`` pairs of its row."""
        self._entries += [PageEntry(slot, column, page) for column, page in new]

    def forked(self, source: SlotSequence, sibling: SlotSequence, column: int) -> None:
        """``sibling`` takes ``source``'s row but for its private copy (``sibling.copy``) at ``column``."""
        page, copy = sibling.copy
        self._copies.append(PageCopy(page, copy))
        self._forks.append(ForkRow(source.slot, sibling.slot, column, copy))
        self._slots[sibling.slot] = _SlotChange(sibling, False)  # the fork writes its whole row

    def drain(self, room: int, engine_config: EngineConfig) -> StepUpdates:
        """Everything queued, but the page-table entries beyond the first ``room``, as one step's updates."""
        slots = tuple(SlotWrite.of(slot, change.seq, change.clear_row, engine_config)
                      for slot, change in self._slots.items())
        updates = StepUpdates(slots, tuple(self._forks), tuple(self._entries[:room]), tuple(self._copies),
                              tuple(self._freed))
        self._slots, self._forks, self._copies, self._freed = {}, [], [], []
        self._entries = self._entries[room:]
        return updates
