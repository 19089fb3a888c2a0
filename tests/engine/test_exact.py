"""Exact numerics (issue 52, ``ModelConfig.numerics="exact"``): every sampled token's engine log-prob equals
the trainer's bit for bit, in float32 and bfloat16, over random batch mixes, slot counts and trainer packings,
multi-turn sessions with tool outputs, forks and shared prompt pages; the run config's switch reaches the
model and keeps pi_old the sampler's (no recompute pass, no TIS)."""

import asyncio
import dataclasses
import pathlib
import re

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.configs import tiny_cpu
from rstar2jax import models
from rstar2jax.engine import Engine, EngineConfig, SamplingParams, generate
from rstar2jax.train import ConfigError, parse
from tests.train.scripted import set_fields

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "exact_numerics.md"
ROW = 192  # the trainer's packed row width: one compiled forward for every example
EXACT_ENGINE = EngineConfig(num_slots=4, max_len=64, decode_chunk=4, token_buckets=(4, 16), prefill_tile=8,
                            page_size=8, eos_token_ids=(), prefix_sharing=True, poison_freed_pages=True)


def _exact(tiny, dtype: str):
    return dataclasses.replace(tiny.config, compute_dtype=dtype, numerics="exact")


def _trainer_logprobs(params, config, sequences, rows: int) -> list[np.ndarray]:
    """The trainer's log-probs (``models.sequence_logprobs``, as the RL step computes them) of each sequence's
    tokens after its first, the sequences packed in turn into ``rows`` rows of ``ROW`` tokens."""
    tokens, targets, positions, segments = (np.zeros((rows, ROW), np.int32) for _ in range(4))
    fill, where = [0] * rows, []
    for i, seq in enumerate(sequences):
        row, n = i % rows, len(seq) - 1
        start = fill[row]
        assert start + n <= ROW
        tokens[row, start:start + n], targets[row, start:start + n] = seq[:-1], seq[1:]
        positions[row, start:start + n], segments[row, start:start + n] = np.arange(n), i + 1
        where.append((row, start, n))
        fill[row] += n
    logp, _ = models.sequence_logprobs(params, config, *map(jnp.asarray, (tokens, targets)),
                                      positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments))
    logp = np.asarray(logp)
    return [logp[row, start:start + n] for row, start, n in where]


@hypothesis.settings(max_examples=3, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(st.data())
def test_engine_logprobs_are_the_trainers_bit_for_bit(tiny_qwen3, data):
    """Random prompts (count, lengths), slot count, trainer packing and dtype: sampled at temperature 1, each
    token's engine log-prob is the trainer's exactly; the tokens do not depend on the slot count."""
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    config = _exact(tiny_qwen3, dtype)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    prompts = [rng.integers(0, 256, n).tolist() for n in rng.integers(2, 30, data.draw(st.integers(1, 5)))]
    slots = data.draw(st.sampled_from([1, 4]))
    engine = dataclasses.replace(EXACT_ENGINE, num_slots=slots, token_buckets=(slots, 16))
    gens = generate(tiny_qwen3.params, config, prompts, max_new_tokens=10, temperature=1.0,
                    engine_config=engine, seed=7)
    sequences = [p + g.tokens for p, g in zip(prompts, gens, strict=True)]
    trainer = _trainer_logprobs(tiny_qwen3.params, config, sequences, rows=data.draw(st.integers(1, 3)))
    for prompt, gen, logp in zip(prompts, gens, trainer, strict=True):
        np.testing.assert_array_equal(np.asarray(gen.logprobs, np.float32), logp[len(prompt) - 1:])
    other = dataclasses.replace(EXACT_ENGINE, num_slots=2, token_buckets=(2, 16))
    again = generate(tiny_qwen3.params, config, prompts, max_new_tokens=10, temperature=1.0,
                     engine_config=other, seed=7)
    assert [g.tokens for g in again] == [g.tokens for g in gens]
    assert [g.logprobs for g in again] == [g.logprobs for g in gens]


def test_multi_turn_forks_and_shared_prompts_are_exact(tiny_qwen3):
    """Groups sharing a prompt prefix (the prefix cache) fork, sample, take tool outputs and sample again, in
    parallel, in bfloat16: every sampled token's log-prob is the trainer's bit for bit over the whole
    conversation."""
    config = _exact(tiny_qwen3, "bfloat16")
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 17).tolist()
    prompts = [shared + rng.integers(0, 256, n).tolist() for n in (3, 9)] + [rng.integers(0, 256, 5).tolist()]
    records = []

    async def rollout(session, j):
        await session.generate(max_new_tokens=3 + j)
        session.append(rng.integers(0, 256, 4).tolist())  # a tool output
        await session.generate(max_new_tokens=4)
        records.append((session.prompt_ids, session.response_ids, session.loss_mask, session.logprobs))
        session.close()

    async def group(engine, prompt):  # opened and run together: 6 sessions share 4 slots
        sessions = await engine.open(prompt, n=2, sampling=SamplingParams(temperature=1.0), max_tokens=24)
        await asyncio.gather(*[rollout(s, j) for j, s in enumerate(sessions)])

    async def scenario():
        async with Engine(tiny_qwen3.params, config, EXACT_ENGINE) as engine:
            await asyncio.gather(*[group(engine, p) for p in prompts])

    asyncio.run(scenario())
    assert len(records) == 6
    sequences = [list(prompt) + list(response) for prompt, response, _, _ in records]
    trainer = _trainer_logprobs(tiny_qwen3.params, config, sequences, rows=2)
    for (prompt, _, mask, logprobs), logp in zip(records, trainer, strict=True):
        sampled = np.flatnonzero(mask)
        np.testing.assert_array_equal(np.asarray(logprobs, np.float32)[sampled],
                                      logp[len(prompt) - 1 + sampled])


def test_run_config_switch_reaches_the_model_and_keeps_pi_old_the_samplers():
    """``rollout.numerics='exact'``: the policy's model (the engine's and the trainer's) computes exactly,
    'auto' pi_old is the sampler's (no recompute pass) without TIS; with an FP8 rollout a ConfigError."""
    config = tiny_cpu.get_config()
    default, exact = parse(config), parse(set_fields(config, {"rollout.numerics": "exact"}))
    assert (default.policy.model.numerics, exact.policy.model.numerics) == ("default", "exact")
    assert (exact.rl.loss.old_logprobs, exact.rl.loss.rollout_is_cap) == ("sampler", None)
    with pytest.raises(ConfigError, match="rollout.numerics='exact'.*kv_dtype='fp8'"):
        parse(set_fields(config, {"rollout.numerics": "exact", "rollout.kv_dtype": "fp8"}))
    with pytest.raises(ValueError, match="numerics='fast'"):
        dataclasses.replace(default.policy.model, numerics="fast")


def test_the_guide_runs():
    """docs/exact_numerics.md: its Python block (an engine's log-probs against the trainer's) runs."""
    (block,) = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.DOTALL)
    exec(compile(block, str(GUIDE), "exec"), {})  # noqa: S102 (the guide's own code)
