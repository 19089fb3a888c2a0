"""Logical-axis sharding: FSDP, tensor parallel and both give the unsharded results (8 emulated devices)."""

import contextlib
import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from rstar2jax import models
from tests.models.conftest import REFERENCE_CONFIG, logprob_loss

CONFIG = REFERENCE_CONFIG


def _full_batch_all_reduces(compiled_text: str, batch: int) -> list[str]:
    """All-reduces whose result has a leading full-batch dimension: activations summed across devices."""
    return re.findall(rf"= f32\[{batch},[^\]]*\]\S* all-reduce", compiled_text)


@pytest.mark.needs_devices(8)
@pytest.mark.parametrize(
    ("mesh_shape", "with_mesh_context"),
    [(dict(fsdp=8), True), (dict(fsdp=8), False), (dict(data=2, tensor=4), True)],
)
def test_sharded_forward_equals_unsharded(reference, mesh_shape, with_mesh_context):
    """Under ``jax.set_mesh`` the activation hints apply too; FSDP then never all-reduces activations."""
    tokens = reference.tokens
    mesh = models.make_mesh(**mesh_shape)
    sharded = models.shard_params(reference.params, CONFIG, mesh)
    sharded_tokens = jax.device_put(tokens, models.batch_sharding(mesh, tokens.shape))
    with jax.set_mesh(mesh) if with_mesh_context else contextlib.nullcontext():
        compiled = jax.jit(models.forward, static_argnums=1).lower(sharded, CONFIG, sharded_tokens).compile()
    logits, _ = compiled(sharded, sharded_tokens)
    np.testing.assert_allclose(logits, reference.logits, atol=1e-5, rtol=0)
    if mesh_shape == dict(fsdp=8):
        # Without the hints GSPMD replicates the batch and all-reduces activations over the sharded embed.
        assert bool(_full_batch_all_reduces(compiled.as_text(), len(tokens))) == (not with_mesh_context)


@pytest.mark.needs_devices(8)
def test_fsdp_and_tensor_parallel_forward_and_gradients_equal_unsharded(reference):
    """2 x 4 fsdp x tensor mesh, with the ``dots`` remat policy on the sharded side."""
    tokens = reference.tokens
    mesh = models.make_mesh(fsdp=2, tensor=4)
    sharded = models.shard_params(reference.params, CONFIG, mesh)
    assert sharded["layers"]["k_proj"].sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert sharded["lm_head"].sharding.spec == PartitionSpec("fsdp", "tensor")
    sharded_tokens = jax.device_put(tokens, models.batch_sharding(mesh, tokens.shape))
    remat_config = dataclasses.replace(CONFIG, remat_policy="dots")
    grad_fn = jax.jit(jax.grad(logprob_loss, has_aux=True), static_argnums=2)
    with jax.set_mesh(mesh):
        grads, logits = grad_fn(sharded, sharded_tokens, remat_config)
    np.testing.assert_allclose(logits, reference.logits, atol=1e-5, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), grads, reference.grads)


@pytest.mark.needs_devices(8)
def test_init_params_on_a_mesh_is_born_sharded(reference):
    mesh = models.make_mesh(fsdp=2, tensor=4)
    params = models.init_params(CONFIG, jax.random.key(0), mesh=mesh)
    expected = models.param_shardings(CONFIG, mesh)
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding == sharding
    jax.tree.map(np.testing.assert_array_equal, params, reference.params)


@pytest.mark.needs_devices(8)
def test_cached_forward_on_a_sharded_cache_equals_unsharded(reference):
    """A cache placed by ``cache_sharding`` (batch over data, kv heads over tensor) stays so through a
    prefill and gives the unsharded logits and cache."""
    mesh = models.make_mesh(data=2, tensor=4)
    tokens, batch, max_len = reference.tokens, len(reference.tokens), 16
    k_sharding, v_sharding = models.cache_sharding(CONFIG, mesh, batch, max_len)
    assert k_sharding.spec == v_sharding.spec == PartitionSpec(None, "data", "tensor", None, None)
    cache = models.init_cache(CONFIG, batch, max_len)
    sharded_cache = jax.device_put(cache, models.KVCache(k=k_sharding, v=v_sharding))
    sharded = models.shard_params(reference.params, CONFIG, mesh)
    sharded_tokens = jax.device_put(tokens, models.batch_sharding(mesh, tokens.shape))
    with jax.set_mesh(mesh):
        logits, new_cache = models.forward(sharded, CONFIG, sharded_tokens, cache=sharded_cache)
    expected_logits, expected_cache = models.forward(reference.params, CONFIG, tokens, cache=cache)
    np.testing.assert_allclose(logits, expected_logits, atol=1e-5, rtol=0)
    for name, sharding in (("k", k_sharding), ("v", v_sharding)):
        got, want = getattr(new_cache, name), getattr(expected_cache, name)
        assert got.sharding.is_equivalent_to(sharding, got.ndim)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.needs_devices(8)
def test_logical_rules():
    mesh = models.make_mesh(data=2, fsdp=2, tensor=2)
    assert models.logical_to_spec(("batch", "length"), mesh) == PartitionSpec(("data", "fsdp"), None)
    # A dimension its mesh axes do not divide stays replicated instead of failing to place.
    assert models.logical_to_spec(("embed", "kv_heads"), mesh, shape=(64, 3)) == PartitionSpec("fsdp", None)
    # A mesh axis is used once per array: the second dimension mapped to it stays replicated.
    assert models.logical_to_spec(("heads", "mlp"), mesh) == PartitionSpec("tensor", None)
    with pytest.raises(ValueError, match="logical axis 'experts' has no rule"):
        models.logical_to_spec(("experts",), mesh)
    with pytest.raises(ValueError, match="needs 16 devices"):
        models.make_mesh(fsdp=4, tensor=4)


def test_param_logical_axes_cover_every_dimension():
    axes = models.param_logical_axes(CONFIG)
    shapes = jax.tree.map(lambda s: s.shape, models.param_specs(CONFIG), is_leaf=lambda x: hasattr(x, "axes"))
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    flat_shapes = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert [len(a) for a in flat_axes] == [len(s) for s in flat_shapes]
    assert axes["layers"]["o_proj"] == ("layers", "heads", "head_dim", "embed")
