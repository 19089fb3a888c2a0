"""The engine's host rooms with no model (as vLLM's ``tests/v1/core``): :class:`Scheduler`,
:class:`SequenceTable` and :class:`PageLedger`. Admission by free slots and pages, forks sharing the prompt's
pages, prefix-cache hits, the page account and its release, new weights that prefill again (suspending and
resuming running segments), the plan as a value and collected rows paired with the sequences they were
planned for. Device outputs are written by hand as :class:`DecodeResult`s."""

import collections
import dataclasses

import pytest

from rstar2jax.engine import FREE, PAUSED, RUNNING, EngineConfig, SamplingParams, StepLayout
from rstar2jax.engine.buckets import bucket_layouts, choose_bucket
from rstar2jax.engine.config import pages_for
from rstar2jax.engine.plan import DecodeResult, StepPlan, WeightUpdate
from rstar2jax.engine.records import Chunk, Phase, SlotSequence
from rstar2jax.engine.requests import pages_needed
from rstar2jax.engine.runner import SlotRecords
from rstar2jax.engine.scheduler import Scheduler

CONFIG = EngineConfig(num_slots=4, max_len=64, decode_chunk=4, token_buckets=(4, 32), prefill_tile=8,
                      eos_token_ids=(), page_size=8)
SAMPLED = SamplingParams(temperature=1.0)
PROMPT = list(range(1, 21))  # two whole pages and a partial one


def _scheduler(**changes) -> Scheduler:
    return Scheduler(dataclasses.replace(CONFIG, **changes), vocab_size=256, stats=collections.Counter())


def _sequence(scheduler: Scheduler, record) -> SlotSequence:
    (seq,) = [s for s in scheduler.sequences if s.record is record]
    return seq


def _collect(scheduler: Scheduler, plan: StepPlan, tokens_per_row: int = 1, finish: str | None = None):
    """What the device would give for ``plan``: ``tokens_per_row`` tokens per decode row, the last one
    ending its segment with ``finish``; returns the chunks reported."""
    results = [DecodeResult(slot, Chunk([9] * tokens_per_row, [-0.5] * tokens_per_row, [0.1] * tokens_per_row,
                                        plan.policy_version, finish)) for slot in plan.decoding]
    scheduler.update_from_output(results)
    return scheduler.sequences.take_reported()


def _run_until_idle(scheduler: Scheduler, tokens_per_row: int = 1) -> None:
    while (plan := scheduler.schedule()) is not None:
        _collect(scheduler, plan, tokens_per_row)


def test_the_smallest_bucket_that_holds_a_step_is_chosen():
    layouts = bucket_layouts(CONFIG)
    assert [layout.tokens for layout in layouts] == [4, 32]
    assert choose_bucket(layouts, 3, 3, 0).tokens == 4
    assert choose_bucket(layouts, 3, 1, 1).tokens == 32  # a prefill tile needs the larger bucket
    with pytest.raises(AssertionError, match="no bucket holds 33 tokens"):
        choose_bucket(layouts, 33, 1, 0)


def test_groups_are_admitted_by_free_slots_and_unpromised_pages_first_come_first_served():
    scheduler = _scheduler(num_pages=13)  # 12 pages of 8 tokens
    table, ledger = scheduler.sequences, scheduler.sequences.ledger
    big, small = (PROMPT, 1, SAMPLED, 44), (PROMPT[:5], 1, SAMPLED, 3)
    assert pages_needed(CONFIG, 20, 1, 44) == 8
    # The second waits, and so does the third behind it (first come, first served).
    assert table.admissible([(*big, (0,)), (*big, (1,)), (*small, (2,))]) == 1
    assert table.admissible([(PROMPT, 5, SAMPLED, 4, (3,))]) == 0  # 5 sessions, 4 slots
    with pytest.raises(ValueError, match="2 groups requested"):
        table.admit([(*big, (0,)), (*big, (1,))])
    assert ledger.num_free == 12 and table.num_free_slots == 4  # a refused admission takes nothing
    ((first,),) = table.admit([(*big, (0,))])
    assert ledger.num_free == 4 and table.admissible([(*big, (1,))]) == 0
    table.close(first)
    assert ledger.num_free == 12 and table.admissible([(*big, (1,))]) == 1


def test_a_group_prefills_its_prompt_once_and_its_siblings_share_its_full_pages():
    scheduler = _scheduler()
    table, pages = scheduler.sequences, scheduler.sequences.ledger.allocator
    (group,) = table.admit([(PROMPT, 3, SAMPLED, 20, (0,))])
    source, *siblings = [_sequence(scheduler, record) for record in group]
    assert [s.phase for s in siblings] == [Phase.FORK_WAIT] * 2 and source.is_fork_source
    prefill = scheduler.schedule()
    runs = [(run.slot, run.start, run.tokens) for run in prefill.prefills]
    assert runs == [(source.slot, 0, tuple(PROMPT[:19]))]
    assert prefill.updates.forks == ()  # the siblings wait for the prompt's keys/values
    _collect(scheduler, prefill)
    fork = scheduler.schedule()
    forks = [(row.source_slot, row.slot) for row in fork.updates.forks]
    assert forks == [(source.slot, s.slot) for s in siblings]
    assert [s.phase for s in (source, *siblings)] == [Phase.READY] * 3 and source.fork is None
    shared = pages.table[source.slot, :2]
    assert (pages.refcount[shared] == 3).all()  # the prompt's two whole pages: held by all three
    last = [int(pages.table[s.slot, 2]) for s in (source, *siblings)]
    assert len(set(last)) == 3 and [copy.destination for copy in fork.updates.copies] == last[1:]
    assert all(s.tokens == PROMPT and s.kv == 19 for s in siblings)


def test_a_prefix_in_the_pool_is_attached_instead_of_prefilled():
    scheduler = _scheduler()
    table, ledger = scheduler.sequences, scheduler.sequences.ledger
    ((first,),) = table.admit([(PROMPT, 1, SAMPLED, 10, (0,))])
    _run_until_idle(scheduler)  # its prompt prefilled: its two whole pages registered
    table.close(first)
    assert ledger.allocator.num_cached == 2 and ledger.allocator.num_used == 0
    ((second,),) = table.admit([(PROMPT + [7, 8], 1, SAMPLED, 10, (1,))])
    assert second.cached_tokens == 16 and scheduler.sequences.stats["cached_tokens"] == 16
    assert ledger.allocator.num_cached == 0  # attached, held again
    plan = scheduler.schedule()
    assert [(run.start, run.tokens) for run in plan.prefills] == [(16, tuple(PROMPT[16:] + [7]))]


def test_the_page_ledger_promises_what_a_group_needs_and_gets_it_all_back():
    """One account of pages: admitting groups promises exactly what they can ever take (less the prefix
    pages they attach), taking pages takes them from the promise, and closing gives everything back."""
    scheduler = _scheduler()
    table, ledger = scheduler.sequences, scheduler.sequences.ledger
    ((a0, a1),) = table.admit([(PROMPT, 2, SAMPLED, 20, (0,))])
    assert ledger.reserved + ledger.allocator.num_used == pages_needed(CONFIG, 20, 2, 20)
    assert ledger.allocator.num_used == 3 + 1  # the prompt's pages, one private copy for the sibling
    plan = scheduler.schedule()  # the prompt's prefill, which registers its whole pages
    assert plan.prefills and not plan.decoding and plan.weights is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.iterations = 2
    ((b,),) = table.admit([(PROMPT + [7, 8], 1, SAMPLED, 10, (1,))])
    assert b.cached_tokens == 16  # two pages attached, not promised again
    used = ledger.allocator.num_used
    taken = 4 + 1  # the group's prompt pages and copy, the new session's pages past the shared ones
    promised = pages_needed(CONFIG, 20, 2, 20) + pages_needed(CONFIG, 22, 1, 10, shared=2)
    assert ledger.reserved == promised - taken
    assert ledger.num_free == CONFIG.pool_pages - 1 - used - ledger.reserved
    for record in (a0, a1, b):
        table.close(record)
    assert ledger.reserved == 0 and ledger.allocator.num_used == 0
    assert table.num_free_slots == CONFIG.num_slots


def test_a_source_closed_before_its_fork_prefills_for_its_siblings_then_is_released():
    scheduler = _scheduler()
    table, ledger = scheduler.sequences, scheduler.sequences.ledger
    ((source, sibling, dropped),) = table.admit([(PROMPT, 3, SAMPLED, 20, (0,))])
    table.close(dropped)  # a sibling closed before its fork: released at once
    table.close(source)
    assert table.num_free_slots == 2 and _sequence(scheduler, source).phase is Phase.PREFILL
    _collect(scheduler, scheduler.schedule())  # the prompt, prefilled for the sibling
    fork = scheduler.schedule()
    assert [row.slot for row in fork.updates.forks] == [sibling.slot]
    assert [s.record for s in table] == [sibling] and table.num_free_slots == 3
    table.close(sibling)
    scheduler.schedule()  # the releases go out
    assert ledger.reserved == 0 and ledger.allocator.num_used == 0 and not table.outbox


def test_a_paused_session_gives_back_the_pages_given_ahead_and_a_finished_one_everything():
    scheduler = _scheduler()
    table, ledger = scheduler.sequences, scheduler.sequences.ledger
    ((record,),) = table.admit([(PROMPT, 1, SAMPLED, 40, (0,))])
    table.start(record, stop=[[9]], max_new_tokens=None, appended=())
    plan = scheduler.schedule()  # the prompt, and its first decode row in the same step
    assert plan.decoding == (record.slot,) and plan.iterations == 1
    _collect(scheduler, plan)
    plan = scheduler.schedule()  # a chunk of decode iterations: its pages given a step ahead
    assert plan.iterations == CONFIG.decode_chunk
    assert ledger.allocator.held[record.slot] == pages_for(21 + CONFIG.decode_chunk, 8) == 4
    ((_, chunk),) = _collect(scheduler, plan, tokens_per_row=2, finish="stop")
    assert chunk.finish_reason == "stop" and _sequence(scheduler, record).phase is Phase.READY
    assert ledger.allocator.held[record.slot] == pages_for(23, 8) == 3  # the page given ahead went back
    table.start(record, stop=(), max_new_tokens=2, appended=())
    _collect(scheduler, scheduler.schedule(), finish="eos")
    assert table.num_free_slots == CONFIG.num_slots and ledger.reserved == 0
    assert ledger.allocator.num_used == 0 and ledger.allocator.num_cached == 2  # its whole prompt pages


def test_new_weights_that_recompute_suspend_running_segments_and_resume_them():
    scheduler = _scheduler()
    ((record,),) = scheduler.sequences.admit([(list(range(1, 41)), 1, SAMPLED, 20, (0,))])
    seq = _sequence(scheduler, record)
    scheduler.sequences.start(record, stop=[[3]], max_new_tokens=10, appended=())
    while not (plan := scheduler.schedule()).decoding:  # the 40-token prompt takes two steps of 32 tokens
        _collect(scheduler, plan)
    _collect(scheduler, plan, tokens_per_row=2)
    segment = seq.segment
    assert seq.phase is Phase.RUNNING and (segment.start, segment.end) == (40, 50)
    scheduler.queue_weights(WeightUpdate({}, policy_version=1, on_update="recompute"))
    assert scheduler.schedule(steps_in_flight=1) is None  # their tokens must be in the sequences first
    phases, plans = [], []
    while seq.phase is not Phase.RUNNING or not plans:
        plans.append(scheduler.schedule())
        phases.append(seq.phase)
        _collect(scheduler, plans[-1])
    assert phases == [Phase.RECOMPUTE, Phase.RUNNING]  # resumed in the step that prefills its last tokens
    assert plans[0].weights is not None and plans[0].policy_version == 1
    assert [run.start for plan in plans for run in plan.prefills][0] == 0  # every key/value again
    assert sum(len(run.tokens) for plan in plans for run in plan.prefills) == 41  # 40 + 2 - the pending one
    (suspended,) = plans[0].updates.slots
    assert suspended.record.status == PAUSED and not plans[0].decoding
    assert seq.segment is segment  # resumed with its bounds and stop table


def test_the_plan_is_a_value_of_slot_ids_tokens_and_snapshots():
    scheduler = _scheduler()
    ((record,),) = scheduler.sequences.admit([(PROMPT, 1, SAMPLED, 40, (0,))])
    scheduler.sequences.start(record, stop=[[3, 4]], max_new_tokens=8, appended=())
    plan = scheduler.schedule()

    def values(value):
        """Every leaf under ``value`` (dataclasses, tuples) but arrays and weights."""
        if dataclasses.is_dataclass(value):
            return [v for f in dataclasses.fields(value) for v in values(getattr(value, f.name))]
        if isinstance(value, tuple):
            return [v for item in value for v in values(item)]
        return [value]

    leaves = values(plan)
    assert not any(isinstance(leaf, (SlotSequence, list, dict)) for leaf in leaves)
    assert isinstance(plan.layout, StepLayout) and plan.decoding == (record.slot,)
    (change,) = plan.updates.slots
    before = change.record
    assert (before.status, before.seq_len, before.segment_start, before.segment_end) == (RUNNING, 20, 20, 28)
    assert not before.stop_seqs.flags.writeable
    _collect(scheduler, plan, tokens_per_row=3)  # the sequence moves on; the plan does not
    assert change.record is before and before.seq_len == 20 and before.recent[-1] == PROMPT[-1]
    scheduler.sequences.close(record)
    assert record.slot is not None  # the record is the consumer's to write (one thread writes it)
    (freed,) = scheduler.schedule().updates.slots
    assert freed.record.status == FREE and freed.clear_row


def test_collected_rows_go_to_the_sequences_they_were_planned_for():
    """A plan names slots only: a row collected after its session was closed and its slot given to another
    is dropped, not handed to the newcomer."""
    scheduler = _scheduler(num_slots=1)
    ((old,),) = scheduler.sequences.admit([(PROMPT, 1, SAMPLED, 10, (0,))])
    scheduler.sequences.start(old, stop=(), max_new_tokens=None, appended=())
    in_flight = scheduler.schedule()
    assert in_flight.decoding == (0,)
    scheduler.sequences.close(old)
    ((new,),) = scheduler.sequences.admit([(PROMPT[:5], 1, SAMPLED, 10, (1,))])
    newcomer = _sequence(scheduler, new)
    assert newcomer.slot == 0
    assert _collect(scheduler, in_flight, tokens_per_row=2) == [] and newcomer.tokens == PROMPT[:5]
    assert new.response_ids == [] and new.finish_reason is None
    assert scheduler.schedule().decoding == ()  # the newcomer's prompt: no decode row
    with pytest.raises(AssertionError, match="do not match"):
        scheduler.update_from_output([DecodeResult(0, None)])


def test_the_runner_tells_greedy_steps_from_its_own_slot_records():
    """The runner keeps the record last written to each slot (from the plans' snapshots): a step is greedy
    while no occupied slot samples, whatever the scheduler's sequences do after planning it."""
    scheduler, slots = _scheduler(), SlotRecords()
    greedy = SamplingParams(temperature=0.0)
    scheduler.sequences.admit([(PROMPT, 2, greedy, 10, (0,))])
    slots.apply(scheduler.schedule().updates)
    assert slots.greedy
    ((sampled,),) = scheduler.sequences.admit([(PROMPT[:3], 1, SAMPLED, 10, (1,))])
    plan = scheduler.schedule()
    slots.apply(plan.updates)
    assert not slots.greedy
    scheduler.sequences.close(sampled)
    assert not slots.greedy  # the release reaches the runner with the next plan
    slots.apply(scheduler.schedule().updates)
    assert slots.greedy
