"""The synchronous engine: :class:`EngineCore` owns the device state, maps sequences to slots and pages and
drives the device one :func:`~rstar2jax.engine.step.step` at a time, keeping one step in flight (the design:
:mod:`rstar2jax.engine.scheduler`)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from rstar2jax.engine.config import EngineConfig, SamplingParams, pages_for
from rstar2jax.engine.outbox import StepOutbox
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.programs import PROGRAMS, abstract_shapes, engine_params
from rstar2jax.engine.records import Chunk, Phase, Record, SlotSequence, slot_seed
from rstar2jax.engine.requests import check_request, pages_needed, stop_table
from rstar2jax.engine.state import FINISH_REASON_NAMES, EngineState, engine_model_config, init_state
from rstar2jax.engine.step import StepBuilder, StepLayout
from rstar2jax.models import ModelConfig

__all__ = ["EngineCore"]


@dataclasses.dataclass
class _Dispatched:
    """A step in flight: its outputs (device arrays) and which session each decode row belongs to."""

    outputs: tuple
    rows: list[tuple[int, SlotSequence]]
    iterations: int


class EngineCore:
    """Synchronous engine: owns the device state, maps sequences to slots and pages, and runs the pipelined
    step loop (:mod:`rstar2jax.engine.scheduler`'s docstring).

    Not thread-safe: one caller at a time. :class:`~rstar2jax.engine.Engine` drives it from a thread of its
    own; :func:`~rstar2jax.engine.generate` drives it directly. Use: :meth:`admit` groups (when
    :meth:`admissible`), :meth:`start` their segments, call :meth:`step` while :attr:`num_active` (it returns
    the chunks of tokens that arrived), :meth:`close` sessions.

    ``policy_version`` (an int >= 0, the trainer step whose parameters ``params`` are) tags every token the
    engine samples (``Segment.policy_versions``); inserted tokens get ``NO_POLICY_VERSION`` (-1).
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, policy_version: int = 0):
        if not isinstance(policy_version, (int, np.integer)) or isinstance(policy_version, bool) or (
                policy_version < 0):
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        self.policy_version = int(policy_version)
        self.config = config
        self.engine_config = cfg = engine_config
        self.params = engine_params(params, engine_model_config(config, cfg), cfg.unstacked_decode)
        self.state: EngineState = init_state(config, cfg)
        self.pages = PageAllocator.of(cfg)
        self._layouts = {t: StepLayout.of(cfg, t) for t in cfg.token_buckets}
        self._abstract = (abstract_shapes(self.state), abstract_shapes(self.params))
        self._programs: dict[StepLayout, object] = {}  # this engine's compiled steps, by bucket
        self._reserved = 0  # pages promised to admitted sequences, not yet taken from the pool
        self._free = collections.deque(range(cfg.num_slots))
        self._seqs: dict[int, SlotSequence] = {}  # id(record) -> sequence
        self._outbox = StepOutbox()  # update data for the next steps
        self._in_flight: collections.deque[_Dispatched] = collections.deque()
        self._last_prefilled = False  # whether the last step prefilled (the next one decodes a chunk)
        self._reported: list[tuple[Record, Chunk]] = []
        self.stats = collections.Counter()  # steps, prompt_tokens, cached_tokens, sampled_tokens

    # ---- sizes

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_free_pages(self) -> int:
        """Pages neither held by a sequence nor promised to one (cached pages count as free)."""
        return self.pages.num_free - self._reserved

    @property
    def num_active(self) -> int:
        """Sequences with work queued or in flight (prefill, a segment), plus steps and chunks not yet
        read."""
        queued = (Phase.PREFILL, Phase.FORK_WAIT, Phase.RUNNING)
        busy = sum(bool(s.phase in queued or s.start is not None or s.siblings) for s in self._seqs.values())
        return busy + len(self._in_flight) + len(self._reported)

    @property
    def kv_bytes_held(self) -> int:
        """Bytes of the pages sequences hold now."""
        return self.pages.num_used * self.state.pages.nbytes_per_page

    def warmup(self, threads: int = 2) -> None:
        """Compile every bucket's step program ahead of time (in ``threads`` threads; nothing runs), so that
        serving never compiles."""
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(self._program, reversed(self._layouts.values())))

    @property
    def programs(self) -> int:
        """Step programs this engine has used (each compiled once per process)."""
        return len(self._programs)

    def _program(self, layout: StepLayout):
        program = self._programs.get(layout)
        if program is None:
            program = self._programs[layout] = PROGRAMS.get(self._abstract, layout,
                                                            self.engine_config.return_on_stop)
        return program

    def _variant(self, layout: StepLayout) -> StepLayout:
        """``layout``'s greedy program (``StepLayout.greedy``) while no sequence samples, unless only the
        general one is compiled or compiling (it serves greedy rows as well); else ``layout``."""
        if any(seq.sampling.temperature > 0 for seq in self._seqs.values()):
            return layout
        greedy = dataclasses.replace(layout, greedy=True)
        general_held = layout in self._programs or PROGRAMS.holds(self._abstract, layout,
                                                                  self.engine_config.return_on_stop)
        return greedy if greedy in self._programs or not general_held else layout

    def _compile_ahead(self, layout: StepLayout) -> None:
        """Compile ``layout``'s program in the background unless this engine has it."""
        if layout not in self._programs:
            PROGRAMS.compile_ahead(self._abstract, layout, self.engine_config.return_on_stop)

    def stop_table(self, stop: Sequence[Sequence[int]]) -> np.ndarray:
        """``[max_stops, max_stop_len]`` right-aligned stop table; raises ValueError if it does not fit."""
        return stop_table(self.engine_config, stop)

    # ---- requests

    def pages_needed(self, prompt_ids: Sequence[int], n: int, max_tokens: int, *, shared: int = 0) -> int:
        """Pages a group can ever take from the pool (:func:`~rstar2jax.engine.requests.pages_needed`)."""
        return pages_needed(self.engine_config, len(prompt_ids), n, max_tokens, shared=shared)

    def check_request(self, prompt_ids: Sequence[int], n: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never be admitted."""
        check_request(self.engine_config, self.config.vocab_size, prompt_ids, n, max_tokens)

    def _shared_prefix(self, prompt_ids: Sequence[int]) -> list[int]:
        return self.pages.match(prompt_ids) if self.engine_config.prefix_sharing else []

    def admissible(self, requests: Sequence[tuple[Sequence[int], int, SamplingParams, int, Sequence[int]]]
                   ) -> int:
        """How many of ``requests`` (in order) fit in the free slots and unpromised pages now (host
        arithmetic only)."""
        slots, pages = self.num_free_slots, self.num_free_pages
        for count, (prompt_ids, n, _, max_tokens, _) in enumerate(requests):
            shared = self._shared_prefix(prompt_ids)
            needed = self.pages_needed(prompt_ids, n, max_tokens, shared=len(shared))
            needed += self.pages.num_cached_in(shared)  # attached cached pages stop counting as free
            if n > slots or needed > pages:
                return count
            slots, pages = slots - n, pages - needed
        return len(requests)

    def admit(
        self, requests: Sequence[tuple[Sequence[int], int, SamplingParams, int, Sequence[int]]]
    ) -> list[list[Record]]:
        """Take slots and pages for groups ``(prompt_ids, n, sampling, max_tokens, seed_entropy)``: each
        prompt is prefilled once by the next steps (but whole pages of a prefix already in the pool) and
        forked to its siblings (sibling ``j`` seeded by ``(*seed_entropy, j)``), which share its full pages.

        Returns each group's records (paused once prefilled: :meth:`start` them). Raises ValueError if they do
        not fit (see :meth:`admissible`).
        """
        for prompt_ids, n, _, max_tokens, _ in requests:
            self.check_request(prompt_ids, n, max_tokens)
        if self.admissible(requests) < len(requests):
            raise ValueError(f"{len(requests)} groups requested; {self.num_free_slots} slots and "
                             f"{self.num_free_pages} pages are free")
        ps = self.engine_config.page_size
        groups = []
        for prompt_ids, n, sampling, max_tokens, entropy in requests:
            prompt_ids = [int(t) for t in prompt_ids]
            shared = self._shared_prefix(prompt_ids)
            self._reserved += self.pages_needed(prompt_ids, n, max_tokens, shared=len(shared))
            seqs = []
            for j in range(n):
                record = Record(prompt_ids, max_tokens)
                seq = SlotSequence(record, self._free.popleft(), slot_seed((*entropy, j)), sampling)
                record.slot = seq.slot
                seq.reserve = pages_for(record.budget_end, ps)  # all its pages, shared ones deducted below
                self._seqs[id(record)] = seq
                self._outbox.updates[seq.slot] = (seq, True)
                seqs.append(seq)
            src = seqs[0]
            if shared:
                self.pages.attach(src.slot, shared)
                self._outbox.entries += [(src.slot, col, page) for col, page in enumerate(shared)]
                src.reserve -= len(shared)
                src.kv = len(shared) * ps
                src.record.cached_tokens = src.kv
            self._grow(src, len(prompt_ids))
            if n > 1:  # the siblings' pages now; the device copies src's last page once it is prefilled
                copies = self.pages.fork(src.slot, [s.slot for s in seqs[1:]], len(prompt_ids))
                self._reserved -= len(copies)  # each took its copy of the prompt's last page
                for sibling, pair in zip(seqs[1:], copies, strict=True):
                    sibling.reserve -= int(self.pages.held[sibling.slot])
                    sibling.phase, sibling.source, sibling.copy = Phase.FORK_WAIT, src, pair
                src.siblings = seqs[1:]
            if src.kv >= len(prompt_ids) - 1:
                src.phase = Phase.READY  # nothing to prefill: all but the pending token came from the cache
            self.stats["prompt_tokens"] += len(prompt_ids)
            self.stats["cached_tokens"] += src.kv
            groups.append([s.record for s in seqs])
        return groups

    def start(self, record: Record, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None,
              appended: Sequence[int] = ()) -> None:
        """Queue a generation segment for ``record`` (run by the next :meth:`step`), after inserting the
        ``appended`` tokens (a tool response: prefilled first)."""
        seq = self._seqs.get(id(record))
        if seq is None or seq.phase == Phase.CLOSED:
            raise ValueError("the session is closed or finished")
        if seq.start is not None or seq.phase == Phase.RUNNING:
            raise RuntimeError("the session already has a segment in flight")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        if len(seq.tokens) + len(appended) > record.budget_end:
            raise ValueError(f"{len(appended)} tokens appended but only "
                             f"{record.budget_end - len(seq.tokens)} remain in the budget")
        seq.start = (self.stop_table(stop), max_new_tokens, [int(t) for t in appended])
        self._prepare_start(seq)

    def _prepare_start(self, seq: SlotSequence) -> None:
        """Insert a queued segment's appended tokens once ``seq`` may take them (not before its group is
        forked: the siblings copy its prompt's last page); a session with no budget left is done at once."""
        table, limit, appended = seq.start
        if seq.siblings or seq.phase == Phase.FORK_WAIT:
            return
        if appended:
            seq.tokens += appended
            seq.start = (table, limit, [])
            if seq.phase == Phase.READY:
                seq.phase = Phase.PREFILL
        if len(seq.tokens) >= seq.budget_end:  # nothing may be sampled
            self._reported.append((seq.record, Chunk([], [], [], self.policy_version, "budget")))
            self._release(seq)

    def close(self, record: Record) -> None:
        """Free the record's slot and pages (on the device with the next step); its outputs still in flight
        are discarded. Idempotent. A group's source closed before its siblings were forked goes on
        prefilling for them, invisibly, and is freed once they are."""
        record.slot = None
        seq = self._seqs.get(id(record))
        if seq is not None:
            self._release(seq)

    def _release(self, seq: SlotSequence) -> None:
        seq.start = None
        if seq.siblings:
            seq.closing = True
            return
        del self._seqs[id(seq.record)]
        seq.phase = Phase.CLOSED
        source = seq.source
        if source is not None and seq in source.siblings:  # closed before its fork: none will come
            source.siblings.remove(seq)
            if source.closing and not source.siblings:
                self._release(source)
        if self.engine_config.prefix_sharing:  # its written pages stay findable: a chat's next turn hits
            self.pages.register(seq.slot, seq.tokens, min(seq.kv, len(seq.tokens) - 1))
        self._outbox.freed += self.pages.release(seq.slot)
        self._reserved -= seq.reserve
        seq.reserve = 0
        self._outbox.updates[seq.slot] = (None, True)
        self._free.append(seq.slot)

    # ---- device work

    def _grow(self, seq: SlotSequence, num_tokens: int) -> None:
        """Take pages from the pool (promised at admission) for ``num_tokens`` tokens of ``seq``."""
        new = self.pages.grow(seq.slot, min(num_tokens, seq.budget_end))
        self._outbox.entries += [(seq.slot, col, page) for col, page in new]
        seq.reserve -= len(new)
        self._reserved -= len(new)
        if seq.reserve < 0:
            raise AssertionError(f"slot {seq.slot} took more pages than promised")

    def _bucket(self, tokens: int, rows: int, tiles: int) -> StepLayout:
        for layout in self._layouts.values():
            if layout.tokens >= tokens and layout.rows >= rows and layout.tiles >= tiles:
                return layout
        raise AssertionError(f"no bucket holds {tokens} tokens, {rows} rows, {tiles} tiles")

    def _fork_ready(self) -> None:
        """Fork on the device the siblings of every source whose prompt prefill went out in an earlier step
        (the page copies run before this step's writes)."""
        cfg = self.engine_config
        for src in list(self._seqs.values()):
            if not src.siblings or src.phase == Phase.PREFILL:
                continue
            queued = max(len(self._outbox.copies), len(self._outbox.forks))
            if len(src.siblings) > cfg.num_slots - queued:
                continue
            for sibling in src.siblings:
                (page, copy), col = sibling.copy, int(self.pages.held[sibling.slot]) - 1
                self._outbox.copies.append((page, copy))
                self._outbox.forks.append((src.slot, sibling.slot, col, copy))
                sibling.tokens, sibling.kv, sibling.phase = list(src.tokens), src.kv, Phase.READY
                self._outbox.updates[sibling.slot] = (sibling, False)
            src.siblings = []
            if src.closing:
                self._release(src)

    def _begin(self, seq: SlotSequence) -> None:
        """Make a ready sequence with a queued segment RUNNING from this step."""
        table, limit, _ = seq.start
        # The device clips the segment to the budget, so "no limit" is the whole budget.
        end = seq.budget_end if limit is None else min(len(seq.tokens) + limit, seq.budget_end)
        seq.start, seq.phase = None, Phase.RUNNING
        seq.stop_table, seq.segment_start, seq.segment_end = table, len(seq.tokens), end
        self._outbox.updates[seq.slot] = (seq, self._outbox.updates.get(seq.slot, (None, False))[1])

    def _startable(self, seq: SlotSequence) -> bool:
        return (seq.phase == Phase.READY and seq.start is not None and not seq.start[2] and not seq.siblings
                and not seq.closing)

    def _schedule(self, updates_only: bool = False):
        """Decide the next step: (bucket, decoding sequences, prefill runs, iterations), or None if there is
        nothing to send. ``updates_only``: no decode or prefill, just the update data."""
        cfg = self.engine_config
        tile = cfg.prefill_tile
        if updates_only:
            if not self._outbox:
                return None
            return self._layouts[cfg.token_buckets[0]], [], [], 1
        self._fork_ready()
        for seq in list(self._seqs.values()):
            if seq.start is not None and seq.start[2]:
                self._prepare_start(seq)  # appended tokens waiting for the group's fork
            if self._startable(seq):
                self._begin(seq)
        decoding = [s for s in self._seqs.values() if s.phase == Phase.RUNNING]
        for seq in decoding:  # pages a step ahead: the step in flight and this one may each fill a chunk
            self._grow(seq, len(seq.tokens) + sum(seq.in_flight) + cfg.decode_chunk)
        largest = self._layouts[cfg.max_step_tokens]
        room = largest.num_entries
        blocked = {slot for slot, _, _ in self._outbox.entries[room:]}  # their pages reach the device later
        room -= len(self._outbox.entries)
        tokens, rows, tiles, runs = len(decoding), len(decoding), 0, []
        # Prefill goes into every other step while sessions decode: a prefill step decodes one token per
        # session, the decode step after it a whole chunk, so arriving work never starves the running.
        prefill = not (decoding and self._last_prefilled)
        for seq in self._seqs.values() if prefill else ():
            if seq.phase != Phase.PREFILL:
                continue
            if seq.slot in blocked:
                break  # first come, first served
            n = min(len(seq.tokens) - 1 - seq.kv, cfg.max_step_tokens - tokens)  # the last one stays pending
            singles = n <= tile // 2 and rows + n <= largest.rows
            if not singles:
                n = min(n, (largest.tiles - tiles) * tile)
            new_pages = pages_for(seq.kv + n + 1, cfg.page_size) - int(self.pages.held[seq.slot])
            if n <= 0 or new_pages > room:
                break
            rows, tiles = (rows + n, tiles) if singles else (rows, tiles + -(-n // tile))
            tokens += n
            runs.append((seq, seq.kv, seq.tokens[seq.kv : seq.kv + n], singles))
            seq.kv += n
            self._grow(seq, seq.kv + 1)
            room = largest.num_entries - len(self._outbox.entries)
            if cfg.prefix_sharing:
                self.pages.register(seq.slot, seq.tokens, seq.kv)
            if seq.kv == len(seq.tokens) - 1:  # prefilled: it may run in this very step
                seq.phase = Phase.READY
                if self._startable(seq) and rows < largest.rows and tokens < cfg.max_step_tokens:
                    self._begin(seq)
                    decoding.append(seq)
                    tokens, rows = tokens + 1, rows + 1
        if not (decoding or runs or self._outbox):
            return None
        iterations = 1 if runs else cfg.decode_chunk
        self._last_prefilled = bool(runs)
        return self._bucket(tokens, rows, tiles), decoding, runs, iterations

    def _build(self, layout: StepLayout, decoding, runs, iterations) -> tuple[StepBuilder, list]:
        builder = StepBuilder(layout)
        rows = [(builder.decode(seq.slot), seq) for seq in decoding]
        for seq, start, tokens, singles in runs:
            builder.run(seq.slot, start, tokens, singles=singles)
        builder.decode_iterations(iterations - 1)
        self._outbox.write(builder, self.engine_config)
        return builder, rows

    def step(self, *, updates_only: bool = False) -> list[tuple[Record, Chunk]]:
        """Dispatch the next step if there is work (keeping at most one step in flight beside it), then read
        the oldest step's outputs once a newer one is queued (or nothing more is to come). Returns the chunks
        of tokens that arrived, per record, in order; a chunk with a ``finish_reason`` ends its segment (a
        finished session's slot and pages are freed)."""
        plan = self._schedule(updates_only)
        if plan is not None:
            layout, decoding, runs, iterations = plan
            builder, rows = self._build(layout, decoding, runs, iterations)
            if runs:  # the decode steps after this prefill: their program may compile meanwhile
                starting = sum(s.phase == Phase.READY and s.start is not None for s in self._seqs.values())
                n = min(len(decoding) + starting, self.engine_config.num_slots)
                self._compile_ahead(self._variant(self._bucket(n, n, 0)))
            program = self._program(self._variant(layout))
            self.state, out_i, out_f = program(self.state, self.params, builder.ints, builder.floats)
            for _, seq in rows:
                seq.in_flight.append(iterations)
            self._in_flight.append(_Dispatched((out_i, out_f), rows, iterations))
            self.stats["steps"] += 1
        if self._in_flight and (plan is None or len(self._in_flight) > 1):
            self._collect(self._in_flight.popleft())
        reported, self._reported = self._reported, []
        return reported

    def flush(self) -> list[tuple[Record, Chunk]]:
        """Send what is queued (releases, page entries) and read every step in flight, starting nothing new
        (running sessions stay running for later steps); returns the chunks that arrived."""
        reported = []
        while self._in_flight or self._outbox:
            reported += self.step(updates_only=True)
        return reported

    def _collect(self, done: _Dispatched) -> None:
        out_i, out_f = jax.device_get(done.outputs)
        for row, seq in done.rows:
            seq.in_flight.popleft()
            if seq.phase != Phase.RUNNING or self._seqs.get(id(seq.record)) is not seq:
                continue  # closed by the host meanwhile: its overshoot is discarded
            tokens = out_i[:, row, 0]
            sampled = np.flatnonzero(tokens >= 0)
            if not len(sampled):
                continue
            new = tokens[sampled].tolist()
            seq.tokens += new
            seq.kv = len(seq.tokens) - 1
            self.stats["sampled_tokens"] += len(new)
            reasons = out_i[sampled, row, 1]
            finish = int(reasons[-1])
            chunk = Chunk(new, out_f[sampled, row, 0].tolist(), out_f[sampled, row, 1].tolist(),
                          self.policy_version, FINISH_REASON_NAMES.get(finish))
            self._reported.append((seq.record, chunk))
            if finish:
                seq.phase = Phase.READY
                if chunk.finish_reason in ("eos", "budget"):
                    self._release(seq)
                else:  # paused (a tool call, a segment limit): the pages given ahead, never written, go back
                    freed = self.pages.shrink(seq.slot, len(seq.tokens))
                    self._outbox.freed += freed
                    seq.reserve += len(freed)
                    self._reserved += len(freed)

