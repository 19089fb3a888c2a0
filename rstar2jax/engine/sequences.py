"""The sequences the scheduler holds (:class:`SequenceTable`): slots, admission, queued segments, forks,
releases, and what collected steps sampled.

A group of ``n`` sessions is admitted, first come first served, once ``n`` slots are free and the pool has
every page the group can ever take that is not promised to sessions already admitted (its prompt's pages,
held once for the group, plus each session's response budget; cached pages count as free:
:class:`~rstar2jax.engine.ledger.PageLedger`): so nothing admitted ever waits for a page, and work that does
not fit waits, losing nothing. Whole pages of a prefix already in the pool (another group's system prompt,
an earlier turn of the same chat) are attached instead of prefilled. The prompt is prefilled once; then the
siblings are forked from it: they take its full pages and a private copy of its last page. A finished
session (EOS or budget) is released at once (its slot and pages freed with the next step); a paused one
keeps its slot and pages but those it was given ahead of a decode that stopped sooner.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

from rstar2jax.engine.config import EngineConfig, SamplingParams, pages_for
from rstar2jax.engine.ledger import PageLedger
from rstar2jax.engine.outbox import StepOutbox
from rstar2jax.engine.plan import check_policy_version
from rstar2jax.engine.records import (
    Chunk,
    Phase,
    Record,
    SegmentRequest,
    SlotSequence,
    StreamSeeds,
    sibling_seeds,
)
from rstar2jax.engine.requests import check_request, stop_table

__all__ = ["GroupRequest", "SequenceTable"]

#: A group to admit: ``(prompt_ids, n, sampling, max_tokens, seeds)``, ``seeds`` the group's seed entropy (a
#: tuple of ints; sibling ``j`` samples with ``slot_seed((*entropy, j))``) or each sibling's
#: :class:`~rstar2jax.engine.records.StreamSeeds`.
GroupRequest = tuple[Sequence[int], int, SamplingParams, int, Sequence[int] | StreamSeeds]


class SequenceTable:
    """Slots, sequences (in admission order), their pages (:attr:`ledger`) and the update data owed to the
    device for them (:attr:`outbox`); host arithmetic only.

    ``policy_version``: the version of the weights of the last planned step (the scheduler sets it), which a
    segment that ends before any step (no budget left) reports.
    """

    def __init__(self, engine_config: EngineConfig, vocab_size: int, stats: collections.Counter, *,
                 policy_version: int = 0):
        self.engine_config = engine_config
        self.vocab_size = vocab_size
        self.stats = stats  # prompt_tokens, cached_tokens, sampled_tokens
        self.policy_version = check_policy_version(policy_version)
        self.ledger = PageLedger(engine_config)
        self.outbox = StepOutbox(engine_config)
        self._free_slots = collections.deque(range(engine_config.num_slots))
        self._seqs: dict[int, SlotSequence] = {}  # id(record) -> sequence, in admission order
        self._reported: list[tuple[Record, Chunk]] = []

    def __iter__(self) -> Iterator[SlotSequence]:
        """The live sequences in admission order (a snapshot: safe to release while iterating)."""
        return iter(list(self._seqs.values()))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_pending(self) -> int:
        """Sequences with work queued (prefill, a segment, a fork) plus chunks not yet taken."""
        busy = sum(bool(s.phase.prefilling or s.phase in (Phase.FORK_WAIT, Phase.RUNNING)
                        or s.queued is not None or s.is_fork_source) for s in self._seqs.values())
        return busy + len(self._reported)

    def take_reported(self) -> list[tuple[Record, Chunk]]:
        """The chunks reported since the last call, per record, in order."""
        reported, self._reported = self._reported, []
        return reported

    # ---- admission and sessions

    def admissible(self, requests: Sequence[GroupRequest]) -> int:
        """How many of ``requests`` (in order) fit in the free slots and unpromised pages now."""
        slots, pages = self.num_free_slots, self.ledger.num_free
        for count, (prompt_ids, n, _, max_tokens, _) in enumerate(requests):
            _, needed = self.ledger.group_cost(prompt_ids, n, max_tokens)
            if n > slots or needed > pages:
                return count
            slots, pages = slots - n, pages - needed
        return len(requests)

    def admit(self, requests: Sequence[GroupRequest]) -> list[list[Record]]:
        """Take slots and pages for groups (:meth:`EngineCore.admit`); raises ValueError if they do not
        fit."""
        for prompt_ids, n, _, max_tokens, seeds in requests:
            check_request(self.engine_config, self.vocab_size, prompt_ids, n, max_tokens)
            sibling_seeds(seeds, n)  # a wrong count of stream seeds fails before any slot is taken
        if self.admissible(requests) < len(requests):
            raise ValueError(f"{len(requests)} groups requested; {self.num_free_slots} slots and "
                             f"{self.ledger.num_free} pages are free")
        return [self._admit_group(*request) for request in requests]

    def _admit_group(self, prompt_ids, n, sampling, max_tokens, entropy) -> list[Record]:
        prompt_ids, ps = [int(t) for t in prompt_ids], self.engine_config.page_size
        shared = self.ledger.shared_prefix(prompt_ids)
        seqs = []
        for j, seed in enumerate(sibling_seeds(entropy, n)):
            slot = self._free_slots.popleft()
            cached = len(shared) * ps if j == 0 else 0  # the source's prefix pages (the siblings fork)
            seq = SlotSequence(Record(prompt_ids, max_tokens, slot=slot, cached_tokens=cached), slot, seed,
                               sampling)
            self._seqs[id(seq.record)] = seq
            self.outbox.admitted(seq)
            seqs.append(seq)
        source, siblings = seqs[0], seqs[1:]
        budget_pages = pages_for(source.budget_end, ps)
        self.ledger.promise(source.slot, budget_pages - len(shared))  # all its pages but the shared ones
        if shared:
            self.outbox.entries(source.slot, self.ledger.attach(source.slot, shared))
        source.attach_prefix(len(shared) * ps)
        self.grow(source, len(prompt_ids))
        if siblings:  # their pages now; the device copies the source's last page once it is prefilled
            for sibling in siblings:  # a private copy of the prompt's last page, then their responses
                self.ledger.promise(sibling.slot, 1 + budget_pages - pages_for(len(prompt_ids), ps))
            copies = self.ledger.fork(source.slot, [s.slot for s in siblings], len(prompt_ids))
            fork = source.group()
            for sibling, copy in zip(siblings, copies, strict=True):
                sibling.await_fork(fork, copy)
        self.stats["prompt_tokens"] += len(prompt_ids)
        self.stats["cached_tokens"] += source.kv
        return [s.record for s in seqs]

    def start(self, record: Record, stop: Sequence[Sequence[int]], max_new_tokens: int | None,
              appended: Sequence[int]) -> None:
        """Queue a segment for ``record`` (:meth:`EngineCore.start`)."""
        seq = self._seqs.get(id(record))
        if seq is None or seq.phase is Phase.CLOSED:
            raise ValueError("the session is closed or finished")
        if seq.queued is not None or seq.segment is not None:  # running, or suspended to run on
            raise RuntimeError("the session already has a segment in flight")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(seq.tokens) + len(appended) > record.budget_end:
            raise ValueError(f"{len(appended)} tokens appended but only "
                             f"{record.budget_end - len(seq.tokens)} remain in the budget")
        table = stop_table(self.engine_config, stop)
        seq.queue(SegmentRequest(table, max_new_tokens, tuple(int(t) for t in appended)))
        self.prepare_start(seq)

    def prepare_start(self, seq: SlotSequence) -> None:
        """Insert a queued segment's appended tokens once ``seq`` may take them (not before its group is
        forked: the siblings copy its prompt's last page); a session with no budget left is done at once."""
        if seq.fork is not None:
            return
        if seq.queued.appended:
            seq.insert_appended()
        if len(seq.tokens) >= seq.budget_end:  # nothing may be sampled
            self._reported.append((seq.record, Chunk([], [], [], self.policy_version, "budget")))
            self.release(seq)

    def close(self, record: Record) -> None:
        """Free the record's slot and pages with the next step (:meth:`EngineCore.close`). The record is the
        consumer's: marking it closed (``record.slot = None``) is the caller's part."""
        seq = self._seqs.get(id(record))
        if seq is not None:
            self.release(seq)

    def release(self, seq: SlotSequence) -> None:
        """Free ``seq``'s slot and pages (a source with siblings not forked yet: once they are)."""
        seq.cancel()
        fork = seq.fork
        if seq.is_fork_source:
            fork.source_closed = True  # it goes on prefilling for its siblings
            return
        del self._seqs[id(seq.record)]
        seq.close()
        if fork is not None:  # a sibling closed before its fork: none will come
            del fork.waiting[seq]
            if not fork.waiting:
                fork.source.forked()
                if fork.source_closed:
                    self.release(fork.source)
        freed = self.ledger.release(seq.slot, seq.tokens, min(seq.kv, len(seq.tokens) - 1))
        self.outbox.released(seq.slot, freed)
        self._free_slots.append(seq.slot)

    def is_live(self, seq: SlotSequence) -> bool:
        return self._seqs.get(id(seq.record)) is seq

    # ---- pages and forks

    def grow(self, seq: SlotSequence, num_tokens: int) -> None:
        """Give ``seq`` its promised pages for ``num_tokens`` tokens (sent with the next step)."""
        self.outbox.entries(seq.slot, self.ledger.grow(seq.slot, min(num_tokens, seq.budget_end)))

    def fork_ready(self) -> None:
        """Fork on the device the siblings of every source whose prompt prefill went out in an earlier step
        (the page copies run before this step's writes)."""
        for source in self:
            if not source.is_fork_source or source.phase.prefilling:
                continue
            fork = source.fork
            if len(fork.waiting) > self.engine_config.num_slots - self.outbox.num_forks:
                continue
            for sibling, copy in fork.waiting.items():
                column = int(self.ledger.allocator.held[sibling.slot]) - 1
                self.outbox.forked(source.slot, sibling, column, copy)
                sibling.fork_from(source)
            source.forked()
            if fork.source_closed:
                self.release(source)

    # ---- what came back

    def receive(self, results: Sequence[tuple[SlotSequence, Chunk | None]]) -> None:
        """Take a collected step's chunks, each with the sequence its decode row was planned for: tokens join
        their sequences (the chunks are reported), a finished session is released, a paused one gives back
        the pages it was given ahead, never written."""
        for seq, chunk in results:
            seq.settle()
            if chunk is None or seq.phase is not Phase.RUNNING or not self.is_live(seq):
                continue  # nothing sampled, or closed by the host meanwhile: its overshoot is discarded
            seq.receive(chunk.tokens)
            self.stats["sampled_tokens"] += len(chunk.tokens)
            self._reported.append((seq.record, chunk))
            if chunk.finish_reason is None:
                continue
            seq.end_segment()
            if chunk.finish_reason in ("eos", "budget"):
                self.release(seq)
            else:  # paused (a tool call, a segment limit)
                self.outbox.returned(self.ledger.shrink(seq.slot, len(seq.tokens)))
