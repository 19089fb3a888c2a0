"""The ``n`` siblings of one seeded request draw from distinct random streams: on a flat distribution they
differ, a seed reproduces them, and each sibling alone (its stream seed, ``engine.sibling_seed``) samples
exactly what it samples beside its siblings, wherever it lands in the slots."""

import asyncio

import jax
import jax.numpy as jnp
import pytest

from rstar2jax.engine import Engine, SamplingParams, sibling_seed
from tests.engine.conftest import ENGINE_CONFIG

PROMPT = [3, 17, 42, 8, 99]
TOKENS = 10
SAMPLING = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def flat_params(tiny_qwen3):
    """The tiny model with its final norm scaled to almost zero: logits near 0, every token about as likely
    (1/256), so siblings that shared a stream could not differ by chance of a peaked distribution."""
    return {**tiny_qwen3.params, "final_norm": tiny_qwen3.params["final_norm"] * 1e-3}


async def _tokens(engine, n, **seeds) -> list[list[int]]:
    sessions = await engine.open(PROMPT, n, sampling=SAMPLING, max_tokens=TOKENS, **seeds)
    segments = await asyncio.gather(*(s.generate() for s in sessions))
    for s in sessions:
        s.close()
    return [segment.tokens for segment in segments]


def test_the_test_distribution_is_flat(tiny_qwen3, flat_params):
    from rstar2jax import models

    logits, _ = models.forward(flat_params, tiny_qwen3.config, jnp.asarray([PROMPT]))
    probs = jax.nn.softmax(logits[0, -1])
    assert float(probs.max()) < 2.0 / tiny_qwen3.config.vocab_size


def test_siblings_draw_from_distinct_reproducible_streams(tiny_qwen3, flat_params):
    async def run():
        async with Engine(flat_params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            first = await _tokens(engine, 4, seed=7)
            again = await _tokens(engine, 4, seed=7)
            other = await _tokens(engine, 4, seed=8)
            # Each sibling alone, with its stream seed, in another slot than in its group (a group of 2
            # holds the first slots meanwhile).
            holders = await engine.open(PROMPT, 2, sampling=SAMPLING, max_tokens=TOKENS, seed=99)
            alone = [(await _tokens(engine, 1, stream_seeds=[sibling_seed(7, j)]))[0] for j in range(4)]
            for s in holders:
                s.close()
        return first, again, other, alone

    first, again, other, alone = asyncio.run(run())
    assert all(len(t) == TOKENS for t in first)
    assert len({tuple(t) for t in first}) == 4  # pairwise distinct
    assert again == first
    assert other != first and not {tuple(t) for t in other} & {tuple(t) for t in first}
    assert alone == first


def test_a_sibling_seed_names_the_stream_of_a_request_alone(tiny_qwen3, flat_params):
    """``seed=s`` with ``n=1`` is sibling 0's stream; distinct seeds give distinct streams."""
    async def run():
        async with Engine(flat_params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            by_seed = await _tokens(engine, 1, seed=5)
            by_stream = await _tokens(engine, 1, stream_seeds=[sibling_seed(5, 0)])
        return by_seed, by_stream

    by_seed, by_stream = asyncio.run(run())
    assert by_seed == by_stream
    assert len({sibling_seed(s, j) for s in range(50) for j in range(8)}) == 400


@pytest.mark.parametrize(
    "seeds, message",
    [
        (dict(stream_seeds=[1, 2]), "2 stream seeds for a group of 3"),
        (dict(seed=1, stream_seeds=[1, 2, 3]), "seed or stream_seeds, not both"),
        (dict(stream_seeds=[1, 2, -1]), r"stream seed must be an int in \[0, 2\*\*32\)"),
        (dict(stream_seeds=[1, 2, 2**32]), r"stream seed must be an int in \[0, 2\*\*32\)"),
        (dict(stream_seeds=[1, 2, 0.5]), "stream seed must be an int"),
    ],
)
def test_bad_stream_seeds_are_refused_before_any_slot_is_taken(tiny_qwen3, seeds, message):
    async def run():
        async with Engine(tiny_qwen3.params, tiny_qwen3.config, ENGINE_CONFIG) as engine:
            with pytest.raises(ValueError, match=message):
                await engine.open(PROMPT, 3, sampling=SAMPLING, max_tokens=TOKENS, **seeds)
            return engine.core.num_free_slots

    assert asyncio.run(run()) == ENGINE_CONFIG.num_slots
