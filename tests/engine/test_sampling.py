"""Sampling: first_argmax against jnp.argmax, top-k / top-p thresholds (bisection and candidate list) against
a sort-based reference, every draw against the reference definition (Gumbel noise over the whole vocabulary,
kept set from a sort), draw frequencies against the reference probabilities, log-probs and entropies, greedy
rows."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax.engine import EngineCore, SamplingParams
from rstar2jax.engine.sampling import (
    CANDIDATES,
    candidates,
    first_argmax,
    gumbel_at,
    indexed_noise_matches,
    sample_tokens,
    sample_with_logprobs,
    truncation_mask,
)
from tests.engine.conftest import ENGINE_CONFIG


def _sortable(x: np.ndarray) -> np.ndarray:
    """The order of float32 values with -0.0 just below +0.0 (as the library's sortable_bits), as int64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.int64)
    return np.where(bits >= 2**31, 2**32 - 1 - bits, bits + 2**31)


def _reference_mask(logits: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """transformers' order by a full sort: keep the top-k (ties at the k-th value too), then the smallest
    prefix of them (by probability, ties at its last value too) whose mass, renormalised over the top-k,
    reaches top_p."""
    vocab = len(logits)
    keys = _sortable(logits)
    order = np.argsort(-keys, kind="stable")
    ranked = keys[order]
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    in_top_k = keys >= ranked[k - 1]
    if top_p >= 1:
        return in_top_k
    probs = np.where(in_top_k, np.exp(logits.astype(np.float64) - logits.max()), 0.0)
    cumulative = np.cumsum(probs[order] / probs.sum())
    mass = cumulative[np.searchsorted(-ranked, -ranked, side="right") - 1]  # at the end of each tie group
    reach = np.flatnonzero(mass >= top_p)
    last = reach[0] if len(reach) else vocab - 1
    return keys >= max(ranked[k - 1], ranked[last])


@pytest.mark.parametrize("shape", [(3, 32000), (2, 5, 300), (97,), (4, 128)])
def test_first_argmax_equals_argmax(shape):
    """Ties (the first maximum wins, wherever it lies against the block boundaries), rows of -inf, sizes
    that need padding to whole blocks, leading dimensions of any rank."""
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(size=shape).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0, [shape[-1] - 1, 3, shape[-1] // 2]] = 10.0  # a three-way tie: index 3 first
    if len(flat) > 1:
        flat[1] = -np.inf
    if len(flat) > 2:
        flat[2, rng.integers(0, shape[-1], 40)] = flat[2].max()  # many ties with the maximum
    x = flat.reshape(shape)
    got = jax.jit(first_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    half = jnp.asarray(x, jnp.bfloat16)  # rounding makes more ties
    np.testing.assert_array_equal(first_argmax(half), jnp.argmax(half, axis=-1))


def test_truncation_mask_matches_sorting():
    rng = np.random.default_rng(0)
    rows, params = [], []
    for _ in range(64):
        vocab = 97
        rows.append((rng.normal(size=vocab) * rng.uniform(0.2, 4.0)).astype(np.float32))
        top_p, top_k = rng.choice([1.0, rng.uniform(0.05, 0.99)]), rng.choice([0, rng.integers(1, 99)])
        params.append((float(top_p), int(top_k)))
    top_p = jnp.array([p for p, _ in params], jnp.float32)
    top_k = jnp.array([k for _, k in params], jnp.int32)
    mask = np.asarray(jax.jit(truncation_mask)(jnp.asarray(np.stack(rows)), top_p, top_k))
    for row, (p, k), got in zip(rows, params, mask, strict=True):
        np.testing.assert_array_equal(got, _reference_mask(row, p, k), err_msg=f"top_p={p} top_k={k}")


def test_truncation_handles_ties_and_extreme_logits():
    logits = jnp.array([[3.0, 3.0, 1.0, -jnp.inf, -1e30, 0.0]], jnp.float32)
    # top_k=1 keeps both tied maxima; so does a tiny top_p; top_k=4 keeps the four largest.
    assert truncation_mask(logits, jnp.array([1.0]), jnp.array([1]))[0].tolist() == [1, 1, 0, 0, 0, 0]
    assert truncation_mask(logits, jnp.array([1e-3]), jnp.array([0]))[0].tolist() == [1, 1, 0, 0, 0, 0]
    assert truncation_mask(logits, jnp.array([1.0]), jnp.array([4]))[0].tolist() == [1, 1, 1, 0, 0, 1]


_sample_many = jax.jit(jax.vmap(sample_tokens, in_axes=(None, 0, None, None, None)))


def _draw(logits, temperature, top_p, top_k, num_draws=400, seed=0):
    """num_draws tokens per row, each with its own key."""
    rows = logits.shape[0]
    keys = jax.random.split(jax.random.key(seed), num_draws * rows).reshape(num_draws, rows)
    full = lambda x, dtype: jnp.full((rows,), x, dtype)
    return np.asarray(_sample_many(logits, keys, full(temperature, jnp.float32), full(top_p, jnp.float32),
                                   full(top_k, jnp.int32)))


@pytest.fixture(scope="module")
def logits():
    return jnp.asarray(np.random.default_rng(1).normal(size=(2, 40)).astype(np.float32) * 2.0)


def test_top_k_and_top_p_respected(logits):
    draws = _draw(logits, 1.0, 1.0, 5)
    for row in range(2):
        top5 = set(np.argsort(-np.asarray(logits[row]))[:5].tolist())
        assert set(draws[:, row].tolist()) <= top5
        assert len(set(draws[:, row].tolist())) > 1
    draws = _draw(logits, 1.0, 0.6, 0)
    for row in range(2):
        kept = set(np.flatnonzero(_reference_mask(np.asarray(logits[row]), 0.6, 0)).tolist())
        assert set(draws[:, row].tolist()) <= kept


def test_draws_follow_the_tempered_distribution(logits):
    temperature, num_draws = 1.5, 20000
    draws = _draw(logits, temperature, 1.0, 0, num_draws)
    probs = np.asarray(jax.nn.softmax(logits / temperature, axis=-1))
    for row in range(2):
        freq = np.bincount(draws[:, row], minlength=logits.shape[1]) / num_draws
        assert np.abs(freq - probs[row]).max() < 4 * np.sqrt(probs[row].max() / num_draws) + 1e-3


def test_greedy_rows_and_seeds(logits):
    greedy = _draw(logits, 0.0, 0.5, 3)
    np.testing.assert_array_equal(greedy, np.broadcast_to(np.argmax(logits, -1), greedy.shape))
    np.testing.assert_array_equal(_draw(logits, 1.0, 1.0, 0, seed=3), _draw(logits, 1.0, 1.0, 0, seed=3))
    assert (_draw(logits, 1.0, 1.0, 0, seed=3) != _draw(logits, 1.0, 1.0, 0, seed=4)).any()


def test_bad_shapes_are_rejected(logits):
    with pytest.raises(ValueError, match="temperature must have shape"):
        keys = jax.random.split(jax.random.key(0), 2)
        sample_tokens(logits, keys, jnp.zeros(3), jnp.ones(2), jnp.zeros(2, int))


# ---- the candidate list, draws against the reference definition, frequencies, log-probs


def _random_rows(rng, rows, vocab):
    """Logits of many spreads, some rounded to a coarse grid (ties, at the list's end too), some with -inf,
    -0.0 and +0.0; settings whose kept sets fit the list or not."""
    logits = []
    for i in range(rows):
        row = rng.normal(size=vocab) * rng.choice([0.3, 1.0, 4.0, 12.0])
        if i % 3 == 0:
            row = np.round(row * 2) / 2
        if i % 5 == 0:
            row[rng.integers(0, vocab, 7)] = -np.inf
            row[rng.integers(0, vocab, 3)] = 0.0
            row[rng.integers(0, vocab, 3)] = -0.0
        logits.append(row.astype(np.float32))
    top_p = rng.choice([1.0, 0.05, 0.3, 0.7, 0.9, 0.99, 0.9999], rows).astype(np.float32)
    top_k = rng.choice([0, 1, 2, 7, 50, CANDIDATES - 1, CANDIDATES, 300, vocab], rows).astype(np.int32)
    return np.stack(logits), top_p, top_k


def test_candidate_list_keeps_the_reference_support():
    """Where a row's kept set fits its list, it is the sorted reference's (ties at the top-k value, the top-p
    threshold and the list's end included); the bisection's mask is too, for every row."""
    rng = np.random.default_rng(7)
    logits, top_p, top_k = _random_rows(rng, 160, 600)
    args = jnp.asarray(logits), jnp.asarray(top_p), jnp.asarray(top_k)
    got = jax.jit(candidates)(*args)
    bisected = np.asarray(jax.jit(truncation_mask)(*args))
    fits = np.asarray(got.fits)
    truncates = (top_p < 1) | ((top_k > 0) & (top_k < logits.shape[1]))
    assert not fits[~truncates].any()
    assert 40 < fits.sum() < truncates.sum()  # both paths are exercised
    for b in range(len(logits)):
        reference = _reference_mask(logits[b], float(top_p[b]), int(top_k[b]))
        np.testing.assert_array_equal(bisected[b], reference, err_msg=f"row {b}")
        if fits[b]:
            mask = np.zeros(logits.shape[1], bool)
            mask[np.asarray(got.index[b])[np.asarray(got.kept[b])]] = True
            np.testing.assert_array_equal(mask, reference, err_msg=f"row {b}: p={top_p[b]} k={top_k[b]}")


def test_candidate_list_with_signed_zeros_at_its_end():
    """-0.0 sorts just below +0.0 (whichever order lax.top_k lists them in): a top-k threshold at +0.0 keeps
    both +0.0 entries and not -0.0, and with zeros at the list's end the list cannot decide it (the row falls
    back); a threshold above them it can."""
    big = CANDIDATES - 2
    row = np.concatenate([np.linspace(5.0, 1.0, big), [0.0, -0.0, 0.0, -1.0, -1.0]]).astype(np.float32)
    for top_k, fits in ((big + 1, False), (big, True)):
        got = candidates(jnp.asarray(row[None]), jnp.ones(1), jnp.array([top_k]))
        assert bool(got.fits[0]) == fits
        if fits:
            mask = np.zeros(len(row), bool)
            mask[np.asarray(got.index[0])[np.asarray(got.kept[0])]] = True
            np.testing.assert_array_equal(mask, _reference_mask(row, 1.0, top_k))
    assert _reference_mask(row, 1.0, big + 1).tolist() == [True] * (big + 1) + [False, True, False, False]


def test_indexed_noise_is_jax_random_gumbel():
    keys = jax.random.split(jax.random.key(3), 3)
    assert indexed_noise_matches(keys)
    index = jnp.asarray(np.random.default_rng(0).integers(0, 151936, (3, 50)))
    full = jax.vmap(lambda key: jax.random.gumbel(key, (151936,)))(keys)
    np.testing.assert_array_equal(gumbel_at(keys, index), jnp.take_along_axis(full, index, axis=-1))


def test_draws_are_the_reference_definitions():
    """Every path (greedy, candidate list, full noise with and without the bisection) gives the token of
    argmax(logits / T + jax.random.gumbel(key, (V,))) over the sorted reference's kept set."""
    rng = np.random.default_rng(11)
    logits, top_p, top_k = _random_rows(rng, 96, 600)
    temperature = rng.choice([0.0, 0.4, 1.0, 2.5], len(logits)).astype(np.float32)
    draw = jax.jit(sample_tokens)
    for seed in range(6):
        keys = jax.random.split(jax.random.key(seed), len(logits))
        got = np.asarray(draw(jnp.asarray(logits), keys, jnp.asarray(temperature), jnp.asarray(top_p),
                              jnp.asarray(top_k)))
        noise = np.asarray(jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[1],)))(keys))
        for b in range(len(logits)):
            if temperature[b] == 0:
                expected = np.argmax(logits[b])
            else:
                scaled = np.asarray(jnp.asarray(logits[b]) / temperature[b])
                kept = _reference_mask(scaled, float(top_p[b]), int(top_k[b]))
                expected = np.argmax(np.where(kept, scaled + noise[b], -np.inf))
            assert got[b] == expected, f"seed {seed} row {b}: T={temperature[b]} p={top_p[b]} k={top_k[b]}"


@pytest.mark.parametrize("top_p,top_k,temperature",
                         [(1.0, 6, 1.0), (0.8, 0, 0.7), (0.97, 0, 1.3), (0.9, 90, 1.0)])
def test_truncated_draws_follow_the_reference_probabilities(top_p, top_k, temperature):
    """Frequencies of many seeded draws against the reference: softmax(logits / T) renormalised over the
    sorted reference's kept set (top-p at 0.97 keeps more tokens than the list holds: the full search)."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(1, 400)).astype(np.float32) * 1.5)
    num_draws = 6000
    draws = _draw(logits, temperature, top_p, top_k, num_draws)[:, 0]
    scaled = np.asarray(logits[0]) / temperature
    kept = _reference_mask(scaled, top_p, top_k)
    if top_p == 0.97:
        assert kept.sum() >= CANDIDATES
    probs = np.where(kept, np.exp(scaled - scaled.max()), 0.0)
    probs /= probs.sum()
    assert set(draws.tolist()) <= set(np.flatnonzero(kept).tolist())
    freq = np.bincount(draws, minlength=400) / num_draws
    assert np.abs(freq - probs).max() < 4 * np.sqrt(probs.max() / num_draws) + 1e-3


def test_logprobs_and_entropies():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(5, 300)).astype(np.float32) * 3
    logits[1, :40] = -np.inf  # masked tokens add nothing to the entropy
    keys = jax.random.split(jax.random.key(0), 5)
    temperature = jnp.array([0.0, 1.0, 0.5, 1.0, 2.0])
    top_p, top_k = jnp.array([1.0, 0.9, 1.0, 1.0, 0.5]), jnp.array([0, 0, 10, 0, 0])
    got = jax.jit(sample_with_logprobs)(jnp.asarray(logits), keys, temperature, top_p, top_k)
    tokens = np.asarray(got.tokens)
    again = jax.jit(sample_tokens)(jnp.asarray(logits), keys, temperature, top_p, top_k)
    np.testing.assert_array_equal(tokens, again)
    wide = logits.astype(np.float64)
    shifted = wide - wide.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))
    np.testing.assert_allclose(got.logprobs, log_probs[np.arange(5), tokens], rtol=1e-5, atol=1e-5)
    probs = np.exp(log_probs)
    entropy = -np.sum(probs * np.where(probs > 0, log_probs, 0.0), axis=-1)
    np.testing.assert_allclose(got.entropies, entropy, rtol=1e-5, atol=1e-5)


# ---- the greedy-only step program


def _run_core(core: EngineCore, requests):
    """Run ``requests`` (prompt, temperature) to their 6-token budgets; returns each one's tokens."""
    records = []
    for i, (prompt, temperature) in enumerate(requests):
        ((record,),) = core.admit([(prompt, 1, SamplingParams(temperature=temperature), 6, (0, i))])
        core.start(record)
        records.append(record)
    while core.num_active:
        for record, chunk in core.step():
            record.receive(chunk)
    return [record.response_ids for record in records]


def test_greedy_steps_run_the_greedy_program_with_the_same_tokens(tiny_qwen3):
    """While no sequence samples, an engine runs each bucket's greedy-only program (unless the general one
    is compiled already, e.g. by warm-up); both give the same tokens. A sampling sequence uses the general
    one."""
    config = dataclasses.replace(ENGINE_CONFIG, decode_chunk=3)  # shapes no other test compiles
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 11)]
    greedy = [(prompt, 0.0) for prompt in prompts]
    core = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    tokens = _run_core(core, greedy)
    assert core.program_layouts and all(layout.greedy for layout in core.program_layouts)

    warm = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    warm.warmup()
    assert _run_core(warm, greedy) == tokens
    assert not any(layout.greedy for layout in warm.program_layouts)

    mixed = EngineCore(tiny_qwen3.params, tiny_qwen3.config, config)
    assert _run_core(mixed, [greedy[0], (prompts[1], 1.0)])[0] == tokens[0]
    assert not any(layout.greedy for layout in mixed.program_layouts)
