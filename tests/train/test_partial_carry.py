"""Partial rollouts' carry in the checkpoint meta: declared, versioned JSON (``Partial.checkpoint_meta``);
a checkpoint written before it (a pickle under ``rollout_carry``) still restores, through an unpickler that
admits only the declared record classes."""

import base64
import collections
import json
import pickle
import zlib

import pytest

from rstar2jax.agent.rollout_types import PartialRollout, PhaseClock, SessionRecord
from rstar2jax.data.problems import Problem
from rstar2jax.data.rollout_contract import unfinished_from_dict, unfinished_to_dict
from rstar2jax.data.trajectory import Trajectory
from rstar2jax.schedules.schedule import CARRY_META_KEY, PARTIAL_META_KEY, Partial


def pickled_carry(carried: dict) -> str:
    """The ``rollout_carry`` of a checkpoint written before the declared form, encoded as that code did."""
    return base64.b64encode(zlib.compress(pickle.dumps(carried))).decode("ascii")


def _schedule() -> Partial:
    """A partial schedule: one unfinished agent rollout, and a finished trajectory of another group."""
    record = SessionRecord(response_ids=[5, 6, 7], loss_mask=[1, 0, 1], logprobs=[-0.5, 0.0, -0.25],
                           policy_versions=[2, -1, 3], entropies=None, model_text=["x = 1", "print(x)"],
                           tool_outcomes=["ok"], num_turns=2, tool_session="s-1")
    record.clock.seconds.update(generate=0.5, tool=0.25)
    p1, p2 = Problem("p1", "1+1?", "2", {"level": 3}), Problem("p2", "2+2?", "4")
    schedule = Partial(64, 2)
    schedule.unfinished = [PartialRollout(p1, [1, 2], record, unparsed="<tool", seed=7, resumes=1)]
    schedule.problems = {"p1": p1, "p2": p2}
    schedule.held = {"p1": [], "p2": [Trajectory("p2", [3], [8, 9], [1, 1], [-0.1, -0.2], reward=1.0,
                                                 policy_versions=[3, 3])]}
    return schedule


def _state(schedule: Partial):
    """What the schedule carries, comparable (``PartialRollout`` compares by identity)."""
    unfinished = [(u.problem, u.prompt_ids, u.unparsed, u.seed, u.resumes, dict(u.conversation.clock.seconds),
                   {**vars(u.conversation), "clock": None}) for u in schedule.unfinished]
    return unfinished, schedule.held, list(schedule.problems.items())


def test_the_carry_round_trips_through_json_equal_to_the_original():
    schedule = _schedule()
    meta = json.loads(json.dumps(schedule.checkpoint_meta()))
    assert meta[PARTIAL_META_KEY]["format"] == 1 and CARRY_META_KEY not in meta
    restored = Partial(64, 2)
    restored.restore(meta)
    assert _state(restored) == _state(schedule)
    assert type(restored.unfinished[0].conversation.clock) is PhaseClock
    assert unfinished_to_dict(unfinished_from_dict(unfinished_to_dict(schedule.unfinished[0]))) == \
        unfinished_to_dict(schedule.unfinished[0])
    assert Partial(64, 2).checkpoint_meta() == {PARTIAL_META_KEY: None}


def test_a_carry_pickled_by_the_code_before_the_declared_form_still_restores():
    schedule = _schedule()
    carried = {"unfinished": schedule.unfinished, "held": schedule.held, "problems": schedule.problems}
    # The old code's records were named _Conversation and _Clock (aliases kept): pickle them by those names.
    try:
        SessionRecord.__qualname__, PhaseClock.__qualname__ = "_Conversation", "_Clock"
        text = pickled_carry(carried)
    finally:
        SessionRecord.__qualname__, PhaseClock.__qualname__ = "SessionRecord", "PhaseClock"
    assert b"_Conversation" in zlib.decompress(base64.b64decode(text))
    restored = Partial(64, 2)
    restored.restore({CARRY_META_KEY: text})
    assert _state(restored) == _state(schedule)
    assert type(restored.unfinished[0].conversation) is SessionRecord


def test_a_pickled_carry_naming_any_other_class_is_refused():
    restored = Partial(64, 2)
    for carried in ({"unfinished": [], "held": collections.OrderedDict(), "problems": {}},
                    {"unfinished": [], "held": {}, "problems": {}, "run": pickle.loads}):
        with pytest.raises(pickle.UnpicklingError, match=r"^a legacy schedule carry holds .*, not a schedule "
                                                          r"record \(allowed: \["):
            restored.restore({CARRY_META_KEY: pickled_carry(carried)})
    assert restored.empty


def test_an_undeclared_unfinished_record_is_not_checkpointed():
    schedule = Partial(64, 2)
    schedule.unfinished, schedule.problems = [object()], {"p1": Problem("p1", "q", "a")}
    with pytest.raises(TypeError, match=r"^unfinished rollout of undeclared type object"):
        schedule.checkpoint_meta()
    with pytest.raises(ValueError, match=r"^unfinished rollout of undeclared type 'Nope'"):
        unfinished_from_dict({"format": 1, "type": "Nope", "record": {}})
    with pytest.raises(ValueError, match=r"^partial rollouts' carry format 2"):
        schedule.restore({PARTIAL_META_KEY: {"format": 2}})
