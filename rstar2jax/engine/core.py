"""The synchronous engine: :class:`EngineCore` joins the scheduler and the runner into the pipelined step
loop (scheduler -> plan -> runner -> outputs -> scheduler), keeping one step in flight."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from rstar2jax.engine.buckets import StepLayout
from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.pages import PageAllocator
from rstar2jax.engine.plan import WeightUpdate, check_policy_version
from rstar2jax.engine.records import Chunk, Record
from rstar2jax.engine.requests import check_request, pages_needed, stop_table
from rstar2jax.engine.runner import StepRunner
from rstar2jax.engine.scheduler import Scheduler
from rstar2jax.engine.sequences import GroupRequest
from rstar2jax.engine.state import EngineState
from rstar2jax.models import ModelConfig

__all__ = ["EngineCore"]


class EngineCore:
    """Synchronous engine: a :class:`~rstar2jax.engine.scheduler.Scheduler` (admission, pages, forks, the
    prefix cache, what runs next) and a :class:`~rstar2jax.engine.runner.StepRunner` (build, compile,
    dispatch, collect). Each :meth:`step` asks the scheduler for a :class:`~rstar2jax.engine.plan.StepPlan`,
    has the runner dispatch it, then has it read the step before (one step in flight beside the new one) and
    hands those outputs back to the scheduler.

    Not thread-safe: one caller at a time. :class:`~rstar2jax.engine.Engine` drives it from a thread of its
    own; :func:`~rstar2jax.engine.generate` drives it directly. Use: :meth:`admit` groups (when
    :meth:`admissible`), :meth:`start` their segments, call :meth:`step` while :attr:`num_active` (it returns
    the chunks of tokens that arrived), :meth:`close` sessions; :meth:`update_weights` between steps.

    ``policy_version`` (an int >= 0, the trainer step whose parameters ``params`` are) tags every token the
    engine samples with these weights (``Segment.policy_versions``); inserted tokens get ``NO_POLICY_VERSION``
    (-1). ``params``' buffers are used as they are where no cast is needed: do not donate them meanwhile.
    """

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, policy_version: int = 0):
        check_policy_version(policy_version)
        self.config = config
        self.engine_config = engine_config
        # steps, prompt_tokens, cached_tokens, sampled_tokens; busy_s (counted by Engine)
        self.stats = collections.Counter()
        self.runner = StepRunner(params, config, engine_config)
        self.scheduler = Scheduler(engine_config, config.vocab_size, self.stats,
                                   policy_version=policy_version)

    # ---- what the rooms hold

    @property
    def policy_version(self) -> int:
        """The policy version of the weights the last planned step runs on (the constructor's until a step
        carries new ones)."""
        return self.scheduler.policy_version

    @property
    def state(self) -> EngineState:
        """The device state (donated to each step: read it between calls)."""
        return self.runner.state

    @property
    def pages(self) -> PageAllocator:
        """The page tables, reference counts and prefix cache (read them between calls)."""
        return self.scheduler.sequences.ledger.allocator

    @property
    def num_free_slots(self) -> int:
        return self.scheduler.sequences.num_free_slots

    @property
    def num_free_pages(self) -> int:
        """Pages neither held by a sequence nor promised to one (cached pages count as free)."""
        return self.scheduler.sequences.ledger.num_free

    @property
    def num_reserved_pages(self) -> int:
        """Pages promised to admitted sequences and not taken from the pool yet (0 when the engine is
        idle)."""
        return self.scheduler.sequences.ledger.reserved

    @property
    def num_pages(self) -> int:
        """Pages of the KV pool sequences can hold (the null page left out): used + cached + free."""
        return len(self.pages.refcount) - 1

    @property
    def num_used_pages(self) -> int:
        """Pages held by at least one sequence (0 when the engine is idle)."""
        return self.pages.num_used

    @property
    def num_cached_pages(self) -> int:
        """Pages no sequence holds that keep a prefix's keys/values for the prefix cache (evicted, least
        recently used first, when the pool needs them)."""
        return self.pages.num_cached

    @property
    def num_active(self) -> int:
        """Sequences with work queued or in flight (prefill, a segment), plus steps and chunks not yet
        read."""
        return self.scheduler.sequences.num_pending + self.runner.num_in_flight

    @property
    def kv_bytes_held(self) -> int:
        """Bytes of the pages sequences hold now."""
        return self.pages.num_used * self.state.pages.nbytes_per_page

    @property
    def programs(self) -> int:
        """Step programs this engine has used (each compiled once per process)."""
        return self.runner.num_programs

    @property
    def program_layouts(self) -> frozenset[StepLayout]:
        """The layouts of the step programs this engine has used (its buckets, greedy-only or not)."""
        return self.runner.layouts_used

    def warmup(self, threads: int = 2) -> None:
        """Compile every bucket's step program ahead of time (in ``threads`` threads; nothing runs), so that
        serving never compiles."""
        self.runner.warmup(self.scheduler.layouts, threads)

    # ---- requests

    def stop_table(self, stop: Sequence[Sequence[int]]) -> np.ndarray:
        """``[max_stops, max_stop_len]`` right-aligned stop table; raises ValueError if it does not fit."""
        return stop_table(self.engine_config, stop)

    def pages_needed(self, prompt_ids: Sequence[int], n: int, max_tokens: int, *, shared: int = 0) -> int:
        """Pages a group can ever take from the pool (:func:`~rstar2jax.engine.requests.pages_needed`)."""
        return pages_needed(self.engine_config, len(prompt_ids), n, max_tokens, shared=shared)

    def check_request(self, prompt_ids: Sequence[int], n: int, max_tokens: int) -> None:
        """Raise ValueError for a request that could never be admitted."""
        check_request(self.engine_config, self.config.vocab_size, prompt_ids, n, max_tokens)

    def admissible(self, requests: Sequence[GroupRequest]) -> int:
        """How many of ``requests`` (in order) fit in the free slots and unpromised pages now (host
        arithmetic only)."""
        return self.scheduler.sequences.admissible(requests)

    def admit(self, requests: Sequence[GroupRequest]) -> list[list[Record]]:
        """Take slots and pages for groups ``(prompt_ids, n, sampling, max_tokens, seeds)``: each
        prompt is prefilled once by the next steps (but whole pages of a prefix already in the pool) and
        forked to its siblings (sibling ``j`` seeded by ``(*seeds, j)``, or ``seeds.seeds[j]`` for
        :class:`~rstar2jax.engine.records.StreamSeeds`), which share its full pages.

        Returns each group's records (paused once prefilled: :meth:`start` them). Raises ValueError if they do
        not fit (see :meth:`admissible`).
        """
        return self.scheduler.sequences.admit(requests)

    def start(self, record: Record, stop: Sequence[Sequence[int]] = (), max_new_tokens: int | None = None,
              appended: Sequence[int] = ()) -> None:
        """Queue a generation segment for ``record`` (run by the next :meth:`step`), after inserting the
        ``appended`` tokens (a tool response: prefilled first)."""
        self.scheduler.sequences.start(record, stop, max_new_tokens, appended)

    def close(self, record: Record) -> None:
        """Free the record's slot and pages (on the device with the next step); its outputs still in flight
        are discarded. Idempotent. A group's source closed before its siblings were forked goes on
        prefilling for them, invisibly, and is freed once they are. The record is left as it is: its one
        writer is the consumer of the chunks (:class:`~rstar2jax.engine.records.Record`), which may be
        another thread than the one driving the core."""
        self.scheduler.sequences.close(record)

    @property
    def params(self):
        """The weights of the last dispatched step (as the engine prepared them)."""
        return self.runner.params

    def prepare_weights(self, params, policy_version: int, on_update: str = "keep") -> WeightUpdate:
        """The checks and preparation of :meth:`update_weights` (safe from any thread:
        :meth:`Engine.update_weights` runs them in the caller's); :meth:`queue_weights` queues the result."""
        return self.runner.prepare_weights(params, policy_version, on_update)

    def queue_weights(self, update: WeightUpdate) -> None:
        """Queue prepared weights for the next step (:meth:`update_weights`)."""
        self.scheduler.queue_weights(update)

    def update_weights(self, params, policy_version: int, *, on_update: str = "keep") -> None:
        """Decode with ``params`` (the trainer step ``policy_version``'s) from the next step on.

        The step in flight keeps the old weights; the next one dispatched runs on the new ones, and every
        token carries the version of the weights that sampled it. Sessions keep their slots, pages and
        segments (a session paused on a tool call stays paused). ``on_update="keep"``: running sequences
        decode on over their keys/values as written (by the old weights); ``"recompute"``: once the step in
        flight is read, every sequence's keys/values are prefilled again with the new weights first (running
        segments are suspended meanwhile and resume where they were). Either way no prefix written before is
        reused. Nothing compiles again: raises ValueError naming the leaf unless ``params`` has, once
        prepared (cast to the compute dtype, layers split or stacked), the shapes, dtypes and shardings of
        the current weights; nothing changes then. ``params``' buffers are used as they are where no cast is
        needed: do not donate them meanwhile.
        """
        self.queue_weights(self.prepare_weights(params, policy_version, on_update))

    # ---- the step loop

    def step(self, *, updates_only: bool = False) -> list[tuple[Record, Chunk]]:
        """Dispatch the next step if there is work (keeping at most one step in flight beside it), then read
        the oldest step's outputs once a newer one is queued (or nothing more is to come). Returns the chunks
        of tokens that arrived, per record, in order; a chunk with a ``finish_reason`` ends its segment (a
        finished session's slot and pages are freed)."""
        runner = self.runner
        plan = self.scheduler.schedule(updates_only=updates_only, steps_in_flight=runner.num_in_flight)
        if plan is not None:
            runner.dispatch(plan)
            self.stats["steps"] += 1
        if runner.num_in_flight and (plan is None or runner.num_in_flight > 1):
            self.scheduler.update_from_output(runner.collect())
        return self.scheduler.sequences.take_reported()

    def flush(self) -> list[tuple[Record, Chunk]]:
        """Send what is queued (releases, page entries) and read every step in flight, starting nothing new
        (running sessions stay running for later steps); returns the chunks that arrived."""
        reported = []
        while self.runner.num_in_flight or self.scheduler.sequences.outbox:
            reported += self.step(updates_only=True)
        return reported
