"""New weights between two device steps: the step in flight keeps the old ones, every token keeps the
version that sampled it, nothing compiles again, sessions survive; ``on_update="recompute"`` prefills the
keys/values again."""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring

from rstar2jax.engine import Engine, EngineCore, SamplingParams
from rstar2jax.engine.programs import PROGRAMS
from tests.engine.conftest import ENGINE_CONFIG, teacher_forced
from tests.engine.test_paged import PAGED_CONFIG

SAMPLED = SamplingParams(temperature=1.0)


def _head_only(params):
    """Weights that sample differently but write the same keys/values: a new final norm and last layer's
    MLP output (every layer's keys and values depend only on what comes before them)."""
    layers = params["layers"]
    return {**params, "final_norm": params["final_norm"] * 1.5,
            "layers": {**layers, "down_proj": layers["down_proj"].at[-1].multiply(-2.0)}}


def _everywhere(params):
    """Weights changed in every leaf (new keys and values too)."""
    noise = lambda i, x: x * (1.0 + 0.1 * jnp.cos(jnp.arange(x.size, dtype=x.dtype) + i).reshape(x.shape))
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [noise(i, x) for i, x in enumerate(leaves)])


def _drain(core):
    """Step until idle, handing every chunk to its record."""
    while core.num_active:
        for record, chunk in core.step():
            record.receive(chunk)


def _check_versions(tiny, prompt_ids, response_ids, loss_mask, logprobs, versions, params_of):
    """Each sampled token's log-prob is the teacher-forced one under the weights of the version that sampled
    it."""
    sampled = np.flatnonzero(loss_mask)
    tagged = np.asarray(versions)[sampled]
    assert set(tagged) <= set(params_of) and not (np.asarray(versions)[np.asarray(loss_mask) == 0] + 1).any()
    response = np.asarray(response_ids)
    for version, params in params_of.items():
        rows = sampled[tagged == version]
        reference = teacher_forced(params, tiny.config, list(prompt_ids) + list(response_ids))
        positions = len(prompt_ids) + rows - 1
        expected = reference[positions, response[rows]]
        np.testing.assert_allclose(np.asarray(logprobs)[rows], expected, atol=1e-5)


class _Compiles:
    """Backend compiles while open."""

    def __enter__(self):
        self.names = []
        self._listener = lambda event, duration, **kw: (
            self.names.append(kw.get("fun_name")) if event == "/jax/core/compile/backend_compile_duration"
            else None)
        monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc_info):
        monitoring.unregister_event_duration_listener(self._listener)


def test_weights_updated_with_a_step_in_flight_sample_from_the_next_step(tiny_qwen3):
    old, new = tiny_qwen3.params, _head_only(tiny_qwen3.params)
    core = EngineCore(old, tiny_qwen3.config, ENGINE_CONFIG, policy_version=3)
    core.warmup()
    programs = (core.programs, len(PROGRAMS))
    prompt = np.random.default_rng(0).integers(0, 256, 11).tolist()
    (group,) = core.admit([(prompt, 2, SAMPLED, 40, (5,))])
    for record in group:
        core.start(record, max_new_tokens=24)
    with _Compiles() as compiles:
        received = 0
        while not received:  # the step read now was dispatched before the one in flight
            for record, chunk in core.step():
                record.receive(chunk)
                received += len(chunk.tokens)
        core.update_weights(new, 4)
        assert core.policy_version == 3  # the step in flight runs on the old weights
        _drain(core)
    assert compiles.names == [] and (core.programs, len(PROGRAMS)) == programs
    assert core.policy_version == 4
    old_tokens = 0
    for record in group:
        assert len(record.response_ids) == 24
        versions = record.policy_versions
        assert set(versions) == {3, 4} and versions == sorted(versions)
        old_tokens += record.policy_versions.count(3)
        _check_versions(tiny_qwen3, record.prompt_ids, record.response_ids, record.loss_mask, record.logprobs,
                        record.policy_versions, {3: old, 4: new})
    assert old_tokens > received  # what the step in flight sampled carries the old version


def test_recompute_prefills_every_sequence_again_with_the_new_weights(tiny_qwen3):
    """Forked siblings paused on a tool, and a running session that attached their prompt's pages from the
    prefix cache: after ``on_update="recompute"`` every token sampled with the new weights has the
    teacher-forced log-prob of the new weights over the whole sequence; the running segment resumes and
    keeps its limit; nothing compiles again."""
    old, new = tiny_qwen3.params, _everywhere(tiny_qwen3.params)
    core = EngineCore(old, tiny_qwen3.config, PAGED_CONFIG)
    core.warmup()
    rng = np.random.default_rng(1)
    prompt, tool = rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, 3).tolist()
    (siblings,) = core.admit([(prompt, 2, SAMPLED, 24, (0,))])
    for record in siblings:
        core.start(record, max_new_tokens=5)
    _drain(core)  # both paused, as on a tool call
    ((running,),) = core.admit([(prompt + [9, 8, 7, 6], 1, SAMPLED, 20, (1,))])
    assert running.cached_tokens == 16
    core.start(running, max_new_tokens=14)
    programs = (core.programs, len(PROGRAMS))
    with _Compiles() as compiles:
        while not running.response_ids:
            for record, chunk in core.step():
                record.receive(chunk)
        core.update_weights(new, 1, on_update="recompute")
        _drain(core)
        siblings[0].add(tool, None)  # a tool's output, as Session.append and generate insert it
        core.start(siblings[0], max_new_tokens=4, appended=tool)
        core.start(siblings[1], max_new_tokens=4)
        _drain(core)
    assert compiles.names == [] and (core.programs, len(PROGRAMS)) == programs
    assert len(running.response_ids) == 14 and {0, 1} == set(running.policy_versions)
    for record in (*siblings, running):
        _check_versions(tiny_qwen3, record.prompt_ids, record.response_ids, record.loss_mask, record.logprobs,
                        record.policy_versions, {0: old, 1: new})
        core.close(record)
    core.flush()
    assert core.pages.num_used == 0 and core.num_reserved_pages == 0


def test_weights_the_programs_do_not_take_are_refused_and_change_nothing(tiny_qwen3):
    params = tiny_qwen3.params
    core = EngineCore(params, tiny_qwen3.config, ENGINE_CONFIG)
    with pytest.raises(ValueError, match=r"leaf \['embed'\] has shape \(255, "):
        core.update_weights({**params, "embed": params["embed"][:-1]}, 1)
    with pytest.raises(ValueError, match=r"lack the leaf \['final_norm'\]"):
        core.update_weights({k: v for k, v in params.items() if k != "final_norm"}, 1)
    with pytest.raises(ValueError, match="not a parameter tree"):
        core.update_weights("weights", 1)
    with pytest.raises(ValueError, match="policy_version must be an int >= 0"):
        core.update_weights(params, -1)
    with pytest.raises(ValueError, match="on_update='drop'"):
        core.update_weights(params, 1, on_update="drop")
    ((record,),) = core.admit([([1, 2, 3], 1, SAMPLED, 6, (0,))])
    core.start(record)
    _drain(core)
    assert record.policy_versions == [0] * 6 and core.policy_version == 0


def test_engine_update_weights_keeps_a_session_paused_on_a_tool(tiny_qwen3):
    old, new = tiny_qwen3.params, _head_only(tiny_qwen3.params)
    prompt, tool = np.random.default_rng(2).integers(0, 256, 9).tolist(), [5, 6, 7]
    engine = Engine(old, tiny_qwen3.config, ENGINE_CONFIG, policy_version=2)

    async def scenario():
        async with engine:
            (session,) = await engine.open(prompt, sampling=SAMPLED, max_tokens=30, seed=3)
            first = await session.generate(max_new_tokens=5)  # paused: a tool runs
            with pytest.raises(ValueError, match="shape"):
                await engine.update_weights({**new, "embed": new["embed"][:, :-1]}, 3)
            await engine.update_weights(new, 3)
            session.append(tool)
            second = await session.generate(max_new_tokens=5)
            session.close()
            return session, first, second

    session, first, second = asyncio.run(scenario())
    assert first.policy_versions == [2] * 5 and second.policy_versions == [3] * 5
    _check_versions(tiny_qwen3, session.prompt_ids, session.response_ids, session.loss_mask, session.logprobs,
                    session.policy_versions, {2: old, 3: new})
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(engine.update_weights(new, 4))
