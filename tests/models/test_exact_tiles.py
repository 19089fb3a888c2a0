"""``models.exact``'s tiles: the attention tile's rows do not depend on its row count (what lets the trainer
run larger tiles than the engine), and the exact programs' gradients are the default programs' (a
``jax.custom_vjp`` over all rows at once), with and without rematerialisation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.models import exact


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attend_tile_rows_do_not_depend_on_the_tile_size(dtype):
    """128 queries (random positions, each over its own random keys) attended as one tile of 128 rows and as
    16 tiles of ``TILE_ROWS`` (the engine's): the same bits (XLA:CPU's reduction over 32 keys alone would
    differ by 6e-6 between 8 and 128 rows)."""
    rows, heads, kv_heads, head_dim, blocks = 128, 4, 2, 16, 3
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, heads, head_dim)), dtype)
    keys, values = (jnp.asarray(rng.normal(size=(rows, blocks * exact.KEY_BLOCK, kv_heads, head_dim)), dtype)
                    for _ in range(2))
    positions = jnp.asarray(rng.integers(-1, blocks * exact.KEY_BLOCK, rows), jnp.int32)

    @jax.jit
    def attend(q, keys, values, positions):
        def key_block(i):
            block = lambda a: jax.lax.dynamic_slice_in_dim(a, i * exact.KEY_BLOCK, exact.KEY_BLOCK, axis=1)
            return block(keys), block(values)

        return exact.attend_tile(q, key_block, blocks, positions, kv_heads)

    whole = np.asarray(attend(q, keys, values, positions).astype(jnp.float32))
    tile = exact.TILE_ROWS
    tiled = np.concatenate([
        np.asarray(attend(*(a[i:i + tile] for a in (q, keys, values, positions))).astype(jnp.float32))
        for i in range(0, rows, tile)])
    np.testing.assert_array_equal(whole, tiled)
    assert np.all(whole[np.asarray(positions) < 0] == 0) and np.any(whole != 0)


def test_tiled_rows_gradient_is_the_untiled_functions():
    """``tiled_rows(fn, x, consts=(w,))``: forward by tiles, gradient (w.r.t. x and w) that of ``fn`` over all
    rows at once; an integer array passes through with no gradient."""
    rng = np.random.default_rng(1)
    x, w = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((21, 16), (16, 24)))
    scale = jnp.asarray(rng.integers(1, 4, 21), jnp.int32)
    fn = lambda w, x, s: jnp.tanh(x @ w) * s[:, None]
    loss = lambda tiled: lambda x, w: jnp.sum(jnp.sin(tiled(x, w)))
    tiled = jax.grad(loss(lambda x, w: exact.tiled_rows(fn, x, scale, consts=(w,))), argnums=(0, 1))(x, w)
    plain = jax.grad(loss(lambda x, w: fn(w, x, scale)), argnums=(0, 1))(x, w)
    for got, want in zip(tiled, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("remat_policy", ["none", "save_projections"])
def test_exact_gradient_is_the_default_numerics(remat_policy):
    """``sequence_logprobs``' gradient w.r.t. every weight (log-probs and entropies of packed rows): exact
    numerics give the default numerics' gradient up to float32 rounding, under each remat policy."""
    config = models.preset("tiny", remat_policy=remat_policy)
    params = models.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 40)), jnp.int32)
    segments = jnp.asarray(np.repeat([[1] * 9 + [2] * 24 + [3] * 7], 2, 0), jnp.int32)

    def loss(params, config):
        logp, entropy = models.sequence_logprobs(params, config, tokens, jnp.roll(tokens, -1, 1),
                                                 segment_ids=segments)
        return jnp.sum(logp) + 0.1 * jnp.sum(entropy)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    default, ours = grad(params, config), grad(params, dataclasses.replace(config, numerics="exact"))
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(default), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
