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

__all__ = ["ForkRow", "PageCopy", "PageEntry", "SlotChange", "StepOutbox", "StepUpdates"]


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


class SlotChange(NamedTuple):
    """``slot``'s record to write: its sequence (None: the slot is freed), and whether its page-table row is
    cleared first (a new sequence, a freed slot)."""

    slot: int
    seq: SlotSequence | None
    clear_row: bool

    def write(self, builder: StepBuilder, engine_config: EngineConfig) -> None:
        """Every per-slot field of the slot, which the device does not run and the host therefore knows
        exactly: FREE, or the sequence running its segment or paused, as it stands now."""
        seq, W = self.seq, engine_config.max_stop_len
        if seq is None:
            builder.update(self.slot, clear=self.clear_row, status=FREE, seq_len=0, last_token=0,
                           recent=np.full((W,), NO_TOKEN), seed=0, temperature=0.0, top_p=1.0, top_k=0,
                           budget_end=0, segment_start=0, segment_end=0, stop_seqs=NO_TOKEN)
            return
        recent = np.full((W,), NO_TOKEN, np.int32)
        tail = seq.tokens[-W:]
        recent[W - len(tail):] = tail
        running, sampling = seq.phase is Phase.RUNNING, seq.sampling
        builder.update(
            self.slot, clear=self.clear_row, status=RUNNING if running else PAUSED, seq_len=len(seq.tokens),
            last_token=seq.tokens[-1], recent=recent, seed=seq.seed, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, budget_end=min(seq.budget_end, engine_config.max_len),
            segment_start=seq.segment_start if running else len(seq.tokens),
            segment_end=seq.segment_end if running else 0,
            stop_seqs=seq.stop_table if running else NO_TOKEN)


@dataclasses.dataclass(frozen=True)
class StepUpdates:
    """The update data one step carries, applied on the device before its tokens in this order: slot records,
    forks, page-table entries, freed pages (poisoned when ``EngineConfig.poison_freed_pages``), copies. Slot
    records are written from their sequences as they stand when the runner builds the step (right after the
    scheduler planned it: nothing changes them in between)."""

    slots: tuple[SlotChange, ...] = ()
    forks: tuple[ForkRow, ...] = ()
    entries: tuple[PageEntry, ...] = ()
    copies: tuple[PageCopy, ...] = ()
    freed: tuple[int, ...] = ()

    def write(self, builder: StepBuilder, engine_config: EngineConfig) -> None:
        for slot in self.slots:
            slot.write(builder, engine_config)
        for entry in self.entries:
            builder.entry(*entry)
        for fork in self.forks:
            builder.fork(*fork)
        for copy in self.copies:
            builder.copy(*copy)
        builder.poison(self.freed)


class StepOutbox:
    """Update data queued for the next steps. Slot records are written from their sequence as it stands when
    a step is planned; a step takes as many page-table entries as fit (``room``) and the rest wait for the
    next; freed pages alone need no step."""

    def __init__(self):
        self._slots: dict[int, SlotChange] = {}
        self._entries: list[PageEntry] = []
        self._forks: list[ForkRow] = []
        self._copies: list[PageCopy] = []
        self._freed: list[int] = []

    def __bool__(self) -> bool:
        """Whether a step must go out for this data."""
        return bool(self._slots or self._entries or self._copies or self._forks)

    @property
    def num_entries(self) -> int:
        """Page-table entries queued (a step takes as many as fit)."""
        return len(self._entries)

    def slots_past(self, room: int) -> set[int]:
        """Slots with page-table entries beyond the first ``room`` (their pages reach the device later)."""
        return {entry.slot for entry in self._entries[room:]}

    def admitted(self, seq: SlotSequence) -> None:
        """A new sequence in its slot (its page-table row cleared first)."""
        self._slots[seq.slot] = SlotChange(seq.slot, seq, True)

    def changed(self, seq: SlotSequence) -> None:
        """``seq``'s record changed (a segment begins, pauses, resumes); a queued row clear stays."""
        queued = self._slots.get(seq.slot)
        self._slots[seq.slot] = SlotChange(seq.slot, seq, queued is not None and queued.clear_row)

    def released(self, slot: int, freed: list[int]) -> None:
        """``slot`` is free (its row cleared); ``freed`` pages went back to the pool."""
        self._slots[slot] = SlotChange(slot, None, True)
        self._freed += freed

    def returned(self, freed: list[int]) -> None:
        """Pages given back to the pool by a sequence that keeps its slot."""
        self._freed += freed

    def entries(self, slot: int, new: list[tuple[int, int]]) -> None:
        """Pages given to ``slot``: ``(column, page)`` pairs of its row."""
        self._entries += [PageEntry(slot, column, page) for column, page in new]

    @property
    def num_forks(self) -> int:
        """Forks queued (a step holds at most ``num_slots``)."""
        return len(self._forks)

    def forked(self, source: SlotSequence, sibling: SlotSequence, column: int) -> None:
        """``sibling`` takes ``source``'s row but for its private copy (``sibling.copy``) at ``column``."""
        page, copy = sibling.copy
        self._copies.append(PageCopy(page, copy))
        self._forks.append(ForkRow(source.slot, sibling.slot, column, copy))
        self._slots[sibling.slot] = SlotChange(sibling.slot, sibling, False)  # the fork writes its whole row

    def drain(self, room: int) -> StepUpdates:
        """Everything queued, but the page-table entries beyond the first ``room``, as one step's updates."""
        updates = StepUpdates(tuple(self._slots.values()), tuple(self._forks), tuple(self._entries[:room]),
                              tuple(self._copies), tuple(self._freed))
        self._slots, self._forks, self._copies, self._freed = {}, [], [], []
        self._entries = self._entries[room:]
        return updates
