"""What the host owes the device with its next step: slot updates, page-table entries, page copies, forks
and freed pages (:class:`StepOutbox`), queued as the core admits, forks and releases sequences and written
into a :class:`~rstar2jax.engine.step.StepBuilder` when a step is built."""

from __future__ import annotations

import dataclasses

import numpy as np

from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.records import Phase, SlotSequence
from rstar2jax.engine.state import FREE, NO_TOKEN, PAUSED, RUNNING
from rstar2jax.engine.step import StepBuilder

__all__ = ["StepOutbox"]


@dataclasses.dataclass
class StepOutbox:
    """Update data queued for the next steps. ``updates``: slot -> (its sequence, or None to free it; whether
    to clear its page-table row first). ``entries``: page-table entries ``(slot, column, page)``; a step takes
    as many as fit and the rest wait for the next. ``copies``: ``(source page, destination page)``.
    ``forks``: ``(source slot, destination slot, column, private page)``. ``freed``: pages freed since the
    last step (poisoned when ``EngineConfig.poison_freed_pages``)."""

    updates: dict[int, tuple[SlotSequence | None, bool]] = dataclasses.field(default_factory=dict)
    entries: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    forks: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    freed: list[int] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        """Whether a step must go out for this data (freed pages alone need none)."""
        return bool(self.updates or self.entries or self.copies or self.forks)

    def write(self, builder: StepBuilder, engine_config: EngineConfig) -> None:
        """Move everything that fits into ``builder`` (page-table entries beyond its room stay queued)."""
        for slot, (seq, clear) in self.updates.items():
            _write_update(builder, engine_config, slot, seq, clear)
        self.updates = {}
        room = builder.room("entry")
        for slot, col, page in self.entries[:room]:
            builder.entry(slot, col, page)
        self.entries = self.entries[room:]
        for fork in self.forks:
            builder.fork(*fork)
        self.forks = []
        for src, dst in self.copies:
            builder.copy(src, dst)
        self.copies = []
        builder.poison(self.freed)
        self.freed = []


def _write_update(builder: StepBuilder, engine_config: EngineConfig, slot: int, seq: SlotSequence | None,
                  clear: bool) -> None:
    """Every per-slot field of ``slot``: FREE for None, else ``seq`` running its segment or paused."""
    W = engine_config.max_stop_len
    if seq is None:
        builder.update(slot, clear=clear, status=FREE, seq_len=0, last_token=0,
                       recent=np.full((W,), NO_TOKEN), seed=0, temperature=0.0, top_p=1.0, top_k=0,
                       budget_end=0, segment_start=0, segment_end=0, stop_seqs=NO_TOKEN)
        return
    recent = np.full((W,), NO_TOKEN, np.int32)
    tail = seq.tokens[-W:]
    recent[W - len(tail):] = tail
    running = seq.phase == Phase.RUNNING
    builder.update(
        slot, clear=clear, status=RUNNING if running else PAUSED, seq_len=len(seq.tokens),
        last_token=seq.tokens[-1], recent=recent, seed=seq.seed,
        temperature=seq.sampling.temperature, top_p=seq.sampling.top_p, top_k=seq.sampling.top_k,
        budget_end=min(seq.budget_end, engine_config.max_len),
        segment_start=seq.segment_start if running else len(seq.tokens),
        segment_end=seq.segment_end if running else 0,
        stop_seqs=seq.stop_table if running else NO_TOKEN)
