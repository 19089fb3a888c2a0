"""Sampling: first_argmax against jnp.argmax, top-k / top-p thresholds against a sort-based reference, greedy
rows, seeded draws."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax.engine import first_argmax, sample_tokens, truncation_mask


def _reference_mask(logits: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """transformers' order: keep the top-k, then the smallest prefix of them (by probability) whose mass,
    renormalised over the top-k, reaches top_p."""
    vocab = len(logits)
    order = np.argsort(-logits, kind="stable")
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    top = order[:k]
    probs = np.exp(logits[top] - logits[top].max())
    probs /= probs.sum()
    n = k if top_p >= 1 else min(int(np.searchsorted(np.cumsum(probs), top_p)) + 1, k)
    keep = np.zeros(vocab, bool)
    keep[top[:n]] = True
    return keep


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
