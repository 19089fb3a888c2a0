"""``models.exact_kernels``: exact numerics' Pallas kernels in Pallas' interpreter against the XLA programs of
``models.exact`` (float32 and bfloat16, ragged positions, padding rows, poisoned masked keys), their
lowering to Triton for CUDA and ROCm (lowered only: no GPU here), and the choice between them. The engine's
log-probs against the trainer's with the kernels forced: ``tests/engine/test_exact.py``."""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.models import exact, exact_kernels
from rstar2jax.models.logprobs import einsum_logits

TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=2e-2)}
ROWS = exact_kernels.PALLAS_TILE_ROWS


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)


def _assert_close(got, expected, dtype):
    got, expected = (np.asarray(x, np.float32) for x in (got, expected))
    np.testing.assert_allclose(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_matmul_is_the_product_and_each_rows_bits_its_own(dtype):
    """x [16, 96] @ w [96, 48] (three reduction blocks, output blocks of 16) is XLA's product; a row's bits
    do not depend on the tile's other rows or on its place in the tile."""
    rng = np.random.default_rng(0)
    x, w = _normal(rng, (ROWS, 96), dtype), _normal(rng, (96, 48), dtype)
    got = exact_kernels.row_matmul(x, w)
    expected = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype)
    assert got.dtype == jnp.dtype(dtype)
    _assert_close(got, expected, dtype)
    other = _normal(rng, (ROWS, 96), dtype).at[5].set(x[0])
    np.testing.assert_array_equal(np.asarray(exact_kernels.row_matmul(other, w)[5]), np.asarray(got[0]))


def test_row_matmul_with_a_transposed_weight_into_float32_is_the_heads_product():
    """A tied embedding's layout (``w`` ``[OUT, IN]``: ``x @ w.T``) into float32, as the output head runs."""
    rng = np.random.default_rng(6)
    x, head = _normal(rng, (ROWS, 64), jnp.bfloat16), _normal(rng, (128, 64), jnp.bfloat16)
    got = exact_kernels.logits_product("pallas_triton")(x, head, True)
    assert got.dtype == jnp.float32 and exact_kernels.logits_product("xla") is einsum_logits
    np.testing.assert_allclose(got, einsum_logits(x, head, True), rtol=1e-5, atol=1e-5)


def test_row_matmul_gradient_is_xlas():
    """The kernel's gradient (what the trainer's backward runs) is XLA's products."""
    rng = np.random.default_rng(4)
    x, w = _normal(rng, (ROWS, 64), jnp.float32), _normal(rng, (64, 32), jnp.float32)
    products = (exact_kernels.row_matmul, jnp.dot)
    grads = [jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) ** 2), (0, 1))(x, w) for f in products]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_the_model_trains_through_the_kernels():
    """The trainer's gradient of exact log-probs with the kernels forced (one layer): XLA's, to rounding."""
    config = models.preset("tiny", numerics="exact", num_layers=1)
    params = models.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (1, 20)), jnp.int32)

    def grad(kernels):
        kernel_config = dataclasses.replace(config, exact_kernels=kernels)
        loss = lambda p: jnp.sum(models.sequence_logprobs(p, kernel_config, tokens[:, :-1], tokens[:, 1:])[0])
        return jax.jit(jax.grad(loss))(params)

    for a, b in zip(*(jax.tree.leaves(grad(k)) for k in ("pallas_triton", "xla")), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_row_matmul_and_einsum_refuse_what_they_cannot_tile():
    x = jnp.zeros((ROWS, 64))
    with pytest.raises(ValueError, match="does not fit"):
        exact_kernels.row_matmul(x[:8], jnp.zeros((64, 64)))  # not a 16-row tile
    with pytest.raises(ValueError, match="does not fit"):
        exact_kernels.row_matmul(x, jnp.zeros((64, 24)))  # no output block divides 24
    with pytest.raises(ValueError, match="does not contract"):
        exact_kernels.einsum("btd,hdk->bthk", x[None], jnp.zeros((2, 64, 32)))


@pytest.mark.parametrize("spec, x_shape, w_shape", [("btd,dhk->bthk", (1, ROWS, 64), (64, 4, 16)),
                                                    ("bthk,hkd->btd", (1, ROWS, 4, 16), (4, 16, 32))])
def test_einsum_is_jnp_einsum(spec, x_shape, w_shape):
    """The projections' specs (x's trailing axes against w's leading ones) through the kernel."""
    rng = np.random.default_rng(1)
    x, w = _normal(rng, x_shape, jnp.float32), _normal(rng, w_shape, jnp.float32)
    np.testing.assert_allclose(exact_kernels.einsum(spec, x, w), jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)


def _paged_case(rng, dtype, page=8, pages_per_row=9, heads=4, kv_heads=2, head_dim=16):
    """Rows of a paged pool: ragged positions (one past a key block, one at 70), padding rows (-1), pages in a
    shuffled order, every key slot no row may read poisoned with NaN."""
    pos = np.array([0, 1, 31, 32, 33, 70, 5, -1, 17, -1, 63, 64], np.int32)
    N, num_pages = len(pos), len(pos) * pages_per_row
    table = rng.permutation(num_pages).reshape(N, pages_per_row).astype(np.int32)
    keys, values = (rng.normal(size=(kv_heads, num_pages * page, head_dim)) for _ in range(2))
    readable = np.zeros(num_pages * page, bool)
    for n, p in enumerate(pos):
        slots = table[n, np.arange(p + 1) // page] * page + np.arange(p + 1) % page
        readable[slots] = True
    keys[:, ~readable], values[:, ~readable] = np.nan, np.nan
    q = _normal(rng, (N, heads, head_dim), dtype, head_dim**-0.5)
    keys, values = jnp.asarray(keys, dtype), jnp.asarray(values, dtype)
    return q, keys, values, jnp.asarray(table * page), jnp.asarray(pos)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_kernel_is_attend_tile(dtype):
    """The kernel over a paged pool against ``exact.attend_tile`` reading the same keys: close, no masked
    (NaN) key leaks in, padding rows give 0."""
    rng = np.random.default_rng(2)
    q, keys, values, table, pos = _paged_case(rng, dtype)
    page, S = 8, exact.KEY_BLOCK
    got = exact_kernels.attention(q, keys, values, table, pos, page)
    blocks = (int(np.max(pos)) + S) // S  # the engine's count: blocks past a row's position change nothing

    def tile(q, table, pos):
        def key_block(i):
            key_pos = i * S + jnp.arange(S)
            index = table[:, jnp.minimum(key_pos // page, table.shape[1] - 1)] + key_pos % page
            return (jnp.transpose(x[:, index], (1, 2, 0, 3)) for x in (keys, values))

        return exact.attend_tile(q, key_block, blocks, pos, keys.shape[0])

    expected = exact.tiled_rows(tile, q, table, pos)
    assert got.dtype == q.dtype and not np.isnan(np.asarray(got, np.float32)).any()
    _assert_close(got, expected, dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32)[np.asarray(pos) < 0], 0.0)


def test_packed_attention_kernel_forward_and_the_xla_gradient():
    """Packed rows (ragged segments, padding at a row's end): the kernel's forward is close to the XLA
    program's and its gradient is the XLA program's own."""
    rng = np.random.default_rng(3)
    B, T, H, K, Dh = 2, 48, 4, 2, 16
    q = _normal(rng, (B, T, H, Dh), jnp.float32, Dh**-0.5)
    k, v = _normal(rng, (B, T, K, Dh), jnp.float32), _normal(rng, (B, T, K, Dh), jnp.float32)
    segment_ids = jnp.asarray([[1] * 33 + [2] * 10 + [0] * 5, [1] * 3 + [2] * 45], jnp.int32)
    cotangent = _normal(rng, q.shape, jnp.float32)

    def value_and_vjp(kernels):
        attend = lambda q, k, v: exact_kernels.packed_attention(q, k, v, segment_ids, kernels)
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(cotangent)

    (out, grads), (xla_out, xla_grads) = value_and_vjp("pallas_triton"), value_and_vjp("xla")
    np.testing.assert_allclose(out, xla_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, xla_grads, strict=True):  # the backward recomputes the XLA forward
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kernels_lower_to_triton(platform):
    """The kernels (the matmul also with a tied head's layout) lower to Triton kernel calls for a GPU
    platform (lowering only: nothing compiles to PTX or runs here)."""
    triton = "__gpu$xla.gpu.triton"
    head = lambda x, w: exact_kernels.row_matmul(x, w, transposed=True, out_dtype=jnp.float32)
    calls = {"row_matmul": (exact_kernels.row_matmul, [(ROWS, 64), (64, 128)]),
             "head": (head, [(ROWS, 64), (128, 64)]),
             "attention": (lambda *a: exact_kernels.attention(*a, 16),
                           [(40, 4, 16), (2, 96, 16), (2, 96, 16), (40, 3, "int32"), (40, "int32")])}
    for fn, shapes in calls.values():
        args = [jax.ShapeDtypeStruct(s[:-1], jnp.int32) if s[-1] == "int32" else
                jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
        with mock.patch.object(exact_kernels, "pallas_interpreted", return_value=False):
            exported = jax.export.export(jax.jit(fn), platforms=[platform],
                                         disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])(*args)
        assert triton in exported.mlir_module()


def test_the_choice_is_automatic_and_overridable():
    """'auto': XLA on CPU, the kernels on a CUDA or ROCm GPU when the model's shapes fit them; 'xla' and
    'pallas_triton' forced; a forced kernel that cannot run the model, or an unknown name, is a ValueError."""
    tiny = models.preset("tiny", numerics="exact")
    assert exact_kernels.resolve(tiny) == "xla"  # the tests' CPU
    assert exact_kernels.resolve(dataclasses.replace(tiny, exact_kernels="pallas_triton")) == "pallas_triton"
    odd = dataclasses.replace(tiny, head_dim=24)
    for gpu in ("cuda", "rocm"):
        with mock.patch.object(exact_kernels, "accelerator", return_value=gpu):
            assert exact_kernels.resolve(tiny) == "pallas_triton"
            assert exact_kernels.resolve(dataclasses.replace(tiny, exact_kernels="xla")) == "xla"
            assert exact_kernels.resolve(odd) == "xla"
    assert exact_kernels.unsupported_reason(models.preset("qwen3-1.7b")) is None
    assert (exact_kernels.tile_rows("pallas_triton"), exact_kernels.tile_rows("xla")) == (16, exact.TILE_ROWS)
    with pytest.raises(ValueError, match="exact_kernels='pallas_triton' cannot run this model: head_dim=24"):
        exact_kernels.resolve(dataclasses.replace(odd, exact_kernels="pallas_triton"))
    with pytest.raises(ValueError, match=r"exact_kernels='triton'; expected one of \('auto', 'xla', "):
        dataclasses.replace(tiny, exact_kernels="triton")
