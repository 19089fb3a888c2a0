"""What the host owes the device with its next step: slot records, page-table entries, forks, page copies
and freed pages. The scheduler queues them in a :class:`StepOutbox` as it admits, forks and releases
sequences, and drains them into a frozen :class:`StepUpdates` (slot records as :class:`SlotRecord` values)
when it plans a step; the runner writes that into the step's inputs."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.records import Phase, SlotSequence
from rstar2jax.engine.state import FREE, NO_TOKEN, PAUSED, RUNNING

__all__ = ["ForkRow", "PageCopy", "PageEntry", "SlotChange", "SlotRecord", "StepOutbox", "StepUpdates"]


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
class SlotRecord:
    """Every per-slot field of a slot the device does not run (which the host therefore knows exactly), as a
    value: FREE, or its sequence running a segment or paused, as it stood when a step was planned. Field
    names are :meth:`~rstar2jax.engine.step.StepBuilder.update`'s."""

    status: int
    seq_len: int
    last_token: int
    recent: tuple[int, ...]  # the last ``max_stop_len`` tokens, right-aligned, NO_TOKEN before the start
    seed: int
    temperature: float
    top_p: float
    top_k: int
    budget_end: int
    segment_start: int
    segment_end: int
    stop_seqs: np.ndarray | int  # a running segment's stop table (read-only), else NO_TOKEN

    @classmethod
    def free(cls, engine_config: EngineConfig) -> SlotRecord:
        return cls(FREE, 0, 0, (NO_TOKEN,) * engine_config.max_stop_len, 0, 0.0, 1.0, 0, 0, 0, 0, NO_TOKEN)

    @classmethod
    def of(cls, seq: SlotSequence, engine_config: EngineConfig) -> SlotRecord:
        """``seq``'s record as it stands now."""
        W, length = engine_config.max_stop_len, len(seq.tokens)
        tail = tuple(seq.tokens[-W:])
        running, sampling = seq.phase is Phase.RUNNING, seq.sampling
        return cls(RUNNING if running else PAUSED, length, seq.tokens[-1],
                   (NO_TOKEN,) * (W - len(tail)) + tail, seq.seed, sampling.temperature, sampling.top_p,
                   sampling.top_k, min(seq.budget_end, engine_config.max_len),
                   seq.segment.start if running else length, seq.segment.end if running else 0,
                   seq.segment.stop_table if running else NO_TOKEN)


class SlotChange(NamedTuple):
    """``slot``'s record to write (:class:`SlotRecord`; FREE: the slot is freed), and whether its page-table
    row is cleared first (a new sequence, a freed slot)."""

    slot: int
    record: SlotRecord
    clear_row: bool


@dataclasses.dataclass(frozen=True)
class StepUpdates:
    """The update data one step carries, applied on the device before its tokens in this order: slot records,
    forks, page-table entries, freed pages (poisoned when ``EngineConfig.poison_freed_pages``), copies. A
    value: slot records are snapshots taken when the step was planned, so the runner reads nothing of the
    scheduler's."""

    slots: tuple[SlotChange, ...] = ()
    forks: tuple[ForkRow, ...] = ()
    entries: tuple[PageEntry, ...] = ()
    copies: tuple[PageCopy, ...] = ()
    freed: tuple[int, ...] = ()


class StepOutbox:
    """Update data queued for the next steps. A slot's record is queued as its sequence and snapshotted
    (:class:`SlotRecord`) when a step is planned, so the step carries the sequence as it stands then; a step
    takes as many page-table entries as fit (``room``) and the rest wait for the next; freed pages alone need
    no step."""

    def __init__(self, engine_config: EngineConfig):
        self.engine_config = engine_config
        self._slots: dict[int, tuple[SlotSequence | None, bool]] = {}  # slot -> (sequence or free, clear row)
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
        self._slots[seq.slot] = (seq, True)

    def changed(self, seq: SlotSequence) -> None:
        """``seq``'s record changed (a segment begins, pauses, resumes); a queued row clear stays."""
        queued = self._slots.get(seq.slot)
        self._slots[seq.slot] = (seq, queued is not None and queued[1])

    def released(self, slot: int, freed: list[int]) -> None:
        """``slot`` is free (its row cleared); ``freed`` pages went back to the pool."""
        self._slots[slot] = (None, True)
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

    def forked(self, source_slot: int, sibling: SlotSequence, column: int, copy: tuple[int, int]) -> None:
        """``sibling`` takes ``source_slot``'s row but for its private copy of a page (``copy``: the page and
        its copy) at ``column``."""
        page, private = copy
        self._copies.append(PageCopy(page, private))
        self._forks.append(ForkRow(source_slot, sibling.slot, column, private))
        self._slots[sibling.slot] = (sibling, False)  # the fork writes its whole row

    def drain(self, room: int) -> StepUpdates:
        """Everything queued, but the page-table entries beyond the first ``room``, as one step's updates
        (each slot's record snapshotted now)."""
        cfg = self.engine_config
        record = lambda seq: SlotRecord.free(cfg) if seq is None else SlotRecord.of(seq, cfg)
        slots = tuple(SlotChange(slot, record(seq), clear) for slot, (seq, clear) in self._slots.items())
        updates = StepUpdates(slots, tuple(self._forks), tuple(self._entries[:room]), tuple(self._copies),
                              tuple(self._freed))
        self._slots, self._forks, self._copies, self._freed = {}, [], [], []
        self._entries = self._entries[room:]
        return updates
