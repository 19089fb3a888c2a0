"""FP8 block quantization: the e4m3 error bound, native matmuls against the dequantize-then-multiply
reference, FP8 weights through the scanned and sharded forward, bad blocks, the float8 feature probes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.models import platform, quantization
from rstar2jax.models.quantization import Fp8Weight, dequantize, error_bound, quantize_params, quantize_weight
from tests.models.conftest import REFERENCE_CONFIG


def _weight(shape, seed=0, in_axes=1, lead=0):
    """Normal values with a different magnitude per row, an outlier, and one all-zero 16 x 16 block of the
    matrix view."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) * np.exp(rng.uniform(-6, 2, size=shape[:-1]))[..., None]
    w.reshape(-1)[7] = 300.0
    rows = int(np.prod(shape[lead:lead + in_axes]))
    w.reshape(*shape[:lead], rows, -1)[..., :16, :16] = 0.0
    return w.astype(np.float32)


def _scales_per_element(w: Fp8Weight) -> np.ndarray:
    """Each element's block scale, in the weight's shape."""
    rows, cols = w.matrix_shape
    lead = w.shape[: w.lead_axes]
    s = np.asarray(w.scales)[..., :, None, :, None]
    s = np.broadcast_to(s, (*lead, rows // w.block, w.block, cols // w.block, w.block))
    return s.reshape(w.shape)


@pytest.mark.parametrize(("shape", "in_axes", "lead"), [((64, 96), 1, 0), ((3, 32, 4, 8), 1, 1),
                                                       ((2, 4, 8, 48), 2, 1)])
def test_round_trip_error_is_within_the_e4m3_bound(shape, in_axes, lead):
    w = _weight(shape, in_axes=in_axes, lead=lead)
    q = quantize_weight(jnp.asarray(w), in_axes=in_axes, lead=lead, block=16)
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == w.shape
    rows, cols = q.matrix_shape
    assert q.scales.shape == (*shape[:lead], rows // 16, cols // 16)
    scale = _scales_per_element(q)
    error = np.abs(np.asarray(dequantize(q)) - w)
    bound = np.asarray(error_bound(jnp.asarray(w), scale)) * (1 + 1e-6)
    assert (error <= bound).all(), float(np.max(error / bound))
    assert np.max(error / bound) > 0.5  # the bound is the format's, not a loose one
    assert np.max(np.abs(np.asarray(q.values, np.float32))) == 448.0  # every block uses the whole range
    rows = q.matrix_shape[0]
    assert (error.reshape(*shape[:lead], rows, -1)[..., :16, :16] == 0).all()  # the zero block: exact


SPECS = [("btd,dhk->bthk", (2, 3, 32), (32, 2, 16), 1), ("bthk,hkd->btd", (2, 3, 2, 16), (2, 16, 48), 2),
         ("rd,dv->rv", (5, 32), (32, 64), 1)]


@pytest.mark.parametrize(("spec", "x_shape", "w_shape", "in_axes"), SPECS)
def test_native_matmul_is_within_its_bound_of_the_reference(spec, x_shape, w_shape, in_axes):
    """The native path (float8 activations per 1 x 16 group, a float8 dot per group) runs on the CPU too,
    where XLA emulates the float8 dot: it must stay within the activation quantization's bound of the
    reference (x times the dequantized weight), and the reference must be exactly that product."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=x_shape) * np.exp(rng.uniform(-3, 3, size=x_shape)), jnp.float32)
    w = quantize_weight(jnp.asarray(_weight(w_shape, 2, in_axes)), in_axes=in_axes, block=16)
    reference = quantization.einsum(spec, x, w)
    np.testing.assert_array_equal(reference, jnp.einsum(spec, x, dequantize(w)))
    native = jax.jit(lambda x, w: quantization.einsum(spec, x, w))(x, w.replace(native=True))
    assert native.shape == reference.shape and native.dtype == x.dtype
    # |y_native - y_ref| <= sum_i (2^-4 |x_i| + 2^-10 s^x_i) |W^_in|, s^x_i <= max |x| of i's group / 448.
    x2 = jnp.einsum(f"{spec.split(',')[0]}->{spec.split(',')[0]}", x).reshape(-1, w.matrix_shape[0])
    x_scale = jnp.repeat(jnp.max(jnp.abs(x2.reshape(x2.shape[0], -1, 16)), axis=-1) / 448, 16, axis=-1)
    w2 = jnp.abs(dequantize(w)).reshape(w.matrix_shape)
    bound = (error_bound(x2, x_scale) @ w2).reshape(native.shape if spec != "bthk,hkd->btd" else (-1, 48))
    error = jnp.abs(native - reference).reshape(bound.shape)
    assert bool(jnp.all(error <= bound * (1 + 1e-5) + 1e-6)), float(jnp.max(error / bound))
    assert float(jnp.max(error)) > 0  # the activations were really quantized


def test_einsum_rejects_a_spec_that_contracts_other_axes():
    w = quantize_weight(jnp.ones((32, 32)), in_axes=1, block=16, native=True)
    with pytest.raises(ValueError, match="does not contract the first 1 axes"):
        quantization.einsum("bd,ed->be", jnp.ones((2, 32)), w)


def _quantized(params, config, **kwargs):
    return quantize_params(params, config, block=16, **kwargs)


@pytest.mark.parametrize("native", [False, True])
def test_fp8_weights_run_through_the_scanned_and_unrolled_forward(reference, native):
    """Stacked FP8 weights under the layer scan (and, on the reference path, unstacked and unrolled) give the
    logits of the dequantized weights: to float32 rounding on the reference path, within the activations'
    quantization on the native one."""
    config, params = reference.config, reference.params
    fp8 = _quantized(params, config, head=True, native=native)
    assert isinstance(fp8["layers"]["o_proj"], Fp8Weight) and isinstance(fp8["lm_head"], Fp8Weight)
    assert fp8["embed"] is params["embed"] and fp8["layers"]["attn_norm"] is params["layers"]["attn_norm"]
    layers = {k: dequantize(v) if isinstance(v, Fp8Weight) else v for k, v in fp8["layers"].items()}
    plain = {**params, "lm_head": dequantize(fp8["lm_head"]), "layers": layers}
    want, _ = models.forward(plain, config, reference.tokens)
    for tree in (fp8,) if native else (fp8, models.unstack_layers(fp8)):
        logits, _ = models.forward(tree, config, reference.tokens)
        np.testing.assert_allclose(logits, want, atol=0.05 if native else 1e-5, rtol=0)
    # FP8 weights are close to the trained ones: the logits move by little.
    np.testing.assert_allclose(want, reference.logits, atol=0.05, rtol=0)


def test_tied_head_is_quantized_from_the_embedding_and_the_lookup_keeps_it(reference):
    config = models.preset("tiny", vocab_size=128)  # tied embeddings
    params = models.init_params(config, jax.random.key(1))
    fp8 = _quantized(params, config, head=True)
    head, layout = models.output_head(fp8, config)
    assert layout == "dv" and head.shape == (config.hidden_size, config.vocab_size)
    largest = float(jnp.max(jnp.abs(params["embed"])))
    np.testing.assert_allclose(dequantize(head), params["embed"].T, atol=largest / 16)
    assert fp8["embed"] is params["embed"]


@pytest.mark.needs_devices(8)
def test_quantizing_tensor_parallel_weights_keeps_the_unsharded_results(reference):
    config = REFERENCE_CONFIG
    mesh = models.make_mesh(data=2, tensor=4)
    sharded = models.shard_params(reference.params, config, mesh)
    fp8_sharded = _quantized(sharded, config)
    fp8 = _quantized(reference.params, config)
    as_float = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)
    jax.tree.map(np.testing.assert_array_equal, as_float(fp8_sharded), as_float(fp8))
    tokens = jax.device_put(reference.tokens, models.batch_sharding(mesh, reference.tokens.shape))
    with jax.set_mesh(mesh):
        logits, _ = jax.jit(models.forward, static_argnums=1)(fp8_sharded, config, tokens)
    np.testing.assert_allclose(logits, models.forward(fp8, config, reference.tokens)[0], atol=1e-5, rtol=0)


def test_a_block_that_does_not_divide_a_weight_is_named(reference):
    with pytest.raises(ValueError, match=r"FP8 weight block 48 does not divide weight layers/q_proj"):
        quantize_params(reference.params, reference.config, block=48)
    with pytest.raises(ValueError, match=r"does not divide weight output head \(64, 100\)"):
        quantization.check_weight_blocks(models.preset("tiny", vocab_size=100), 16, head=True)
    with pytest.raises(ValueError, match="positive int"):
        quantization.check_weight_blocks(reference.config, 0)


def test_float8_feature_probes():
    """On this CPU float8 converts (so FP8 storage works) but XLA converts float8 dots to float32 first: no
    native FP8 matmul. The HLO reading recognises a cuBLASLt FP8 GEMM and a float8 dot fusion."""
    assert platform.float8_supported()
    if jax.default_backend() == "cpu":
        assert not platform.fp8_matmul_native()
    cublas = ('%p0 = f8e4m3fn[32,32]{1,0} parameter(0)\n%p1 = f8e4m3fn[32,32]{1,0} parameter(1)\n'
              '%gemm = (f32[32,32]{1,0}, s8[0]{0}) custom-call(%p0, %p1), '
              'custom_call_target="__cublas$lt$matmul$f8"')
    converted = ('%p0 = f8e4m3fn[32,32]{1,0} parameter(0)\n%c = f32[32,32]{1,0} convert(%p0)\n'
                 '%d = f32[32,32]{1,0} dot(%c, %c), lhs_contracting_dims={1}, rhs_contracting_dims={0}')
    assert platform.consumes_float8(cublas) and not platform.consumes_float8(converted)
