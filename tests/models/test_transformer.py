"""Forward pass: logits parity with transformers (plain, padded, packed, bfloat16), options, KV cache."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from tests.models.conftest import logprob_loss
from tests.models.tiny_models import FAMILIES

FLOAT32_TOLERANCE = 1e-4
# bfloat16 compute (float32 master weights) vs transformers in float32: bfloat16 keeps 8 mantissa bits, so
# each matmul input carries ~0.4% relative rounding; through 2 layers logits stay within 3% of their range.
BFLOAT16_RELATIVE_TOLERANCE = 3e-2


def random_tokens(shape, seed=0, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


# Rows of one [2, 14] batch as (start, length) pieces, each a sequence of its own with positions from 0.
# Unlisted tokens are padding (segment id 0).
LAYOUTS = {
    "plain": [[(0, 14)], [(0, 14)]],
    "padded": [[(0, 9)], [(5, 9)]],  # row 0 right-padded, row 1 left-padded
    "packed": [[(0, 4), (4, 3), (7, 5)], [(0, 7), (7, 2)]],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_on_each_sequence(tiny_models, family, layout):
    """Every piece of the batch gets the logits transformers gives that piece run alone."""
    tiny = tiny_models(family)
    config, params = models.load_pretrained(tiny.path)
    tokens = random_tokens((2, 14), seed=1)
    segment_ids = np.zeros((2, 14), np.int32)
    positions = np.zeros((2, 14), np.int32)
    for row, pieces in enumerate(LAYOUTS[layout]):
        for segment, (start, length) in enumerate(pieces, start=1):
            segment_ids[row, start : start + length] = segment
            positions[row, start : start + length] = np.arange(length)
    tokens[segment_ids == 0] = -1  # an out-of-vocabulary pad id must not leak into real tokens
    logits, cache = models.forward(params, config, tokens, positions=positions, segment_ids=segment_ids)
    assert cache is None and logits.dtype == jnp.float32 and logits.shape == (2, 14, config.vocab_size)
    for row, pieces in enumerate(LAYOUTS[layout]):
        for start, length in pieces:
            piece = slice(start, start + length)
            expected = tiny.reference_logits(tokens[row, piece])
            np.testing.assert_allclose(logits[row, piece], expected, atol=FLOAT32_TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_bfloat16_compute_within_documented_bound(tiny_models, family):
    tiny = tiny_models(family)
    config, params = models.load_pretrained(tiny.path, compute_dtype=jnp.bfloat16)
    assert config.param_dtype == "float32" and params["layers"]["q_proj"].dtype == jnp.float32
    tokens = random_tokens((1, 12), seed=4)
    logits, _ = models.forward(params, config, tokens)
    expected = tiny.reference_logits(tokens[0])
    error = np.abs(np.asarray(logits[0]) - expected).max()
    assert error <= BFLOAT16_RELATIVE_TOLERANCE * np.abs(expected).max()
    assert error > FLOAT32_TOLERANCE / 10  # the compute really ran in bfloat16


def test_unrolled_layers_with_remat_agree_with_scan(reference):
    """Same loss and gradients with layers scanned (no remat) or unrolled with full rematerialisation
    (the sharding test runs the ``dots`` policy)."""
    variant = dataclasses.replace(reference.config, scan_layers=False, remat_policy="full")
    loss_and_grad = jax.value_and_grad(functools.partial(logprob_loss, config=variant), has_aux=True)
    (loss, _), grads = loss_and_grad(reference.params, reference.tokens)
    np.testing.assert_allclose(loss, reference.loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), grads, reference.grads)


def test_token_logprobs_is_log_softmax_gathered():
    rng = np.random.default_rng(0)
    logits = 3 * rng.standard_normal((2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 5))
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(jax.jit(models.token_logprobs)(logits, targets), expected, atol=1e-5)
    with pytest.raises(ValueError, match="leading dims"):
        models.token_logprobs(logits, targets[:, :3])


def test_prefill_then_decode_matches_full_forward(tiny_models):
    """Rows of different prompt lengths in one batch: a padded prefill chunk, then one token per step."""
    config, params = models.load_pretrained(tiny_models("qwen3").path)
    prompt_lengths = np.array([5, 2, 7])
    steps, batch = 4, 3
    full_len = prompt_lengths.max() + steps
    sequences = random_tokens((batch, full_len), seed=6)
    # Row b's real sequence is sequences[b, :prompt_lengths[b] + steps]; its full forward is the reference.
    full_logits, _ = models.forward(params, config, sequences)

    cache = models.init_cache(config, batch, max_len=16)
    T = prompt_lengths.max()
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (batch, T))
    segment_ids = (positions < prompt_lengths[:, None]).astype(np.int32)  # padding is not written
    logits, cache = models.forward(
        params, config, sequences[:, :T], positions=positions, segment_ids=segment_ids, cache=cache
    )
    for b in range(batch):
        n = prompt_lengths[b]
        np.testing.assert_allclose(logits[b, :n], full_logits[b, :n], atol=FLOAT32_TOLERANCE, rtol=0)

    for step in range(steps):
        position = prompt_lengths + step
        token = sequences[np.arange(batch), position][:, None]
        logits, cache = models.forward(
            params, config, token, positions=position[:, None].astype(np.int32), cache=cache
        )
        for b in range(batch):
            np.testing.assert_allclose(
                logits[b, 0], full_logits[b, position[b]], atol=FLOAT32_TOLERANCE, rtol=0
            )


def test_unstacked_layers_give_the_same_logits_and_cache(tiny_models):
    """``unstack_layers`` params (one buffer per layer) run the same model, with and without a cache."""
    config, params = models.load_pretrained(tiny_models("qwen3").path)
    unstacked = models.transformer.unstack_layers(params)
    assert len(unstacked["layers"]) == config.num_layers
    tokens = random_tokens((2, 6), seed=7)
    np.testing.assert_allclose(
        models.forward(unstacked, config, tokens)[0], models.forward(params, config, tokens)[0], atol=1e-6
    )
    (logits, cache), (expected_logits, expected_cache) = (
        models.forward(p, config, tokens, cache=models.init_cache(config, 2, max_len=8))
        for p in (unstacked, params)
    )
    np.testing.assert_allclose(logits, expected_logits, atol=1e-6)
    np.testing.assert_allclose(cache.k, expected_cache.k, atol=1e-6)
    np.testing.assert_allclose(cache.v, expected_cache.v, atol=1e-6)
    with pytest.raises(ValueError, match="already unstacked"):
        models.transformer.unstack_layers(unstacked)
    with pytest.raises(ValueError, match="unstacked layers"):
        models.forward({**unstacked, "layers": unstacked["layers"][:-1]}, config, tokens)
    bfloat16 = dataclasses.replace(config, compute_dtype="bfloat16")
    cast = models.transformer.unstack_layers(params, "bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
    # The same bfloat16 inputs to every op; only the (unrolled vs scanned) matmul blocking may differ.
    expected = models.forward(params, bfloat16, tokens)[0]
    np.testing.assert_allclose(
        models.forward(cast, bfloat16, tokens)[0], expected, atol=1e-2 * np.abs(expected).max(), rtol=0
    )


@pytest.mark.parametrize("layout", ["scan", "unrolled", "unstacked"])
def test_cached_decode_step_updates_the_cache_in_place(layout):
    """A decode step on a donated cache writes it in place: the compiled step needs no scratch memory as large
    as the cache's keys (a copy of the cache would; reading one layer's keys and values for attention may
    materialise that layer's slice, 2/num_layers of it)."""
    config = models.preset(
        "tiny", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=4, head_dim=8,
        tie_word_embeddings=False, scan_layers=layout == "scan",
    )
    params = jax.eval_shape(lambda: models.init_params(config, jax.random.key(0)))
    if layout == "unstacked":
        params = jax.eval_shape(models.transformer.unstack_layers, params)
    cache = jax.eval_shape(lambda: models.init_cache(config, batch_size=8, max_len=512))
    step = jax.jit(
        lambda params, tokens, positions, cache: models.forward(
            params, config, tokens, positions=positions, cache=cache
        ),
        donate_argnames="cache",
    )
    token = jax.ShapeDtypeStruct((8, 1), jnp.int32)
    memory = step.lower(params, token, token, cache).compile().memory_analysis()
    assert memory.alias_size_in_bytes == 2 * cache.k.size * cache.k.dtype.itemsize  # donated, aliased
    assert memory.temp_size_in_bytes < cache.k.size * cache.k.dtype.itemsize


def test_cache_holds_each_token_where_kvcache_says(tiny_models):
    """``k[:, b, :, j]`` / ``v[:, b, :, :, j]`` hold the key / value of row b's token at position j: checked
    against layer 0's projections of a token at position 0 (where RoPE is the identity), and by which
    entries a padded prefill fills."""
    config, params = models.load_pretrained(tiny_models("qwen3").path)
    tokens = random_tokens((2, 3), seed=8)
    positions = np.array([[0, 1, 2], [5, -1, -1]], np.int32)  # row 1: one token, at position 5
    cache = models.init_cache(config, batch_size=2, max_len=8)
    _, cache = models.forward(params, config, tokens, positions=positions, cache=cache)
    k_shape, v_shape = models.sharding.cache_shapes(config, 2, 8)
    assert cache.k.shape == k_shape == (config.num_layers, 2, config.num_kv_heads, 8, config.head_dim)
    assert cache.v.shape == v_shape == (config.num_layers, 2, config.num_kv_heads, config.head_dim, 8)
    filled = {0: [0, 1, 2], 1: [5]}
    for row, written in filled.items():
        for j in range(8):
            assert bool(np.any(cache.k[:, row, :, j])) == (j in written), (row, j)
            assert bool(np.any(cache.v[:, row, :, :, j])) == (j in written), (row, j)

    def rms_norm(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config.rms_norm_eps)

    layer = jax.tree.map(lambda p: np.asarray(p[0]), params["layers"])
    h = rms_norm(np.asarray(params["embed"])[tokens[0, 0]], layer["attn_norm"])
    key = rms_norm(np.einsum("d,dkh->kh", h, layer["k_proj"]), layer["k_norm"])
    np.testing.assert_allclose(cache.k[0, 0, :, 0], key, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(cache.v[0, 0, :, :, 0], np.einsum("d,dkh->kh", h, layer["v_proj"]), atol=1e-5,
                               rtol=1e-5)


def test_cache_positions_out_of_range_are_dropped(tiny_models):
    """Writing 6 tokens into a 4-slot cache keeps the first 4 and silently drops positions 4 and 5."""
    config, params = models.load_pretrained(tiny_models("llama").path)
    tokens = random_tokens((1, 6))
    logits_6, cache_6 = models.forward(params, config, tokens, cache=models.init_cache(config, 1, max_len=4))
    unrolled = dataclasses.replace(config, scan_layers=False)  # the unrolled cache path must agree too
    logits_4, cache_4 = models.forward(
        params, unrolled, tokens[:, :4], cache=models.init_cache(config, 1, max_len=4)
    )
    # Equal up to float rounding: XLA may block the matmuls of 6 and 4 tokens differently.
    np.testing.assert_allclose(cache_6.k, cache_4.k, atol=1e-6)
    np.testing.assert_allclose(cache_6.v, cache_4.v, atol=1e-6)
    np.testing.assert_allclose(logits_6[:, :4], logits_4, atol=1e-6)


def test_bad_forward_inputs_are_named(tiny_models):
    config, params = models.load_pretrained(tiny_models("qwen3").path)
    tokens = random_tokens((2, 3))
    with pytest.raises(ValueError, match="segment_ids shape"):
        models.forward(params, config, tokens, segment_ids=np.ones((2, 4), np.int32))
    with pytest.raises(ValueError, match="cache k/v shapes"):
        models.forward(params, config, tokens, cache=models.init_cache(config, batch_size=3, max_len=8))
    cache = models.init_cache(config, batch_size=2, max_len=8)
    with pytest.raises(ValueError, match="cache k/v shapes"):  # values in the keys' layout
        models.forward(params, config, tokens, cache=models.KVCache(k=cache.k, v=cache.k))
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        models.forward(params, config, tokens[0])
