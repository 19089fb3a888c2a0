"""Chunked vocabulary log-probs and entropy (models.logprobs) against the dense [tokens, V] computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models


def _dense(hidden, head_dv, targets, temperature):
    z = jnp.einsum("...d,dv->...v", hidden, head_dv) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0] - lse
    return logp, lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)


@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [128, 1000])  # 1000 = V: one chunk; 128: 8 chunks, the last one shifted
def test_values_and_gradients_equal_dense(layout, temperature, chunk):
    keys = jax.random.split(jax.random.key(0), 5)
    hidden = jax.random.normal(keys[0], (3, 37, 16))
    head_dv = 0.3 * jax.random.normal(keys[1], (16, 1000))
    targets = jax.random.randint(keys[2], (3, 37), 0, 1000)
    g_logp, g_entropy = jax.random.normal(keys[3], (3, 37)), jax.random.normal(keys[4], (3, 37))
    head = head_dv if layout == "dv" else head_dv.T

    def objective(fn):
        return lambda h, w: jnp.sum(g_logp * fn(h, w)[0]) + jnp.sum(g_entropy * fn(h, w)[1])

    def chunked(h, w):
        return models.token_logprobs_and_entropy(
            h, w, targets, temperature=temperature, head_layout=layout, chunk=chunk
        )

    def dense(h, w):
        return _dense(h, w if layout == "dv" else w.T, targets, temperature)

    for got, expected in zip(chunked(hidden, head), dense(hidden, head), strict=True):
        np.testing.assert_allclose(got, expected, atol=3e-6, rtol=1e-6)
    got = jax.grad(objective(chunked), (0, 1))(hidden, head)
    expected = jax.grad(objective(dense), (0, 1))(hidden, head)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_sequence_logprobs_equal_forward_logits(reference):
    tokens = reference.tokens
    logits, _ = models.forward(reference.params, reference.config, tokens[:, :-1])
    logp, entropy = models.sequence_logprobs(
        reference.params, reference.config, tokens[:, :-1], tokens[:, 1:], temperature=0.8
    )
    scaled = logits / 0.8
    np.testing.assert_allclose(logp, models.token_logprobs(scaled, tokens[:, 1:]), atol=2e-6)
    expected_entropy = jax.nn.logsumexp(scaled, -1) - jnp.sum(jax.nn.softmax(scaled, -1) * scaled, -1)
    np.testing.assert_allclose(entropy, expected_entropy, atol=2e-6)


def test_no_tokens_by_vocab_array_in_forward_or_backward():
    """Compiled temporaries of the gradient stay far below one [tokens, vocab] float32 array."""
    tokens, dim, vocab = 4096, 64, 32768

    def loss(h, w, t):
        logp, entropy = models.token_logprobs_and_entropy(h, w, t, chunk=1024)
        return jnp.sum(logp) + jnp.sum(entropy)

    args = (jnp.zeros((tokens, dim)), jnp.zeros((dim, vocab)), jnp.zeros((tokens,), jnp.int32))
    temp = jax.jit(jax.grad(loss, (0, 1))).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp < tokens * vocab * 4 / 8, temp  # [tokens, 1024] blocks: 1/32 of it, a few alive at once


def test_bad_inputs_are_named():
    hidden, head = jnp.zeros((2, 5, 8)), jnp.zeros((8, 100))
    with pytest.raises(ValueError, match="targets shape"):
        models.token_logprobs_and_entropy(hidden, head, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="hidden's last dim"):
        models.token_logprobs_and_entropy(hidden, head.T, jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="head_layout"):
        models.token_logprobs_and_entropy(hidden, head, jnp.zeros((2, 5), jnp.int32), head_layout="x")
