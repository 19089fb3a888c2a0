"""The rollout contract (``rstar2jax.data.rollout_contract``): which protocols a rollout satisfies, the
schedule ``make_schedule`` picks and the one-line error when the rollout lacks what it needs, what a LoRA
run's merged rollout forwards, and the stream built from its narrow spec."""

import asyncio
import pickle
import types

import pytest

from rstar2jax import agent
from rstar2jax.agent.multi_turn import BackgroundLoop
from rstar2jax.agent.rollout_types import PartialRollout, SessionRecord
from rstar2jax.agent.stream import RolloutStream, StreamSpec
from rstar2jax.data.problems import Problem
from rstar2jax.data.rollout_contract import (
    BatchRollout,
    SupportsClose,
    SupportsPartial,
    SupportsPolicyParams,
    SupportsStats,
    SupportsStream,
    rollout_stats,
)
from rstar2jax.engine.config import EngineConfig
from rstar2jax.schedules.async_schedule import AsyncSchedule
from rstar2jax.schedules.schedule import OneStepOffPolicy, Partial, Synchronous
from rstar2jax.schedules.schedule_choice import make_schedule
from rstar2jax.train import ConfigError, parse, train_rl
from rstar2jax.train.lora import MergedRollout, merged_rollout
from tests.train.conftest import tiny_model_config
from tests.train.scripted import (
    make_async_scripted_rollout,
    make_partial_scripted_rollout,
    make_scripted_rollout,
    set_fields,
    tiny_rl_config,
)

CAPABILITIES = (BatchRollout, SupportsPartial, SupportsStream, SupportsStats, SupportsPolicyParams,
                SupportsClose)


def declared(rollout) -> set[type]:
    return {capability for capability in CAPABILITIES if isinstance(rollout, capability)}


def policy_rollout(**fields) -> agent.PolicyRollout:
    """A ``PolicyRollout`` that is never called (no tokenizer, no sandbox)."""
    engine = EngineConfig(num_slots=2, page_size=16)
    return agent.PolicyRollout(tiny_model_config(), None, None, engine_config=engine, max_prompt_length=20,
                               **fields)


def test_policy_rollout_and_a_plain_function_satisfy_their_protocols():
    assert declared(policy_rollout()) == {BatchRollout, SupportsPartial, SupportsStream, SupportsStats,
                                          SupportsClose}
    assert declared(make_scripted_rollout()) == {BatchRollout}
    assert declared(make_partial_scripted_rollout()) == {SupportsPartial}
    assert declared(make_async_scripted_rollout()) == {BatchRollout, SupportsStream}


def test_rollout_stats_are_the_last_calls_counts_or_none():
    rollout = policy_rollout()
    assert rollout_stats(rollout) == {}
    rollout.last_stats = {"sandbox_outages": 2.0}
    assert rollout_stats(rollout) == {"sandbox_outages": 2.0}
    assert rollout_stats(make_scripted_rollout()) == {}


@pytest.mark.parametrize("options, expected", [
    ({}, Synchronous),
    ({"off_policy_steps": 1}, OneStepOffPolicy),
    ({"partial_token_budget": 64, "prompts_per_step": 3}, Partial),
    ({"schedule": "async", "max_staleness": 2, "devices": ["d"], "on_update": "recompute"}, AsyncSchedule),
])
def test_make_schedule_picks_each_schedule(options, expected):
    schedule = make_schedule(policy_rollout(), **options)
    assert type(schedule) is expected
    if expected is AsyncSchedule:
        assert (schedule.eta, schedule.devices, schedule.on_update) == (2, ["d"], "recompute")
    if expected is Partial:
        assert (schedule.token_budget, schedule.num_groups) == (64, 3)


@pytest.mark.parametrize("rollout, options, message", [
    (make_scripted_rollout(), {"schedule": "async"},
     "rl.schedule='async' needs a rollout with stream(); PolicyRollout has it, the function "
     "make_scripted_rollout.<locals>.rollout does not"),
    (make_async_scripted_rollout(), {"partial_token_budget": 64},
     "rollout.partial_token_budget=64 needs a rollout with partial(); PolicyRollout has it, the function "
     "make_async_scripted_rollout.<locals>.rollout does not"),
    (make_partial_scripted_rollout(), {"off_policy_steps": 1},
     "rl.off_policy_steps=1 needs a rollout with __call__(); PolicyRollout has it, SimpleNamespace does not"),
    (types.SimpleNamespace(strem=None), {"schedule": "async"},
     "rl.schedule='async' needs a rollout with stream(); PolicyRollout has it, SimpleNamespace does not "
     "(it has strem(): misspelt?)"),
])
def test_a_missing_or_misspelt_capability_is_named_in_one_line(rollout, options, message):
    with pytest.raises(ConfigError) as error:
        make_schedule(rollout, **options)
    assert str(error.value) == message


def test_make_schedule_refuses_options_that_do_not_combine():
    with pytest.raises(ValueError, match="do not combine"):
        make_schedule(policy_rollout(), off_policy_steps=1, partial_token_budget=8)
    with pytest.raises(ValueError, match="schedule='eager'"):
        make_schedule(policy_rollout(), schedule="eager")


class Recorder:
    """A rollout declaring every capability, recording what each call got."""

    def __init__(self):
        self.calls, self.last_stats, self.closed = [], {"n": 1.0}, False

    def __call__(self, params, problems, **options):
        self.calls.append(("call", params))
        return []

    def partial(self, params, problems, **options):
        self.calls.append(("partial", params))
        return [], []

    def stream(self, params, **options):
        self.calls.append(("stream", params))
        return "stream"

    def close(self):
        self.closed = True


def fake_base():
    """What ``MergedRollout`` reads of a ``FrozenBase``: ``merged(adapters, dtype)``, the compute dtype."""
    return types.SimpleNamespace(merged=lambda adapters, dtype: ("merged", adapters, dtype), offload=False,
                                 model_config=types.SimpleNamespace(compute_dtype="bfloat16"))


@pytest.mark.parametrize("rollout", [make_scripted_rollout(), make_partial_scripted_rollout(),
                                     make_async_scripted_rollout(), Recorder(), policy_rollout()])
def test_merged_rollout_forwards_exactly_what_the_wrapped_rollout_declares(rollout):
    merged = merged_rollout(fake_base(), rollout)
    assert isinstance(merged, MergedRollout)
    assert declared(merged) == declared(rollout) | {SupportsPolicyParams}


def test_merged_rollout_samples_from_the_merged_policy_and_forwards_the_rest():
    rollout = Recorder()
    merged = merged_rollout(fake_base(), rollout)
    merged("adapters", [])
    merged.partial("adapters", [], token_budget=4, resume=[])
    assert merged.stream(merged.policy_params("adapters")) == "stream"
    merged_params = ("merged", "adapters", "bfloat16")
    assert rollout.calls == [(name, merged_params) for name in ("call", "partial", "stream")]
    rollout.last_stats = {"n": 2.0}
    assert merged.last_stats == {"n": 2.0}
    merged.close()
    assert rollout.closed


def test_the_batch_and_stream_paths_size_the_engine_alike(monkeypatch):
    seen = []

    def make_engine(self, params, engine_config, policy_version):
        seen.append((engine_config.max_len, policy_version))
        raise InterruptedError

    monkeypatch.setattr(agent.PolicyRollout, "make_engine", make_engine)
    rollout = policy_rollout()
    try:
        with pytest.raises(InterruptedError):
            rollout(None, [], samples_per_problem=2, max_response_length=30, max_turns=1, seed=0,
                    policy_version=3)
        with pytest.raises(InterruptedError):
            rollout.stream(None, policy_version=3, samples_per_problem=2, max_response_length=30, max_turns=1)
    finally:
        rollout.close()
    assert seen == [(64, 3), (64, 3)]  # 20 prompt + 30 response tokens: four 16-token pages


class FakeEngine:
    """What a stream needs of an engine: start and stop, weights in flight, the core's counts."""

    def __init__(self, params, max_response_length, policy_version):
        self.weights = [(policy_version, params)]
        self.core = types.SimpleNamespace(stats={"busy_s": 0.5, "sampled_tokens": 7})
        self.running = False

    async def __aenter__(self):
        self.running = True

    async def __aexit__(self, *exc_info):
        self.running = False

    async def update_weights(self, params, policy_version, *, on_update):
        self.weights.append((policy_version, params))


class FakeSessions:
    """A session loop whose groups are ``n`` trajectories named after the problem, index and seed."""

    def __init__(self, engine, max_response_length, max_turns):
        self.engine, self.budget = engine, (max_response_length, max_turns)
        self.outage = types.SimpleNamespace(stats=lambda: {"sandbox_outage_s": 0.0})

    async def problem(self, index, problem, n, *, seed):
        await asyncio.sleep(0)
        return [types.SimpleNamespace(problem_id=problem.id, index=index, seed=seed, tool_outcomes=[])] * n


def test_a_stream_runs_from_its_narrow_spec_alone():
    loop = BackgroundLoop()
    try:
        stream = RolloutStream(StreamSpec(engine=FakeEngine, sessions=FakeSessions, loop=loop), "w0",
                               policy_version=0, samples_per_problem=2, max_response_length=30, max_turns=3)
        assert stream.engine.running and stream.run.budget == (30, 3)
        stream.submit("k", Problem("p1", "1+1?", "2"), seed=5, index=1)
        stream.update_weights("w1", 1)
        (key, group), = stream.wait(timeout=30)
        assert key == "k" and [(t.problem_id, t.index, t.seed) for t in group] == [("p1", 1, 5)] * 2
        assert stream.engine.weights == [(0, "w0"), (1, "w1")]
        assert stream.stats()["generated_tokens"] == 7.0
        engine = stream.engine
        stream.close()
        assert not engine.running
    finally:
        loop.close()


def test_partial_rollouts_pickled_under_the_records_old_name_still_load():
    """Checkpoints of earlier runs pickled ``PartialRollout`` records whose session record was the private
    ``_Conversation`` (the same length as its public name, so the bytes can be rewritten in place)."""
    record = SessionRecord(response_ids=[5, 6], loss_mask=[1, 0])
    data = pickle.dumps(PartialRollout(Problem("p1", "1+1?", "2"), [1, 2], record))
    old = data.replace(b"SessionRecord", b"_Conversation")
    assert old != data
    loaded = pickle.loads(old)
    assert isinstance(loaded.conversation, SessionRecord) and loaded.num_tokens == 2


def test_train_rl_refuses_a_rollout_without_the_schedules_capability_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    options = parse(set_fields(tiny_rl_config(str(workdir)), {"rl.schedule": "async"}))
    with pytest.raises(ConfigError, match=r"^rl.schedule='async' needs a rollout with stream\(\)"):
        train_rl(options, rollout_fn=make_scripted_rollout())
    assert not workdir.exists()
