"""Group-relative advantage estimators over ragged groups of rollouts, with a registry by name.

Rewards come as ``[num_groups, group_size]`` with a validity mask, because groups are ragged after RoC
selection (``RocSelection.mask``). Every estimator sees only the valid rollouts of its group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks

#: The group std of the advantages: population (n) or unbiased (Bessel's n - 1).
STD_MODES = ("population", "unbiased")
#: The group std of ``group_advantages`` (and of the RL config's ``rl.std``): Bessel's n - 1, as the released
#: code's verl ``torch.std``; the paper's Eq. 7 does not say which.
DEFAULT_STD = "unbiased"


class GroupStats(NamedTuple):
    """Per-group statistics over the valid rollouts, each shaped ``[num_groups, 1]`` to broadcast.

    Attributes:
      count: number of valid rollouts n (float).
      mean: mean reward over the valid rollouts.
      std: standard deviation, population (divide by n) or unbiased (divide by n - 1).
    """

    count: jax.Array
    mean: jax.Array
    std: jax.Array


class AdvantageEstimator(Protocol):
    """An advantage rule: ``[groups, n]`` rewards and their group statistics -> ``[groups, n]`` advantages
    (registered by name with :func:`register_estimator`)."""

    def __call__(self, rewards: jax.Array, stats: GroupStats, *, eps: jax.Array) -> jax.Array: ...


#: The advantage rules by name (:func:`register_estimator` adds one).
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_estimator(
    name: str, estimator: AdvantageEstimator | None = None, *, overwrite: bool = False
) -> Callable | AdvantageEstimator:
    """Add an advantage estimator to ``ADVANTAGE_ESTIMATORS`` (usable as a decorator).

    An estimator maps ``(rewards [G, n], stats: GroupStats, *, eps)`` to advantages ``[G, n]``; it need not
    care about invalid entries or degenerate groups, which ``group_advantages`` zeroes afterwards.
    """

    def add(fn: AdvantageEstimator) -> AdvantageEstimator:
        if not overwrite and name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered (pass overwrite=True)")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return add if estimator is None else add(estimator)


@register_estimator("grpo")
def grpo_estimator(rewards: jax.Array, stats: GroupStats, *, eps: jax.Array) -> jax.Array:
    """GRPO (DeepSeekMath, rStar2-Agent Eq. 7): A_i = (r_i - mean(r)) / (std(r) + eps)."""
    return (rewards - stats.mean) / (stats.std + eps)


@register_estimator("dr_grpo")
def dr_grpo_estimator(rewards: jax.Array, stats: GroupStats, *, eps: jax.Array) -> jax.Array:
    """Dr. GRPO: A_i = r_i - mean(r) (no std scaling; ``eps`` unused)."""
    del eps
    return rewards - stats.mean


@register_estimator("rloo")
def rloo_estimator(rewards: jax.Array, stats: GroupStats, *, eps: jax.Array) -> jax.Array:
    """RLOO: A_i = r_i - mean_{j != i} r_j = (r_i - mean(r)) * n / (n - 1) (``eps`` unused)."""
    del eps
    return (rewards - stats.mean) * stats.count / jnp.maximum(stats.count - 1.0, 1.0)


def group_stats(rewards: jax.Array, valid: jax.Array, *, std: str) -> GroupStats:
    """Count, mean and std of ``rewards`` over ``valid`` entries of each group (``[G, n]`` -> ``[G, 1]``)."""
    _checks.check_option("std", std, STD_MODES)
    count = jnp.sum(valid, axis=-1, keepdims=True).astype(rewards.dtype)
    mean = jnp.sum(jnp.where(valid, rewards, 0.0), axis=-1, keepdims=True) / jnp.maximum(count, 1.0)
    sq_dev = jnp.sum(jnp.where(valid, jnp.square(rewards - mean), 0.0), axis=-1, keepdims=True)
    ddof = 0.0 if std == "population" else 1.0
    return GroupStats(count=count, mean=mean, std=jnp.sqrt(sq_dev / jnp.maximum(count - ddof, 1.0)))


def group_advantages(
    rewards: jax.Array,
    mask: jax.Array,
    *,
    estimator: str = "grpo",
    std: str = DEFAULT_STD,
    eps: float | jax.Array = 1e-6,
) -> jax.Array:
    """Per-rollout advantages within each group of rollouts of one prompt.

    For group g with valid rollouts V_g (``mask``), n = |V_g|, mean = (1/n) sum_{i in V_g} r_i and
    std = sqrt(sum_{i in V_g} (r_i - mean)^2 / (n - ddof)) with ddof = 0 (``std="population"``) or 1
    (``"unbiased"``, verl's Bessel-corrected ``torch.std``):

      grpo:    A_i = (r_i - mean) / (std + eps)
      dr_grpo: A_i = r_i - mean
      rloo:    A_i = r_i - (1/(n-1)) sum_{j in V_g, j != i} r_j

    A group with at most one valid rollout, or whose valid rewards are all equal, gets A = 0 (it carries no
    relative signal; unlike verl, which passes a lone rollout's raw score through). Invalid entries get 0.
    Further estimators can be added with ``register_estimator``.

    Args:
      rewards: ``[num_groups, group_size]`` rewards, any real dtype.
      mask: ``[num_groups, group_size]`` validity (bool or 0/1).
      estimator: a name in ``ADVANTAGE_ESTIMATORS``.
      std: ``"unbiased"`` (``DEFAULT_STD``) or ``"population"``.
      eps: added to std in ``grpo``.

    Returns:
      ``[num_groups, group_size]`` advantages in float32 (or float64 for float64 rewards).
    """
    rewards = _checks.as_array("rewards", rewards)
    mask = _checks.as_array("mask", mask)
    _checks.check_rank("rewards", rewards, 2)
    _checks.check_real("rewards", rewards)
    _checks.check_mask("mask", mask)
    _checks.check_shape("mask", mask, rewards.shape, "rewards")
    _checks.check_option("estimator", estimator, ADVANTAGE_ESTIMATORS)
    _checks.check_option("std", std, STD_MODES)

    dtype = _checks.compute_dtype(rewards.dtype)
    rewards = rewards.astype(dtype)
    valid = mask != 0
    stats = group_stats(rewards, valid, std=std)
    advantages = ADVANTAGE_ESTIMATORS[estimator](rewards, stats, eps=jnp.asarray(eps, dtype))

    highest = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1, keepdims=True)
    lowest = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1, keepdims=True)
    informative = (stats.count > 1.0) & (highest > lowest)
    return jnp.where(valid & informative, advantages, 0.0).astype(dtype)
