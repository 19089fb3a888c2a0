"""The engine's runner: it turns the scheduler's :class:`~rstar2jax.engine.plan.StepPlan` into device work and
the device's outputs into chunks.

:class:`StepRunner` owns the device state (:class:`~rstar2jax.engine.EngineState`, donated to every step)
and the weights. For each plan it builds the step's two input buffers
(:class:`~rstar2jax.engine.step.StepBuilder`), takes the bucket's compiled program from the process's
:data:`~rstar2jax.engine.programs.PROGRAMS` (compiling the next likely one meanwhile) and dispatches it:
JAX's asynchronous dispatch returns at once, so the host plans and dispatches step k+1 before it reads step
k's outputs and the device never waits for the host to look at tokens. :meth:`StepRunner.collect` reads the
oldest step in flight (per decode row and iteration: token, log-prob, entropy, why its segment ended) into
one :class:`~rstar2jax.engine.records.Chunk` per row that sampled something, tagged with the policy version
of the weights that step ran on (the output processor's part).

The runner reads nothing of the scheduler's: a plan is a value (slot ids, token tuples, slot records as
snapshots), and what the runner needs to know about the slots between plans it keeps itself
(:class:`SlotRecords`: the record last written to each slot, from which it tells whether any slot samples).

New weights (:meth:`StepRunner.prepare_weights`) must have the shapes, dtypes and shardings of the current
ones, so that no program compiles again; the runner switches to them with the plan that carries them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from rstar2jax.engine.buckets import StepLayout
from rstar2jax.engine.config import EngineConfig
from rstar2jax.engine.outbox import SlotRecord, StepUpdates
from rstar2jax.engine.plan import DecodeResult, StepPlan, WeightUpdate
from rstar2jax.engine.programs import PROGRAMS, abstract_shapes, check_same_shapes, engine_weights
from rstar2jax.engine.records import Chunk
from rstar2jax.engine.state import FINISH_REASON_NAMES, FREE, EngineState, init_state
from rstar2jax.engine.step import StepBuilder
from rstar2jax.models import ModelConfig

__all__ = ["SlotRecords", "StepRunner", "write_updates"]


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched step: its outputs (device arrays), the slot of each decode row (in row order), and the
    policy version of the weights it ran on."""

    outputs: tuple[jax.Array, jax.Array]
    decoding: tuple[int, ...]
    policy_version: int


class SlotRecords:
    """The runner's own per-slot state (as vLLM V1's ``InputBatch``): the record last written to each slot
    on the device, kept from the plans' snapshots, so that the runner decides what it needs (the greedy-only
    program) without reading the scheduler's sequences."""

    def __init__(self):
        self._records: dict[int, SlotRecord] = {}  # occupied slots only
        self._sampling = 0  # occupied slots with a temperature above 0

    def apply(self, updates: StepUpdates) -> None:
        """The slot records a dispatched step writes."""
        for change in updates.slots:
            old = self._records.pop(change.slot, None)
            if old is not None and old.temperature != 0:
                self._sampling -= 1
            if change.record.status != FREE:
                self._records[change.slot] = change.record
                if change.record.temperature != 0:
                    self._sampling += 1

    @property
    def greedy(self) -> bool:
        """No occupied slot samples (every one has temperature 0)."""
        return self._sampling == 0


def write_updates(builder: StepBuilder, updates: StepUpdates) -> None:
    """A step's update data into its inputs, in the order the device applies it."""
    for slot, record, clear in updates.slots:
        builder.update(
            slot, clear=clear, status=record.status, seq_len=record.seq_len, last_token=record.last_token,
            recent=record.recent, seed=record.seed, temperature=record.temperature, top_p=record.top_p,
            top_k=record.top_k, budget_end=record.budget_end, segment_start=record.segment_start,
            segment_end=record.segment_end, stop_seqs=record.stop_seqs)
    for entry in updates.entries:
        builder.entry(*entry)
    for fork in updates.forks:
        builder.fork(*fork)
    for copy in updates.copies:
        builder.copy(*copy)
    builder.poison(updates.freed)


class StepRunner:
    """Builds, compiles, dispatches and collects the engine's steps (module docstring); at most the steps the
    caller dispatched and has not collected are in flight."""

    def __init__(self, params, config: ModelConfig, engine_config: EngineConfig):
        self.engine_config = engine_config
        self._config = config
        self.params = engine_weights(params, config, engine_config)  # checks the precision before any work
        self.state: EngineState = init_state(config, engine_config)
        self._abstract = (abstract_shapes(self.state), abstract_shapes(self.params))
        self._programs: dict[StepLayout, object] = {}  # this engine's compiled steps, by bucket
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self.slots = SlotRecords()

    @property
    def num_programs(self) -> int:
        """Step programs this engine has used (each compiled once per process)."""
        return len(self._programs)

    @property
    def layouts_used(self) -> frozenset[StepLayout]:
        """The layouts (buckets, greedy-only or not) of the programs this engine has used."""
        return frozenset(self._programs)

    def warmup(self, layouts: Sequence[StepLayout], threads: int = 2) -> None:
        """Compile ``layouts``' programs ahead of time, in ``threads`` threads (nothing runs)."""
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(self._program, reversed(layouts)))

    def _program(self, layout: StepLayout):
        program = self._programs.get(layout)
        if program is None:
            program = self._programs[layout] = PROGRAMS.get(self._abstract, layout,
                                                            self.engine_config.return_on_stop)
        return program

    def _variant(self, layout: StepLayout, greedy: bool) -> StepLayout:
        """``layout``'s greedy-only program (``StepLayout.greedy``) for a ``greedy`` step, unless only the
        general one is compiled or compiling (it serves greedy rows as well); else ``layout``."""
        if not greedy:
            return layout
        greedy_layout = dataclasses.replace(layout, greedy=True)
        general_held = layout in self._programs or PROGRAMS.holds(self._abstract, layout,
                                                                  self.engine_config.return_on_stop)
        return greedy_layout if greedy_layout in self._programs or not general_held else layout

    def _compile_ahead(self, layout: StepLayout) -> None:
        """Compile ``layout``'s program in the background unless this engine has it."""
        if layout not in self._programs:
            PROGRAMS.compile_ahead(self._abstract, layout, self.engine_config.return_on_stop)

    @property
    def num_in_flight(self) -> int:
        """Steps dispatched and not collected yet."""
        return len(self._in_flight)

    def prepare_weights(self, params, policy_version: int, on_update: str = "keep") -> WeightUpdate:
        """``params`` prepared like the engine's weights (FP8 quantization, cast, layers split or stacked:
        ``programs.engine_weights``); raises ValueError
        unless every leaf has the shape, dtype and sharding of the current weights (the compiled programs
        take nothing else). Touches no state of the runner: safe from any thread."""
        try:
            prepared = engine_weights(params, self._config, self.engine_config)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise ValueError(f"new weights are not a parameter tree of the engine's model: {error!r}"
                             ) from error
        check_same_shapes(self.params, prepared)
        return WeightUpdate(prepared, policy_version, on_update)

    def dispatch(self, plan: StepPlan) -> None:
        """Build ``plan``'s inputs and dispatch its program (returns before the device has run it); with
        ``plan.weights``, this step and the later ones run on them. While no slot samples, a bucket's
        greedy-only program runs (``StepLayout.greedy``)."""
        builder = StepBuilder(plan.layout)
        for slot in plan.decoding:  # decode rows first: row i is plan.decoding[i]
            builder.decode(slot)
        for run in plan.prefills:
            builder.run(run.slot, run.start, run.tokens, singles=run.as_singles)
        builder.decode_iterations(plan.iterations - 1)
        write_updates(builder, plan.updates)
        self.slots.apply(plan.updates)
        greedy = self.slots.greedy
        if plan.compile_ahead is not None:
            self._compile_ahead(self._variant(plan.compile_ahead, greedy))
        if plan.weights is not None:
            self.params = plan.weights.params
        program = self._program(self._variant(plan.layout, greedy))
        self.state, out_i, out_f = program(self.state, self.params, builder.ints, builder.floats)
        self._in_flight.append(_InFlight((out_i, out_f), plan.decoding, plan.policy_version))

    def collect(self) -> list[DecodeResult]:
        """Read the oldest step in flight (waiting for the device): each decode row's sampled tokens, their
        log-probs and entropies, the policy version and why its segment ended, as a chunk (None: nothing
        sampled)."""
        done = self._in_flight.popleft()
        out_i, out_f = jax.device_get(done.outputs)
        results = []
        for row, slot in enumerate(done.decoding):
            tokens = out_i[:, row, 0]
            sampled = np.flatnonzero(tokens >= 0)
            chunk = None
            if len(sampled):
                finish = int(out_i[sampled[-1], row, 1])
                chunk = Chunk(tokens[sampled].tolist(), out_f[sampled, row, 0].tolist(),
                              out_f[sampled, row, 1].tolist(), done.policy_version,
                              FINISH_REASON_NAMES.get(finish))
            results.append(DecodeResult(slot, chunk))
        return results
