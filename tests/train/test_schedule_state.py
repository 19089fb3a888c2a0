"""The asynchronous schedule's state as a value: its declared JSON form, the pure transitions' accounting,
and a property test that stops a scripted run (no model: the real ``AsyncSchedule`` over a stream that
finishes groups in an order hypothesis picks) at random points and resumes it from the serialized state."""

import base64
import collections
import dataclasses
import json
import logging
import pickle
import zlib

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rstar2jax.data.problems import Problem, ProblemIterator
from rstar2jax.data.trajectory import TRAJECTORY_FIELDS, Trajectory, trajectory_from_dict, trajectory_to_dict
from rstar2jax.schedules.async_schedule import AsyncSchedule
from rstar2jax.schedules.schedule import CARRY_META_KEY, OneStepOffPolicy
from rstar2jax.schedules.schedule_state import (
    STATE_META_KEY,
    AsyncState,
    Ledger,
    ScheduleInvariantError,
    Ticket,
    legacy_async_state,
    read_legacy_carry,
)
from rstar2jax.train.host_state import HostState

PROBLEMS = [Problem(f"p{i}", f"question {i}", str(i), {"level": i % 3}) for i in range(7)]
STAGES = (3, 3)  # steps per stage
PER_STEP = 2  # problems per batch


def _trajectory(problem_id: str, seed: int) -> Trajectory:
    return Trajectory(problem_id, [5, 6], [7, 8, 9], [1, 0, 1], [-0.5, 0.0, -1.25], ["ok"], 2,
                      reward=float(seed % 2), timings={"generate": 0.5}, policy_versions=[0, -1, 1])


def test_every_trajectory_field_is_declared_and_round_trips_through_json():
    assert set(TRAJECTORY_FIELDS) == {f.name for f in dataclasses.fields(Trajectory)}
    t = _trajectory("p1", 3)
    assert trajectory_from_dict(json.loads(json.dumps(trajectory_to_dict(t)))) == t
    with pytest.raises(ValueError, match="unknown fields"):
        trajectory_from_dict({**trajectory_to_dict(t), "extra": 1})


def test_the_state_round_trips_through_versioned_json():
    state, _ = AsyncState().release(PROBLEMS[:3], seed=11, version=4, processes=2)
    state = state.finish((0, 1), [_trajectory("p1", 11)])
    record = json.loads(json.dumps(state.to_dict()))
    assert record["format"] == 1 and AsyncState.from_dict(record) == state
    assert AsyncState.from_dict(record, owner=0).finished == {}  # group 1 is process 1's
    with pytest.raises(ValueError, match="format 7"):
        AsyncState.from_dict({**record, "format": 7})


def test_a_stage_end_counts_what_it_drops_by_reason():
    state, _ = AsyncState().release(PROBLEMS[:2], seed=0, version=0, processes=1)
    state = state.take([(0, 0), (0, 1)], {(0, 0): [_trajectory("p0", 0)], (0, 1): []})
    state, _ = state.release(PROBLEMS[2:4], seed=0, version=1, processes=1)
    fresh, dropped = state.end_stage()
    assert dropped == 2 and fresh.empty and fresh.released == 0
    assert fresh.ledger == Ledger(4, 1, (("no_trajectory", 1), ("stage_end", 2)))
    assert fresh.ledger.metrics()['async/groups_dropped_total{reason="stage_end"}'] == 2.0
    assert fresh.ledger.metrics()["async/groups_dropped_total"] == 3.0


def test_a_state_of_another_step_is_refused_by_name():
    state, _ = AsyncState().release(PROBLEMS[:2], seed=0, version=0, processes=1)
    with pytest.raises(ScheduleInvariantError, match="belongs to its checkpoint's step"):
        state.at_step(1)
    assert AsyncState().at_step(2).released == 2  # an empty state (a checkpoint where nothing waited)


def test_the_legacy_pickled_carry_reads_only_schedule_records():
    ticket = Ticket(1, 0, PROBLEMS[0], 5, 0, 0, 0)
    carry = {"tickets": [ticket], "complete": {(1, 0): [_trajectory("p0", 5)]}, "batch_sizes": {0: 2, 1: 1},
             "released": 2}
    text = base64.b64encode(zlib.compress(pickle.dumps(carry))).decode()
    state = legacy_async_state(text, {"released": 3, "trained": 2, "dropped": 0})
    assert (state.released, state.consumed, state.batch_sizes, state.tickets) == (2, 1, (2, 1), (ticket,))
    assert state.ledger == Ledger(3, 2) and state.unfinished() == ()
    hostile = base64.b64encode(zlib.compress(pickle.dumps({"x": collections.OrderedDict()}))).decode()
    with pytest.raises(pickle.UnpicklingError, match="not a schedule record"):
        read_legacy_carry(hostile)


# --- stop anywhere, resume: the property ------------------------------------------------------------------


class Killed(Exception):
    """The process died (SIGKILL) or a fault stopped it, mid-step."""


class World:
    """What the scripted producer does: finishes an in-flight group hypothesis picks at each look; a group of
    a problem whose (id, seed) hashes to 0 mod 5 comes back empty (every rollout lost to the sandbox)."""

    def __init__(self, pick, kill_at_look: int | None):
        self.pick, self.kill_at_look, self.looks = pick, kill_at_look, 0

    def stream(self, params, **options):
        return FakeStream(self)


class FakeStream:
    def __init__(self, world: World):
        self.world, self.in_flight = world, {}

    def submit(self, key, problem, *, seed, index):
        self.in_flight[key] = (problem.id, seed)

    def wait(self, timeout):
        world = self.world
        world.looks += 1
        if world.kill_at_look is not None and world.looks >= world.kill_at_look:
            raise Killed
        if not self.in_flight:
            return []
        key = sorted(self.in_flight)[world.pick(len(self.in_flight))]
        problem_id, seed = self.in_flight.pop(key)
        lost = (sum(map(ord, problem_id)) + seed) % 5 == 0
        return [(key, [] if lost else [_trajectory(problem_id, seed)])]

    def update_weights(self, params, version):
        pass

    def stats(self):
        return {}

    def close(self):
        pass


def _run(eta: int, saved: HostState, step: int, *, total: int, stop: tuple, pick) -> tuple[HostState, int]:
    """rl_loop's stage loop over the scripted producer from the checkpoint ``saved`` at ``step``, checkpoints
    every 2 steps; ``stop``: (kind, step, look) with kind "kill" (no save), "fault" (mid-step; the last
    finished step saved), "ctrl_c" (after the step, saved) or None. Returns the newest checkpoint."""
    kind, at, look = stop
    world = World(pick, look if kind in ("kill", "fault") else None)
    schedule = AsyncSchedule(eta, devices=jax.devices()[:1])
    live = saved
    try:
        for index, steps in enumerate(STAGES):
            if index < live.stage:
                continue
            start = live.stage_start
            iterator = ProblemIterator(PROBLEMS, PER_STEP, seed=index, position=live.position)
            schedule.restore(live.schedule)
            schedule.begin_stage(min(steps, total - start), step - start)
            while step - start < steps and step < total:
                stage_last = step - start + 1 >= steps
                problems = schedule.draw(iterator, stage_last=stage_last)
                if kind in ("kill", "fault") and step != at:
                    world.kill_at_look = None
                elif kind in ("kill", "fault"):
                    world.kill_at_look = world.looks + look
                _, groups, _ = schedule.rollouts(world, {}, problems, options={},
                                                 rollout_key=jax.random.PRNGKey(step), version=step,
                                                 stats=collections.Counter())
                schedule.updated({}, step + 1, update_seconds=0.0, trained_tokens=0.0)
                step += 1
                if stage_last:
                    schedule.end_stage()
                trained = [[index, t.batch, t.index, t.problem.id, t.seed, bool(g)]
                           for t, g in zip(schedule.taken, groups, strict=True)]
                live = live.replace(position=iterator.position, schedule=schedule.checkpoint_meta(),
                                    history=(*live.history, {"step": step, "trained": trained}))
                if step % 2 == 0:
                    saved = live
                if kind == "ctrl_c" and step == at:
                    return live, step
            if step >= total:
                break
            live = live.replace(stage=index + 1, stage_start=step, position=0, problem_ids=None)
        return live, step
    except Killed:
        return (live, len(live.history)) if kind == "fault" else (saved, len(saved.history))
    finally:
        schedule.close()


def _through_json(host: HostState) -> HostState:
    return HostState.from_meta(json.loads(json.dumps(host.to_meta())), len(host.history))


def _resumed_until_done(eta: int, stops: list, pick) -> HostState:
    host, step = HostState(), 0
    for kind, at, look in stops:
        total = at if kind == "max_steps" else sum(STAGES)
        host, step = _run(eta, _through_json(host), step, total=total, stop=(kind, at, look), pick=pick)
    host, step = _run(eta, _through_json(host), step, total=sum(STAGES), stop=(None, None, None), pick=pick)
    assert step == sum(STAGES)
    return host


def _accounting(host: HostState) -> dict:
    trained = [tuple(g[:3]) for record in host.history for g in record["trained"]]
    assert len(trained) == len(set(trained)), "a group trained twice"
    ledger = Ledger.from_dict(host.schedule[STATE_META_KEY]["ledger"])
    assert ledger.trained == sum(g[5] for record in host.history for g in record["trained"])
    assert ledger.released == ledger.trained + ledger.dropped_total
    assert ledger.dropped_by("no_trajectory") == len(trained) - ledger.trained
    return {"released": ledger.released, "trained": ledger.trained, **dict(ledger.dropped)}


STOP = st.tuples(st.sampled_from(["kill", "fault", "ctrl_c", "max_steps"]), st.integers(1, sum(STAGES) - 1),
                 st.integers(1, 6))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(eta=st.integers(0, 2), stops=st.lists(STOP, max_size=3), data=st.data())
def test_a_run_stopped_anywhere_and_resumed_trains_every_group_once(eta, stops, data):
    """Stops between steps (Ctrl-C, max_steps, a stage boundary) and mid-step (SIGKILL, a fault), resumed
    from the JSON checkpoint: every group trained exactly once or dropped with its reason, nothing dropped
    at a stage end, and at eta 0 the trained batches are the unstopped run's."""
    stops = sorted(stops, key=lambda s: s[1])
    pick = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731 (the order groups finish in)
    stopped = _resumed_until_done(eta, stops, pick)
    accounting = _accounting(stopped)
    assert accounting["stage_end"] == 0
    assert accounting["released"] == sum(STAGES) * PER_STEP - _repeats()
    if eta == 0:
        straight = _resumed_until_done(0, [], lambda n: 0)
        assert [r["trained"] for r in stopped.history] == [r["trained"] for r in straight.history]


def _repeats() -> int:
    """Problems a batch across an epoch boundary holds twice (rolled out once)."""
    repeats = 0
    for index, steps in enumerate(STAGES):
        iterator = ProblemIterator(PROBLEMS, PER_STEP, seed=index)
        repeats += sum(PER_STEP - len({p.id for p in next(iterator)}) for _ in range(steps))
    return repeats


def test_the_one_step_rollout_is_checkpointed_as_json_and_read_from_the_legacy_pickle():
    ready = ([PROBLEMS[0]], [[_trajectory("p0", 1), _trajectory("p0", 2)]])
    schedule = OneStepOffPolicy()
    schedule.ready = ready
    meta = json.loads(json.dumps(schedule.checkpoint_meta()))
    restored = OneStepOffPolicy()
    restored.restore(meta)
    assert restored.ready == ready
    legacy = {CARRY_META_KEY: base64.b64encode(zlib.compress(pickle.dumps({"ready": ready}))).decode()}
    restored.restore(legacy)
    assert restored.ready == ready


def test_a_stage_end_with_groups_left_says_so_once(caplog):
    schedule = AsyncSchedule(1, devices=jax.devices()[:1])
    schedule.state, _ = AsyncState().release(PROBLEMS[:2], seed=0, version=0, processes=1)
    with caplog.at_level(logging.WARNING, logger="rstar2jax.schedules.async_schedule"):
        schedule.end_stage()
        schedule.end_stage()
    assert [r.getMessage() for r in caplog.records] == [
        "the stage ended with 2 released groups untrained: counted in "
        'async/groups_dropped_total{reason="stage_end"}']
    assert schedule.state.ledger.dropped_by("stage_end") == 2 and schedule.state.empty
