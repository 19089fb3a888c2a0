"""Engine: parity with transformers, log-prob exactness, pause/resume, seeds, stop rules, no recompilation."""

import asyncio
import dataclasses
import threading

import jax
import numpy as np
import pytest
import torch
from jax._src import monitoring

from rstar2jax import models
from rstar2jax.engine import (
    NO_POLICY_VERSION,
    Engine,
    EngineCore,
    SamplingParams,
    StepLayout,
    generate,
    init_state,
)
from rstar2jax.engine.programs import engine_params
from rstar2jax.engine.step import compile_step
from rstar2jax.models import init_params, layers_are_unstacked
from tests.engine.conftest import ENGINE_CONFIG, teacher_forced

# Lengths inside the first bucket, across buckets, and past the largest (split into two prefill rounds).
PROMPT_LENGTHS = (1, 3, 8, 9, 20, 33)


def _prompts(lengths, seed=0, vocab=256):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def test_greedy_matches_transformers(tiny_qwen3):
    prompts = _prompts(PROMPT_LENGTHS)  # 6 prompts on 4 slots: slots are reused
    results = generate(
        tiny_qwen3.params, tiny_qwen3.config, prompts, max_new_tokens=12, engine_config=ENGINE_CONFIG
    )
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            expected = tiny_qwen3.hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0
            )
        assert result.tokens == expected[0, len(prompt) :].tolist(), f"prompt of {len(prompt)} tokens"
        assert result.finish_reason == "budget"


@pytest.mark.parametrize("unstacked_decode", [True, False])
def test_logprobs_equal_teacher_forced_logprobs(tiny_qwen3, unstacked_decode):
    """Also with the engine's per-layer weight copies (made once, in ``EngineCore``) against the stacked
    weights the trainer's forward uses."""
    engine_config = dataclasses.replace(ENGINE_CONFIG, unstacked_decode=unstacked_decode)
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, engine_config)
    assert layers_are_unstacked(core.params) == unstacked_decode
    prompts = _prompts((4, 11, 30), seed=1)
    results = generate(
        tiny_qwen3.params,
        tiny_qwen3.config,
        prompts,
        max_new_tokens=16,
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        seed=3,
        engine_config=engine_config,
        policy_version=2,
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.policy_versions == [2] * len(result.tokens)
        logprobs = teacher_forced(tiny_qwen3.params, tiny_qwen3.config, prompt + result.tokens)
        # Raw policy log-probs (temperature 1, untruncated) of each sampled token.
        expected = logprobs[np.arange(len(prompt) - 1, len(prompt) + 15), result.tokens]
        np.testing.assert_allclose(result.logprobs, expected, rtol=0, atol=1e-5)


def test_seeded_sampling_is_reproducible(tiny_qwen3):
    prompts = _prompts((5, 7), seed=2)
    run = lambda seed: [
        r.tokens
        for r in generate(
            tiny_qwen3.params,
            tiny_qwen3.config,
            prompts,
            max_new_tokens=16,
            temperature=1.0,
            seed=seed,
            engine_config=ENGINE_CONFIG,
        )
    ]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_pause_resume_equals_one_go(tiny_qwen3):
    prompt, tool = _prompts((7, 5), seed=5)
    sampling = SamplingParams(temperature=1.0)

    async def scenario():
        async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG, policy_version=7) as engine:
            (free_run,) = await engine.open(prompt, sampling=sampling, max_tokens=40, seed=11)
            reference = (await free_run.generate(max_new_tokens=12)).tokens
            # Stop on the first pair of sampled tokens not seen earlier in the segment (a 2-token stop).
            end = next(
                i
                for i in range(3, 12)
                if (reference[i - 1], reference[i])
                not in set(zip(reference[: i - 1], reference[1:i], strict=True))
            )
            stop = reference[end - 1 : end + 1]

            (paused,) = await engine.open(prompt, sampling=sampling, max_tokens=40, seed=11)
            first = await paused.generate(stop=[stop, [255, 255, 255]])
            assert (first.tokens, first.finish_reason) == (reference[: end + 1], "stop")
            paused.append(tool)
            second = await paused.generate(max_new_tokens=8)
            assert second.finish_reason == "length" and len(second.tokens) == 8

            (one_go,) = await engine.open(
                prompt + first.tokens + tool, sampling=sampling, max_tokens=20, seed=11
            )
            assert (await one_go.generate(max_new_tokens=8)).tokens == second.tokens

            assert paused.response_ids == first.tokens + tool + second.tokens
            assert paused.loss_mask == [1] * len(first.tokens) + [0] * len(tool) + [1] * 8
            assert paused.logprobs[len(first.tokens) : len(first.tokens) + len(tool)] == [0.0] * len(tool)
            # Every sampled token carries the engine's policy version, appended ones NO_POLICY_VERSION.
            assert first.policy_versions == [7] * len(first.tokens) and second.policy_versions == [7] * 8
            inserted = [NO_POLICY_VERSION] * len(tool)
            assert paused.policy_versions == [7] * len(first.tokens) + inserted + [7] * 8
            for session in (free_run, paused, one_go):
                session.close()

    asyncio.run(scenario())


def test_concurrent_tool_sessions_stay_consistent(tiny_qwen3):
    """Groups larger than the free slots wait; sessions pause for tools of different latencies while others
    decode; every sampled token is the greedy choice of a full forward over the final record."""
    prompts = _prompts((3, 9, 14), seed=6)
    tool_outputs = _prompts((2, 6, 3), seed=7)
    records = []

    async def rollout(session, turn_lengths, delays):
        for turn, (length, delay) in enumerate(zip(turn_lengths, delays, strict=True)):
            segment = await session.generate(max_new_tokens=length)
            assert len(segment.tokens) == length
            await asyncio.sleep(delay)
            session.append(tool_outputs[turn])
        last = await session.generate(max_new_tokens=4)
        records.append((session.prompt_ids, session.response_ids, session.loss_mask, session.logprobs))
        assert last.finish_reason == "length"
        session.close()

    async def group(prompt, n, index):
        sessions = await engine_ref[0].open(
            prompt, n=n, sampling=SamplingParams(temperature=0.0), max_tokens=40
        )
        await asyncio.gather(
            *[rollout(s, (3 + j, 5), (0.01 * (index + j), 0.0)) for j, s in enumerate(sessions)]
        )

    engine_ref = []

    async def scenario():
        async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            engine_ref.append(engine)
            await asyncio.gather(group(prompts[0], 3, 0), group(prompts[1], 2, 1), group(prompts[2], 4, 2))

    asyncio.run(scenario())
    assert len(records) == 9
    for prompt, response, loss_mask, logprobs in records:
        reference = teacher_forced(tiny_qwen3.params, tiny_qwen3.config, prompt + response)
        sampled = np.flatnonzero(loss_mask)
        assert len(sampled) == len(response) - 8  # 2 + 6 tool tokens inserted
        positions = len(prompt) + sampled - 1
        np.testing.assert_array_equal(np.asarray(response)[sampled], reference[positions].argmax(-1))
        np.testing.assert_allclose(
            np.asarray(logprobs)[sampled], reference[positions, np.asarray(response)[sampled]], atol=1e-5
        )


def test_eos_and_budget_finish_sessions(tiny_qwen3):
    (prompt,) = _prompts((6,), seed=8)
    (greedy,) = generate(
        tiny_qwen3.params, tiny_qwen3.config, [prompt], max_new_tokens=10, engine_config=ENGINE_CONFIG
    )
    eos_at = next(i for i in range(2, 10) if greedy.tokens[i] not in greedy.tokens[:i])
    eos_config = dataclasses.replace(ENGINE_CONFIG, eos_token_ids=(greedy.tokens[eos_at],))
    (stopped,) = generate(
        tiny_qwen3.params, tiny_qwen3.config, [prompt], max_new_tokens=10, engine_config=eos_config
    )
    assert (stopped.tokens, stopped.finish_reason) == (greedy.tokens[: eos_at + 1], "eos")

    async def scenario():
        async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            (session,) = await engine.open(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=9)
            await session.generate(max_new_tokens=4)
            with pytest.raises(ValueError, match="remain in the budget"):
                session.append([1] * 6)
            session.append([1] * 5)  # fills the budget exactly
            last = await session.generate()
            assert (last.tokens, last.finish_reason, session.done, session.remaining) == (
                [],
                "budget",
                True,
                0,
            )
            with pytest.raises(RuntimeError, match="done"):
                await session.generate()

    asyncio.run(scenario())


def test_bad_requests_are_rejected(tiny_qwen3):
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG)
    with pytest.raises(ValueError, match="exceeds the slot capacity"):
        core.check_request([1] * 60, 1, 10)
    with pytest.raises(ValueError, match="num_slots"):
        core.check_request([1], 5, 10)
    with pytest.raises(ValueError, match="at most 4"):
        core.stop_table([[1]] * 5)
    with pytest.raises(ValueError, match="stop sequence"):
        core.stop_table([list(range(9))])
    with pytest.raises(ValueError, match="vocab_size"):
        core.check_request([256], 1, 10)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="policy_version must be an int >= 0"):
        EngineCore(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG, policy_version=-1)


def test_a_mixed_workload_compiles_one_program_per_bucket_and_nothing_after_warmup(tiny_qwen3):
    """Prompts of many lengths (chunked prefill), groups (forks), tool appends, stops and sampling settings
    run on the programs warm-up compiled: one per token bucket, whatever the slot count and lengths."""
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG)
    core.warmup()
    compiles = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs.get("fun_name"))

    monitoring.register_event_duration_secs_listener(count)
    try:
        for lengths, budget, temperature, stop in (
            ((2, 5, 7), 9, 0.0, None),
            ((3, 20, 30, 6, 1), 17, 0.7, [[3]]),
            ((8, 40), 23, 1.3, [[5, 6], [7]]),
        ):
            generate(tiny_qwen3.params, tiny_qwen3.config, _prompts(lengths, seed=budget),
                     max_new_tokens=budget, temperature=temperature, top_p=0.8, top_k=7, stop=stop,
                     engine_config=ENGINE_CONFIG)

        async def scenario():
            async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
                sessions = await engine.open([4, 5, 6], n=3, max_tokens=30)
                for session in sessions:
                    await session.generate(stop=[[9, 9]], max_new_tokens=5)
                    session.append([1, 2, 3])
                    await session.generate(max_new_tokens=3)
                    session.close()

        asyncio.run(scenario())
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert compiles == []
    assert len(ENGINE_CONFIG.token_buckets) == 2


def test_two_engines_one_after_the_other_in_one_process(tiny_qwen3):
    """A second engine, opened on a fresh event loop after the first has closed, in the same process (so on
    the process's compiled programs), samples what the first did and what transformers does; no thread that
    compiled a program ahead outlives its compile."""
    prompts = _prompts((3, 9, 20), seed=4)
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = tiny_qwen3.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                               do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())
    greedy = SamplingParams(temperature=0.0)

    async def run():
        async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            sessions = [(await engine.open(prompt, sampling=greedy, max_tokens=8))[0] for prompt in prompts]
            segments = await asyncio.gather(*(session.generate() for session in sessions))
        return [segment.tokens for segment in segments]

    assert asyncio.run(run()) == expected
    assert asyncio.run(run()) == expected
    compiling = [thread for thread in threading.enumerate() if thread.name == "rstar2jax-compile"]
    for thread in compiling:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in compiling)


@pytest.mark.parametrize("unstacked", [True, False])
def test_decode_updates_the_pages_in_place(unstacked):
    """The step writes the donated, layer-stacked page pool in place and reads only gathered blocks of it
    (scanned or unrolled layers): its compiled program needs scratch memory under half the pool (a copy of
    the pool, or of a layer's slice of it, per layer or step would need more)."""
    config = models.preset("tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=4,
                           head_dim=8, tie_word_embeddings=False)
    engine_config = ENGINE_CONFIG.__class__(num_slots=8, max_len=512, unstacked_decode=unstacked)
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    params = jax.eval_shape(lambda p: engine_params(p, config, unstacked), params)
    state = jax.eval_shape(lambda: init_state(config, engine_config))
    memory = compile_step(state, params, StepLayout.of(engine_config, 16), True).memory_analysis()
    pool_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(state.pages))
    assert memory.alias_size_in_bytes >= pool_bytes  # the state is donated and its pool aliased
    assert memory.temp_size_in_bytes < pool_bytes / 2


def test_prefill_attention_memory_is_blocked_not_quadratic():
    """A 1024-token prefill chunk attends tile by tile and block by block over the pages: its scratch memory
    stays well under the [chunk, chunk] score matrix a dense prefill would build."""
    config = models.preset("tiny", vocab_size=128, hidden_size=32, intermediate_size=64, head_dim=8,
                           tie_word_embeddings=False)
    engine_config = ENGINE_CONFIG.__class__(num_slots=1, max_len=2048, attention_block=128,
                                            token_buckets=(1024,))
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    state = jax.eval_shape(lambda: init_state(config, engine_config))
    memory = compile_step(state, params, StepLayout.of(engine_config, 1024), True).memory_analysis()
    dense_scores = 1024 * 1024 * config.num_heads * 4
    assert memory.temp_size_in_bytes < dense_scores / 2


def test_tokens_appended_before_a_groups_first_segment(tiny_qwen3):
    """Sessions of a group that append tokens before their first ``generate`` (its source and a sibling,
    before the group is forked) sample from prompt + appended tokens, the others from the prompt."""
    prompt, extra = _prompts((13, 4), seed=9)

    async def scenario():
        async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            sessions = await engine.open(prompt, n=3, sampling=SamplingParams(temperature=0.0), max_tokens=20)
            sessions[0].append(extra)
            sessions[2].append(extra)
            await asyncio.gather(*(s.generate(max_new_tokens=6) for s in sessions))
            return sessions

    sessions = asyncio.run(scenario())
    assert [len(s.response_ids) for s in sessions] == [10, 6, 10]
    for session in sessions:
        response = np.asarray(session.response_ids)
        stream = session.prompt_ids + session.response_ids
        reference = teacher_forced(tiny_qwen3.params, tiny_qwen3.config, stream)
        sampled = np.flatnonzero(session.loss_mask)
        positions = len(prompt) + sampled - 1
        np.testing.assert_array_equal(response[sampled], reference[positions].argmax(-1))
        np.testing.assert_allclose(np.asarray(session.logprobs)[sampled],
                                   reference[positions, response[sampled]], atol=1e-5)
