import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import algo
from tests.algo import reference


def ragged_rewards(seed, num_groups=12, group_size=9, binary=False):
    rng = np.random.default_rng(seed)
    if binary:
        rewards = rng.integers(0, 2, (num_groups, group_size)).astype(np.float32)
    else:
        rewards = rng.normal(size=(num_groups, group_size)).astype(np.float32)
    mask = rng.random((num_groups, group_size)) < 0.7
    mask[0] = False  # an empty group
    mask[1, 1:] = False  # a group of one
    rewards[2] = 0.7  # all equal (and 0.7 is not exact in float32, so the mean is off by an ulp)
    mask[2] = True
    rewards[3, ~mask[3]] = np.nan  # invalid entries must not leak into the statistics
    return rewards, mask


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("std", ["population", "unbiased"])
@pytest.mark.parametrize("binary", [False, True])
def test_matches_float64_reference(estimator, std, binary):
    rewards, mask = ragged_rewards(seed=zlib.crc32(f"{estimator}/{std}/{binary}".encode()), binary=binary)
    got = algo.group_advantages(rewards, mask, estimator=estimator, std=std, eps=1e-6)
    want = reference.group_advantages(rewards, mask, estimator=estimator, std=std, eps=1e-6)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # The degenerate groups really are zero, and an informative group is not.
    assert not np.any(np.asarray(got)[:3])
    assert np.any(np.asarray(got)[3:])


@pytest.mark.parametrize(("std", "ddof"), [("population", 0), ("unbiased", 1), (None, 1)])
def test_grpo_unit_std_and_zero_mean_on_valid_entries(std, ddof):
    rewards, mask = ragged_rewards(seed=3)
    options = {} if std is None else {"std": std}  # None: the default, Bessel-corrected
    adv = np.asarray(algo.group_advantages(rewards, mask, estimator="grpo", eps=0.0, **options))
    for g in range(3, rewards.shape[0]):
        a = adv[g, mask[g]]
        if len(a) > 1:
            np.testing.assert_allclose(a.mean(), 0.0, atol=1e-5)
            np.testing.assert_allclose(a.std(ddof=ddof), 1.0, rtol=1e-5)
        assert not np.any(adv[g, ~mask[g]])


def test_rloo_is_leave_one_out_difference():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0, 5.0]], np.float32)
    mask = np.array([[True, True, True, True, False]])
    adv = algo.group_advantages(rewards, mask, estimator="rloo")
    np.testing.assert_allclose(adv, [[1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0.0]], rtol=1e-6)


def test_jit_vmap_and_bfloat16():
    rewards, mask = ragged_rewards(seed=7, binary=True)
    rewards = np.nan_to_num(rewards)
    eager = algo.group_advantages(rewards, mask)
    jitted = jax.jit(algo.group_advantages, static_argnames=("estimator", "std"))(rewards, mask)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    both = np.stack([rewards, rewards[::-1]]), np.stack([mask, mask[::-1]])
    stacked = jax.vmap(algo.group_advantages)(*both)
    np.testing.assert_allclose(stacked[1], algo.group_advantages(rewards[::-1], mask[::-1]), rtol=1e-6)
    half = algo.group_advantages(jnp.asarray(rewards, jnp.bfloat16), mask)
    assert half.dtype == jnp.float32  # computed and returned in float32; binary rewards are exact in bf16
    np.testing.assert_allclose(half, eager, rtol=1e-6)


def test_registry_accepts_a_custom_estimator():
    name = "test_mean_only"
    try:
        @algo.register_estimator(name)
        def centred_times_count(rewards, stats, *, eps):
            del eps
            return (rewards - stats.mean) * stats.count

        rewards = np.array([[1.0, 0.0, 0.0]], np.float32)
        adv = algo.group_advantages(rewards, np.ones_like(rewards, bool), estimator=name)
        np.testing.assert_allclose(adv, [[2.0, -1.0, -1.0]], rtol=1e-6)
        with pytest.raises(ValueError, match="already registered"):
            algo.register_estimator(name, centred_times_count)
    finally:
        algo.ADVANTAGE_ESTIMATORS.pop(name, None)
    assert {"grpo", "dr_grpo", "rloo"} <= set(algo.ADVANTAGE_ESTIMATORS)


def test_bad_inputs_raise_clear_errors():
    rewards = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="rank 2"):
        algo.group_advantages(rewards[0], np.ones(4, bool))
    with pytest.raises(ValueError, match="mask must have the shape"):
        algo.group_advantages(rewards, np.ones((2, 3), bool))
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        algo.group_advantages(rewards, np.ones((2, 4), bool), estimator="ppo")
    with pytest.raises(ValueError, match="unknown std 'sample'"):
        algo.group_advantages(rewards, np.ones((2, 4), bool), std="sample")
    with pytest.raises(TypeError, match="rewards must be an integer or floating-point"):
        algo.group_advantages(rewards > 0, np.ones((2, 4), bool))
