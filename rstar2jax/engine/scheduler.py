"""The engine's scheduler: what runs next, decided on the host with no device work.

:class:`Scheduler` holds the sessions' sequences (:class:`~rstar2jax.engine.sequences.SequenceTable`:
slots, admission, forks, releases; their pages and the prefix cache in its
:class:`~rstar2jax.engine.ledger.PageLedger`) and decides each device step:

* **what runs** (:meth:`Scheduler.schedule`, a frozen :class:`~rstar2jax.engine.plan.StepPlan`): the decode
  token of every running session, prefill chunks of new prompts and appended tool outputs (up to the largest
  token bucket, first come first served, in every other step while sessions decode, so arriving work never
  starves the running), the pages they need (given a step ahead: a session never waits for one), the forks
  that are due and the update data (:class:`~rstar2jax.engine.outbox.StepOutbox`);
* **when new weights apply** (:meth:`Scheduler.queue_weights`): with the next step that decodes or prefills
  (a step already in flight keeps the old ones), so every token carries the version of the weights that
  sampled it. ``on_update="keep"``: running sequences decode on over their keys/values as written;
  ``"recompute"``: once no step is in flight, every sequence's keys/values are prefilled again with the new
  weights (running segments suspended meanwhile, then resumed where they were; sessions paused on a tool
  stay paused), first come first served, each after the whole pages it shares with a sequence prefilled
  again before it. Either way the prefix cache forgets every page written before.

What a collected step sampled goes back through :meth:`Scheduler.update_from_output`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from rstar2jax.engine.buckets import StepLayout, bucket_layouts, choose_bucket
from rstar2jax.engine.config import EngineConfig, pages_for
from rstar2jax.engine.plan import DecodeResult, PrefillRun, StepPlan, WeightUpdate
from rstar2jax.engine.records import Phase, SlotSequence
from rstar2jax.engine.sequences import SequenceTable

__all__ = ["Scheduler"]


class Scheduler:
    """The plan of each step and when new weights apply (module docstring) over a :class:`SequenceTable`
    (:attr:`sequences`). Host arithmetic only; not thread-safe (the :class:`~rstar2jax.engine.core.EngineCore`
    drives it)."""

    def __init__(self, engine_config: EngineConfig, vocab_size: int, stats: collections.Counter, *,
                 policy_version: int = 0):
        self.engine_config = engine_config
        self.sequences = SequenceTable(engine_config, vocab_size, stats, policy_version=policy_version)
        self.layouts = bucket_layouts(engine_config)
        # The sequences of each planned step's decode rows, oldest first: what a collected step's rows are
        # paired with (a plan names slots only, and a slot may hold another sequence by the time it is read).
        self._planned: collections.deque[tuple[SlotSequence, ...]] = collections.deque()
        self._last_prefilled = False  # whether the last step prefilled (the next one decodes a chunk)
        self._weights: WeightUpdate | None = None  # for the next step that decodes or prefills
        self._recompute_due = False  # keys/values to prefill again with them, once no step is in flight
        self._recomputing = False  # some sequences prefill again

    @property
    def policy_version(self) -> int:
        """The policy version of the weights of the last planned step."""
        return self.sequences.policy_version

    def queue_weights(self, update: WeightUpdate) -> None:
        """New weights for the next step that decodes or prefills (a later update replaces one not applied
        yet); the prefix cache forgets every page written so far."""
        self._weights, self._recompute_due = update, update.on_update == "recompute"
        self.sequences.ledger.forget_prefixes()

    # ---- planning a step

    def _run(self, seq: SlotSequence) -> None:
        """Make a prefilled sequence RUNNING from this step: its suspended segment, or the queued one."""
        if seq.resumable:
            seq.resume_segment()
        else:
            seq.begin()
        self.sequences.outbox.changed(seq)

    @staticmethod
    def _runnable(seq: SlotSequence) -> bool:
        return seq.startable or seq.resumable

    def _prefill_again(self) -> None:
        """``on_update="recompute"``: every sequence prefills its keys/values again (a sibling waiting for its
        fork takes them from its source); running ones pause on the device meanwhile."""
        self._recompute_due = False
        self.sequences.ledger.forget_fresh()  # pages written with weights queued earlier are stale too
        for seq in self.sequences:
            if seq.phase is Phase.FORK_WAIT:
                continue
            running = seq.phase is Phase.RUNNING  # its segment is suspended until then
            seq.prefill_again()
            self._recomputing = True
            if running:
                self.sequences.outbox.changed(seq)

    def schedule(self, *, updates_only: bool = False, steps_in_flight: int = 0) -> StepPlan | None:
        """The next step, or None if there is nothing to send. ``updates_only``: no decode or prefill, just
        the update data. ``steps_in_flight``: steps dispatched and not read yet (new weights that prefill
        again wait for none)."""
        if updates_only:
            return self._plan(self.layouts[0], [], [], 1) if self.sequences.outbox else None
        if self._recompute_due:
            if steps_in_flight:
                return None  # their tokens must be in the sequences first
            self._prefill_again()
        table = self.sequences
        table.fork_ready()
        for seq in table:
            if seq.queued is not None and seq.queued.appended:
                table.prepare_start(seq)  # appended tokens waiting for the group's fork
            if self._runnable(seq):
                self._run(seq)
        decoding = [s for s in table if s.phase is Phase.RUNNING]
        for seq in decoding:  # pages a step ahead: the step in flight and this one may each fill a chunk
            table.grow(seq, len(seq.tokens) + sum(seq.in_flight) + self.engine_config.decode_chunk)
        # Prefill goes into every other step while sessions decode: a prefill step decodes one token per
        # session, the decode step after it a whole chunk, so arriving work never starves the running.
        runs, tiles = ([], 0) if decoding and self._last_prefilled else self._plan_prefill(decoding)
        if self._recomputing and not any(s.phase.recomputing for s in table):
            self._recomputing = False
            table.ledger.forget_fresh()
        if not (decoding or runs or table.outbox):
            return None
        tokens = len(decoding) + sum(len(run.tokens) for run in runs)
        rows = len(decoding) + sum(len(run.tokens) for run in runs if run.as_singles)
        compile_ahead = None
        if runs:  # the decode steps after this prefill: their program may compile meanwhile
            starting = sum(s.phase is Phase.READY and s.queued is not None for s in table)
            n = min(len(decoding) + starting, self.engine_config.num_slots)
            compile_ahead = choose_bucket(self.layouts, n, n, 0)
        self._last_prefilled = bool(runs)
        iterations = 1 if runs else self.engine_config.decode_chunk
        return self._plan(choose_bucket(self.layouts, tokens, rows, tiles), decoding, runs, iterations,
                          compile_ahead)

    def _plan_prefill(self, decoding: list[SlotSequence]) -> tuple[list[PrefillRun], int]:
        """Prefill runs for this step after ``decoding``'s rows, first come first served; a sequence they
        finish joins ``decoding`` if its segment may begin. Returns the runs and the tiles they take."""
        cfg, largest, table = self.engine_config, self.layouts[-1], self.sequences
        ledger, outbox, tile = table.ledger, table.outbox, cfg.prefill_tile
        blocked = outbox.slots_past(largest.num_entries)  # their pages reach the device later
        room = largest.num_entries - outbox.num_entries
        tokens, rows, tiles, runs = len(decoding), len(decoding), 0, []
        for seq in table:
            if not seq.phase.prefilling:
                continue
            if seq.slot in blocked:
                break  # first come, first served
            restart = seq.phase is Phase.RESTART
            start = min(ledger.fresh_tokens(seq.slot), len(seq.tokens) - 1) if restart else seq.kv
            n = min(len(seq.tokens) - 1 - start, cfg.max_step_tokens - tokens)  # the last one stays pending
            singles = n <= tile // 2 and rows + n <= largest.rows
            if not singles:
                n = min(n, (largest.tiles - tiles) * tile)
            new_pages = pages_for(start + n + 1, cfg.page_size) - int(ledger.allocator.held[seq.slot])
            if restart and start == len(seq.tokens) - 1:
                n = 0  # every key/value it holds was written again by the sequences before it
            elif n <= 0 or new_pages > room:
                break
            if restart:
                seq.restart_at(start)
            if n:
                rows, tiles = (rows + n, tiles) if singles else (rows, tiles + -(-n // tile))
                tokens += n
                runs.append(PrefillRun(seq.slot, seq.kv, tuple(seq.tokens[seq.kv : seq.kv + n]), singles))
            done = seq.prefilled(n)
            table.grow(seq, seq.kv + 1)
            room = largest.num_entries - outbox.num_entries
            ledger.register(seq.slot, seq.tokens, seq.kv)
            if self._recomputing:
                ledger.mark_fresh(seq.slot, seq.kv)
            if done:  # prefilled: it may run in this very step
                if self._runnable(seq) and rows < largest.rows and tokens < cfg.max_step_tokens:
                    self._run(seq)
                    decoding.append(seq)
                    tokens, rows = tokens + 1, rows + 1
            elif seq.phase is Phase.RECOMPUTE:
                break  # the sequences after it may share pages it has still to write again
        return runs, tiles

    def _plan(self, layout: StepLayout, decoding: list[SlotSequence], runs: list[PrefillRun], iterations: int,
              compile_ahead: StepLayout | None = None) -> StepPlan:
        """The plan of a step that will be dispatched: new weights go with it (but with an updates-only
        step, which samples nothing)."""
        weights = None
        if decoding or runs:
            weights, self._weights = self._weights, None
        if weights is not None:
            self.sequences.policy_version = weights.policy_version
        for seq in decoding:
            seq.expect(iterations)
        self._planned.append(tuple(decoding))
        updates = self.sequences.outbox.drain(layout.num_entries)
        return StepPlan(layout, tuple(seq.slot for seq in decoding), tuple(runs), iterations, updates,
                        self.policy_version, weights, compile_ahead)

    # ---- what came back

    def update_from_output(self, results: Sequence[DecodeResult]) -> None:
        """A collected step's chunks (the oldest planned step's, row by row) back to the sequences planned
        for those rows (:meth:`SequenceTable.receive`)."""
        planned = self._planned.popleft()
        if tuple(seq.slot for seq in planned) != tuple(result.slot for result in results):
            raise AssertionError("collected decode rows do not match the oldest planned step")
        self.sequences.receive([(seq, result.chunk) for seq, result in zip(planned, results, strict=True)])
