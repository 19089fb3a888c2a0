"""Resample-on-Correct (RoC) down-selection of oversampled rollout groups (rStar2-Agent §2.2.3).

Every prompt has ``group_size`` (= 2G) rollouts; RoC keeps at most ``keep`` (= G) of them. A rollout is
positive when its reward is > 0. One jitted call handles all groups (the per-group kernel is vmapped), and
``keep`` and ``mode`` are the only static arguments: the floors, ``eps`` and ``reject_equal_reward`` are data.

Inside a group every selection is "the ``budget`` best-scoring valid members of a class", with ties broken
by rollout index, so the modes differ only in their budgets and scores:

  mode      negatives (reward <= 0)                    positives (reward > 0)
  paper     floor(n_neg/2), uniformly at random         ceil(n_pos/2), without replacement, P ∝ 1/(p + eps)
  release   round-half-even(n_neg·keep/n), floors,      the rest, lowest p_total first (stable)
            in rollout order
  uniform   one class: min(keep, n) uniformly at random

Weighted sampling without replacement is Gumbel-top-k: with g_i ~ Gumbel(0, 1), the k largest
g_i + log w_i are distributed as k successive draws without replacement with P ∝ w_i; here
w_i = 1/(p_total_i + eps), so p_total = 0 gives the finite weight 1/eps (the largest possible).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks

#: RoC down-sampling modes: the paper's, the released code's, and plain uniform 2G -> G (GRPO).
ROC_MODES = ("paper", "release", "uniform")


class RocSelection(NamedTuple):
    """Result of ``roc_select`` for ``num_groups`` groups.

    Attributes:
      indices: ``[num_groups, keep]`` int32 rollout indices, pairwise distinct within a group; the kept
        rollouts come first, in rollout order, followed by unselected indices as padding.
      mask: ``[num_groups, keep]`` bool, True on the kept entries (the first ``num_kept`` of each row).
      rejected: ``[num_groups]`` bool, the group was dropped by ``reject_equal_reward``.
      num_negatives: ``[num_groups]`` int32, kept rollouts with reward <= 0.
      num_positives: ``[num_groups]`` int32, kept rollouts with reward > 0.
    """

    indices: jax.Array
    mask: jax.Array
    rejected: jax.Array
    num_negatives: jax.Array
    num_positives: jax.Array

    @property
    def num_kept(self) -> jax.Array:
        return self.num_negatives + self.num_positives

    def gather(self, values: jax.Array) -> jax.Array:
        """``values[g, indices[g, j], ...]`` for per-rollout ``values`` ``[num_groups, group_size, ...]``."""
        values = jnp.asarray(values)
        index = self.indices.reshape(self.indices.shape + (1,) * (values.ndim - 2))
        return jnp.take_along_axis(values, index, axis=1)


def _round_half_even_div(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """round(numerator / denominator) with Python's half-to-even rule, in exact integer arithmetic."""
    quotient = numerator // denominator
    twice_remainder = 2 * (numerator - quotient * denominator)
    round_up = (twice_remainder > denominator) | ((twice_remainder == denominator) & (quotient % 2 == 1))
    return quotient + round_up.astype(quotient.dtype)


def _release_budgets(n_neg, n_pos, min_negatives, min_positives, keep: int):
    """Per-class budgets of the released code (``rstar2_agent/down_sample/roc.py``), made total.

    budget_c = round(n_c·keep/n); a class at or below its floor f_c = min(min_c, n_c) is lifted to f_c and
    the other class gets keep - f_c (negatives first, then positives). Then both are capped by availability
    and by keep. Where the released code would assert (rounding leaves the total at keep ± 1, possible only
    for odd keep), the total is made min(keep, n): positives take the remaining slots first.
    """
    n = jnp.maximum(n_neg + n_pos, 1)
    neg = _round_half_even_div(n_neg * keep, n)
    pos = _round_half_even_div(n_pos * keep, n)
    neg_floor = jnp.minimum(min_negatives, n_neg)
    pos_floor = jnp.minimum(min_positives, n_pos)
    lift_neg = neg <= neg_floor
    neg, pos = jnp.where(lift_neg, neg_floor, neg), jnp.where(lift_neg, keep - neg_floor, pos)
    lift_pos = pos <= pos_floor
    neg, pos = jnp.where(lift_pos, keep - pos_floor, neg), jnp.where(lift_pos, pos_floor, pos)
    neg = jnp.clip(neg, 0, jnp.minimum(n_neg, keep))
    pos = jnp.clip(pos, 0, jnp.minimum(n_pos, keep - neg))
    shortfall = jnp.minimum(keep, n_neg + n_pos) - neg - pos
    extra_pos = jnp.minimum(shortfall, n_pos - pos)
    return neg + shortfall - extra_pos, pos + extra_pos


def _rank_within_class(score: jax.Array, cls: jax.Array, valid: jax.Array) -> jax.Array:
    """0-based rank of each rollout among the valid members of its class, highest score first, ties by index.

    O(n^2) pairwise comparisons: for the group sizes of RL (tens of rollouts) this is cheaper than a sort
    and gives an exact, documented tie rule.
    """
    index = jnp.arange(score.shape[0])
    beats = (score[None, :] > score[:, None]) | (
        (score[None, :] == score[:, None]) & (index[None, :] < index[:, None])
    )
    rivals = valid[None, :] & (cls[None, :] == cls[:, None])
    return jnp.sum(beats & rivals, axis=1)


def _select_group(
    gumbel, rewards, p_total, valid, min_negatives, min_positives, reject_equal, eps, *, keep, mode
):
    """Selection for one group (all arrays ``[group_size]``); vmapped over groups by ``roc_select``."""
    positive = rewards > 0
    n_valid = jnp.sum(valid, dtype=jnp.int32)
    n_pos = jnp.sum(valid & positive, dtype=jnp.int32)
    n_neg = n_valid - n_pos
    highest = jnp.max(jnp.where(valid, rewards, -jnp.inf))
    lowest = jnp.min(jnp.where(valid, rewards, jnp.inf))
    rejected = reject_equal & ~(highest > lowest)  # vacuously "all equal" for an empty group

    if mode == "paper":
        neg_budget = jnp.minimum(n_neg // 2, keep)
        pos_budget = jnp.minimum((n_pos + 1) // 2, keep - neg_budget)
        score = jnp.where(positive, gumbel - jnp.log(p_total + eps), gumbel)
    elif mode == "release":
        neg_budget, pos_budget = _release_budgets(n_neg, n_pos, min_negatives, min_positives, keep)
        score = jnp.where(positive, -p_total, 0.0)  # ties (all negatives) fall back to rollout order
    else:  # uniform: one class
        neg_budget = pos_budget = jnp.minimum(keep, n_valid)
        positive = jnp.zeros_like(positive)
        score = gumbel

    rank = _rank_within_class(score, positive, valid)
    selected = valid & ~rejected & (rank < jnp.where(positive, pos_budget, neg_budget))
    # Stable sort of "not selected": kept rollouts first in rollout order, then distinct padding indices.
    indices = jnp.argsort(~selected, stable=True)[:keep].astype(jnp.int32)
    num_positives = jnp.sum(selected & (rewards > 0), dtype=jnp.int32)
    num_negatives = jnp.sum(selected, dtype=jnp.int32) - num_positives
    mask = jnp.arange(keep) < num_negatives + num_positives
    return RocSelection(indices, mask, rejected, num_negatives, num_positives)


@functools.partial(jax.jit, static_argnames=("keep", "mode"))
def _roc_select(key, rewards, p_total, valid, min_negatives, min_positives, reject_equal, eps, *, keep, mode):
    rewards = rewards.astype(_checks.compute_dtype(rewards.dtype))
    p_total = p_total.astype(_checks.compute_dtype(p_total.dtype))
    gumbel = jax.random.gumbel(key, rewards.shape, dtype=p_total.dtype)
    kernel = functools.partial(_select_group, keep=keep, mode=mode)
    return jax.vmap(kernel, in_axes=(0, 0, 0, 0, None, None, None, None))(
        gumbel, rewards, p_total, valid != 0, min_negatives, min_positives, reject_equal, eps
    )


def _checked_groups(rewards, p_total, valid) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``roc_select``'s per-rollout inputs as arrays, each ``[num_groups, group_size]`` and of its kind."""
    rewards = _checks.as_array("rewards", rewards)
    p_total = _checks.as_array("p_total", p_total)
    valid = _checks.as_array("valid", valid)
    _checks.check_rank("rewards", rewards, 2)
    _checks.check_real("rewards", rewards)
    _checks.check_real("p_total", p_total)
    _checks.check_mask("valid", valid)
    _checks.check_shape("p_total", p_total, rewards.shape, "rewards")
    _checks.check_shape("valid", valid, rewards.shape, "rewards")
    return rewards, p_total, valid


def _check_selection_options(group_size: int, *, keep, mode, min_negatives, min_positives, eps) -> None:
    """``roc_select``'s options: a known mode, 1 <= keep <= group_size, floors >= 0 and eps > 0 (the
    traced ones are data: checked where concrete)."""
    _checks.check_option("mode", mode, ROC_MODES)
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep <= group_size:
        raise ValueError(f"keep must be a Python int in [1, group_size={group_size}], got {keep!r}")
    for name, value in (("min_negatives", min_negatives), ("min_positives", min_positives)):
        concrete = _checks.concrete_value(value)
        if concrete is not None and (concrete.shape != () or concrete < 0):
            raise ValueError(f"{name} must be a non-negative integer scalar, got {value!r}")
    concrete_eps = _checks.concrete_value(eps)
    if concrete_eps is not None and (concrete_eps.shape != () or not concrete_eps > 0):
        raise ValueError(f"eps must be a positive scalar (it guards p_total = 0), got {eps!r}")


def roc_select(
    key: jax.Array,
    rewards: jax.Array,
    p_total: jax.Array,
    valid: jax.Array,
    *,
    keep: int,
    mode: str = "paper",
    min_negatives: int | jax.Array = 2,
    min_positives: int | jax.Array = 2,
    reject_equal_reward: bool | jax.Array = False,
    eps: float | jax.Array = 1e-6,
) -> RocSelection:
    """Resample-on-Correct: choose at most ``keep`` rollouts of each group of ``group_size``.

    With n_neg / n_pos the valid rollouts with reward <= 0 / > 0 in a group, n = n_neg + n_pos:

    - ``"paper"`` (rStar2-Agent §2.2.3, the default): keep
        k_neg = min(floor(n_neg/2), keep) negatives uniformly at random and
        k_pos = min(ceil(n_pos/2), keep - k_neg) positives without replacement, each draw choosing i with
        probability w_i / sum of the remaining w, w_i = 1/(p_total_i + eps).
      For n = 2·keep this keeps exactly keep (floor(a/2) + ceil(b/2) = keep when a + b = 2·keep). With fewer
      valid rollouts (or n odd) fewer are kept; the ``mask`` marks the real entries. With more than 2·keep
      valid rollouts the positives absorb the cut (they are "the rest", G - floor(n_neg/2), in the paper).
      ``min_negatives``/``min_positives`` do not apply: the paper has no floors.
    - ``"release"`` (the authors' released code): k_neg = round(n_neg·keep/n), k_pos = round(n_pos·keep/n)
      (Python's half-to-even ``round``); a class at or below its floor min(min_c, n_c) is raised to it and
      the other class gets the remainder keep - floor; budgets are capped by availability. Positives are the
      k_pos with the lowest p_total (stable: ties by rollout index), negatives the first k_neg in rollout
      order. Where the released code differs (it drops groups with n < keep and asserts where rounding leaves
      keep ± 1 in total) this keeps min(keep, n), positives filling first.
    - ``"uniform"``: min(keep, n) valid rollouts uniformly at random (plain GRPO on a sub-sample).

    With ``reject_equal_reward`` a group whose valid rewards are all equal (or that has no valid rollout)
    is rejected: nothing is kept and ``rejected`` is set.

    Args:
      key: PRNG key (paper and uniform modes draw from it; release mode is deterministic).
      rewards: ``[num_groups, group_size]`` rewards; > 0 means correct.
      p_total: ``[num_groups, group_size]`` penalties p_err + p_format >= 0 (see ``penalties``).
      valid: ``[num_groups, group_size]`` bool (or 0/1) mask of rollouts that exist.
      keep: rollouts kept per group at most (static; the output width), 1 <= keep <= group_size.
      mode: ``"paper"``, ``"release"`` or ``"uniform"`` (static).
      min_negatives, min_positives: release-mode floors per class.
      reject_equal_reward: drop groups whose rewards are all equal.
      eps: added to p_total in the paper-mode weights; must be > 0.

    Returns:
      A ``RocSelection``; ``selection.gather(x)`` picks the kept rollouts out of any per-rollout array.
    """
    rewards, p_total, valid = _checked_groups(rewards, p_total, valid)
    _check_selection_options(rewards.shape[1], keep=keep, mode=mode, min_negatives=min_negatives,
                             min_positives=min_positives, eps=eps)
    return _roc_select(
        key,
        rewards,
        p_total,
        valid,
        jnp.asarray(min_negatives, jnp.int32),
        jnp.asarray(min_positives, jnp.int32),
        jnp.asarray(reject_equal_reward, jnp.bool_),
        jnp.asarray(eps, jnp.float32),
        keep=keep,
        mode=mode,
    )
