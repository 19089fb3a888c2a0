"""Clipped-surrogate policy loss with clip-higher, dual-clip, KL and entropy terms, and loss aggregation.

Token-level inputs are ``[batch, seq_len]`` with a ``loss_mask`` (1 on policy-sampled tokens, 0 on prompt,
padding and inserted tool tokens). Parity targets are verl's ``compute_policy_loss`` (vanilla, and GSPO),
``kl_penalty`` and ``agg_loss``; see ``policy_loss`` for the formulas and where this differs.

``policy_loss`` is composed of small pure pieces, each usable alone (as rlax's are), each with its formula:
:func:`importance_log_ratio` (PPO's per-token or GSPO's per-sequence log-ratio), :func:`clipped_surrogate`,
:func:`dual_clipped`, :func:`importance_weighted`, :func:`kl_penalty` (k1/k2/k3 and straight-through
estimators), :func:`aggregate_loss` with :func:`loss_normalizer`, and the clip metrics.
:func:`decoupled_policy_loss` is AReaL's decoupled objective for asynchronous RL, ``policy_loss`` against a
proximal policy weighted by truncated behaviour-to-proximal importance ratios.

Masked-out positions never reach the arithmetic: every token input is replaced by 0 where ``loss_mask`` is 0
before anything is computed from it, so a NaN or Inf there (e.g. a padding position's log-prob) changes
neither the loss nor its gradient.

Aggregation and micro-batching. Every mode is written as

    L = S / N,    S = sum over sequences b of s_b,    N = the ``normalizer``

where s_b depends on sequence b alone, so S is additive over any split of the batch along its first axis.
Passing the full batch's N (``loss_normalizer(full_loss_mask, agg=...)``) to every micro-batch therefore
makes the sum of micro-batch losses, and of their gradients, equal the full-batch loss and gradient:

  mode                             s_b                          N (default: from this loss_mask)
  token_mean                       sum_t m_bt x_bt               number of loss tokens, sum m (DAPO, Eq. 6)
  seq_mean_token_mean              sum_t m_bt x_bt / sum_t m_bt  number of sequences with >= 1 loss token
  seq_mean_token_sum               sum_t m_bt x_bt               number of sequences with >= 1 loss token
  seq_mean_token_sum_norm          sum_t m_bt x_bt               T (verl's mode of this name: S / T)
  seq_mean_token_sum_norm_drgrpo   sum_t m_bt x_bt / T           number of sequences with >= 1 loss token
                                                                 (TRL's Dr. GRPO: S / (n_seq T))

T = ``loss_mask.shape[-1]`` is the padded length (Dr. GRPO's constant), shared by micro-batches cut from one
``[B, T]`` batch. Sequences with no loss token (padding rows, e.g. slots RoC left empty) contribute nothing
and are not counted; verl counts every row of the micro-batch instead.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks
from rstar2jax.algo._checks import masked as _masked
from rstar2jax.algo.corrections import LOG_RATIO_BOUND, gspo_log_ratio

#: How the per-token loss is reduced to a scalar (``policy_loss(agg=...)``; the docstring of
#: :func:`aggregate_loss` gives each formula).
AGG_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "seq_mean_token_sum_norm_drgrpo",
)
#: "token": PPO's per-token ratio; "sequence": GSPO's per-sequence geometric mean of the token ratios.
IS_LEVELS = ("token", "sequence")

# verl's bound on the k3 ("low_var_kl") estimate.
K3_BOUND = 10.0


def _k1(log_ratio: jax.Array) -> jax.Array:
    return log_ratio


def _k2(log_ratio: jax.Array) -> jax.Array:
    return 0.5 * jnp.square(log_ratio)


def _k3(log_ratio: jax.Array) -> jax.Array:
    inverse_log_ratio = -jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return jnp.clip(jnp.exp(inverse_log_ratio) - inverse_log_ratio - 1.0, -K3_BOUND, K3_BOUND)


def _straight_through(estimate: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """Value of ``estimate``, gradient of k2 (whose gradient is the unbiased KL gradient)."""

    def kl(log_ratio: jax.Array) -> jax.Array:
        k2 = _k2(log_ratio)
        return k2 + jax.lax.stop_gradient(estimate(log_ratio) - k2)

    return kl


#: Per-token KL(pi || pi_ref) estimators of x = log pi(a) - log pi_ref(a), a ~ pi (Schulman's k1/k2/k3):
#:   k1 = x,  k2 = x^2 / 2,  k3 = exp(-x) + x - 1 (clipped to +-10 as verl's low_var_kl);
#:   "k1+"/"k3+": that value in the forward pass with the gradient of k2 (verl's "+" straight-through).
KL_ESTIMATORS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "k1+": _straight_through(_k1),
    "k3+": _straight_through(_k3),
}


def _checked_mask(loss_mask, agg: str) -> jax.Array:
    loss_mask = _checks.as_array("loss_mask", loss_mask)
    _checks.check_rank("loss_mask", loss_mask, 2)
    _checks.check_mask("loss_mask", loss_mask)
    _checks.check_option("agg", agg, AGG_MODES)
    return loss_mask


def _normalizer(mask: jax.Array, agg: str) -> jax.Array:
    if agg == "token_mean":
        return jnp.sum(mask)
    if agg == "seq_mean_token_sum_norm":
        return jnp.asarray(mask.shape[-1], mask.dtype)
    return jnp.sum(jnp.sum(mask, axis=-1) > 0).astype(mask.dtype)


def loss_normalizer(loss_mask: jax.Array, *, agg: str = "token_mean") -> jax.Array:
    """The denominator N of aggregation mode ``agg`` over ``loss_mask`` ``[B, T]`` (see the module doc).

    token_mean: N = sum_bt m_bt; seq_mean_token_sum_norm: N = T; the other seq_mean_* modes:
    N = #{b : sum_t m_bt > 0}. Compute it once over the
    whole batch and pass it as ``normalizer=`` to every micro-batch's ``policy_loss``/``aggregate_loss``.
    """
    loss_mask = _checked_mask(loss_mask, agg)
    return _normalizer(loss_mask.astype(jnp.float32), agg)


def _aggregate(values: jax.Array, mask: jax.Array, agg: str, normalizer: jax.Array | None) -> jax.Array:
    """``aggregate_loss`` on checked arrays: ``values`` and ``mask`` ``[B, T]`` of the compute dtype."""
    token_sums = jnp.sum(_masked(values, mask) * mask, axis=-1)
    if agg == "seq_mean_token_mean":
        token_sums = token_sums / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    elif agg == "seq_mean_token_sum_norm_drgrpo":
        token_sums = token_sums / mask.shape[-1]
    total = jnp.sum(token_sums)
    denominator = _normalizer(mask, agg) if normalizer is None else jnp.asarray(normalizer, values.dtype)
    # An empty batch (N = 0) has S = 0: return 0, with a finite gradient.
    return jnp.where(denominator > 0, total / jnp.where(denominator > 0, denominator, 1.0), 0.0)


def aggregate_loss(
    values: jax.Array, loss_mask: jax.Array, *, agg: str = "token_mean", normalizer: jax.Array | None = None
) -> jax.Array:
    """L = (sum_b s_b) / N for per-token ``values`` ``[B, T]`` (s_b and N per mode: see the module doc).

    ``normalizer`` overrides N (pass the full batch's ``loss_normalizer`` when micro-batching); by default
    N comes from ``loss_mask``. An N of 0 gives L = 0.
    """
    loss_mask = _checked_mask(loss_mask, agg)
    values = _checks.as_array("values", values)
    _checks.check_floating("values", values)
    _checks.check_shape("values", values, loss_mask.shape, "loss_mask")
    dtype = _checks.compute_dtype(values.dtype)
    return _aggregate(values.astype(dtype), loss_mask.astype(dtype), agg, normalizer)


def importance_log_ratio(
    logp: jax.Array,
    old_logp: jax.Array,
    loss_mask: jax.Array,
    *,
    level: str = "token",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """The log importance ratio x of each token, bounded to +-20 (so exp(x) is finite):

      level "token"     x_t = clip(logp_t - old_logp_t, -20, 20)                                  (PPO)
      level "sequence"  x_t = clip(sg[mean_{s in seq(t)} (logp_s - old_logp_s)] + logp_t - sg[logp_t],
                               -20, 20)                         (GSPO-token: ``corrections.gspo_log_ratio``)

    The mean runs over the loss tokens of t's sequence (its row, or its segment of ``segment_ids``). Inputs
    ``[B, T]``; at the token level ``loss_mask`` only fixes the shape (the caller masks the inputs)."""
    _checks.check_option("level", level, IS_LEVELS)
    _checks.check_shape("old_logp", old_logp, logp.shape, "logp")
    _checks.check_shape("loss_mask", loss_mask, logp.shape, "logp")
    if level == "sequence":
        log_ratio = gspo_log_ratio(logp, old_logp, loss_mask, segment_ids=segment_ids)
    else:
        log_ratio = logp - old_logp
    return jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def clipped_surrogate(
    advantages: jax.Array, ratio: jax.Array, *, eps_low: float | jax.Array, eps_high: float | jax.Array
) -> jax.Array:
    """PPO's clipped surrogate with clip-higher (DAPO; rStar2-Agent Eq. 6), per token, to minimise:

      l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))

    ``advantages`` A and ``ratio`` rho of one shape (``[B, T]``)."""
    _checks.check_shape("ratio", ratio, advantages.shape, "advantages")
    clipped_ratio = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return jnp.maximum(-advantages * ratio, -advantages * clipped_ratio)


def dual_clipped(token_loss: jax.Array, advantages: jax.Array, c: float | jax.Array) -> jax.Array:
    """Dual-clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``): a negative advantage's loss is bounded by
    -A c, however large the ratio grows:

      l'_t = min(l_t, -A_t c)   where A_t < 0;   l'_t = l_t   elsewhere          (c > 1)"""
    _checks.check_shape("token_loss", token_loss, advantages.shape, "advantages")
    return jnp.where(advantages < 0, jnp.minimum(token_loss, -advantages * c), token_loss)


def importance_weighted(token_loss: jax.Array, weights: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """Per-token importance weights (e.g. ``rollout_correction``'s), constants of the loss:

      l'_t = sg[w_t m_t] l_t          (w zeroed where the mask m is 0, so NaN there never reaches l')"""
    _checks.check_shape("weights", weights, token_loss.shape, "token_loss")
    _checks.check_shape("loss_mask", loss_mask, token_loss.shape, "token_loss")
    mask = loss_mask.astype(token_loss.dtype)
    return token_loss * jax.lax.stop_gradient(_masked(weights.astype(token_loss.dtype), mask))


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, *, estimator: str = "k3") -> jax.Array:
    """The per-token estimate of KL(pi || pi_ref) from x_t = logp_t - ref_logp_t, a_t ~ pi (Schulman):

      k1 = x,   k2 = x^2 / 2,   k3 = clip(exp(-x') + x' - 1, -10, 10) with x' = clip(x, -20, 20)
      "k1+" / "k3+": that value with the gradient of k2 (verl's straight-through estimators)"""
    _checks.check_option("estimator", estimator, KL_ESTIMATORS)
    _checks.check_shape("ref_logp", ref_logp, logp.shape, "logp")
    return KL_ESTIMATORS[estimator](logp - ref_logp)


def _token_array(name: str, x, shape) -> jax.Array:
    x = _checks.as_array(name, x)
    _checks.check_floating(name, x)
    _checks.check_shape(name, x, shape, "loss_mask")
    return x


def _require_term(coef_name: str, coef, input_name: str, given) -> None:
    concrete = _checks.concrete_value(coef)
    if given is None and (concrete is None or concrete != 0):
        raise ValueError(f"{coef_name}={coef!r} needs {input_name}; pass it or set {coef_name}=0")


def _checked_tokens(loss_mask, logp, old_logp, advantages, *, agg: str):
    """``policy_loss``'s token inputs as arrays, their shapes, dtypes and ``agg`` checked."""
    loss_mask = _checked_mask(loss_mask, agg)
    shape = loss_mask.shape
    logp = _token_array("logp", logp, shape)
    old_logp = _token_array("old_logp", old_logp, shape)
    return loss_mask, logp, old_logp, _checked_advantages(advantages, shape)


def _checked_advantages(advantages, shape) -> jax.Array:
    advantages = _checks.as_array("advantages", advantages)
    _checks.check_real("advantages", advantages)
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must be per sequence {shape[:1]} or per token {shape} (loss_mask is {shape}), "
            f"got {advantages.shape}"
        )
    return advantages


def _token_advantages(advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Advantages as constants of the loss, per token (a per-sequence A broadcast over its row), zero where
    ``mask`` is 0, in the mask's dtype."""
    advantages = jax.lax.stop_gradient(advantages.astype(mask.dtype))
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    return _masked(jnp.broadcast_to(advantages, mask.shape), mask)


def _check_policy_loss_options(*, kl, importance_sampling_level, kl_coef, ref_logp, entropy_coef, entropy,
                               dual_clip) -> None:
    """:func:`policy_loss`'s option checks: known names, a coefficient's input given, dual-clip c > 1."""
    _checks.check_option("kl", kl, KL_ESTIMATORS)
    _checks.check_option("importance_sampling_level", importance_sampling_level, IS_LEVELS)
    _require_term("kl_coef", kl_coef, "ref_logp", ref_logp)
    _require_term("entropy_coef", entropy_coef, "entropy", entropy)
    if dual_clip is not None:
        concrete = _checks.concrete_value(dual_clip)
        if concrete is not None and not concrete > 1.0:
            raise ValueError(f"dual_clip must be > 1 (it bounds -A*rho at -A*c for A < 0), got {dual_clip!r}")


def _with_kl_and_entropy(loss, metrics: dict, logp, mask, *, ref_logp, kl, kl_coef, entropy, entropy_coef,
                         agg, normalizer) -> jax.Array:
    """``loss + kl_coef * agg(KL) - entropy_coef * agg(H)``, each term only when its input is given (its
    aggregate is added to ``metrics``: ``kl_loss``, ``entropy``). ``logp`` and ``mask`` are checked and
    masked."""
    shape, dtype = mask.shape, mask.dtype
    if ref_logp is not None:
        ref_logp = _token_array("ref_logp", ref_logp, shape).astype(dtype)
        ref_logp = jax.lax.stop_gradient(_masked(ref_logp, mask))
        kl_loss = _aggregate(kl_penalty(logp, ref_logp, estimator=kl), mask, agg, normalizer)
        loss = loss + kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    if entropy is not None:
        entropy = _masked(_token_array("entropy", entropy, shape).astype(dtype), mask)
        entropy_loss = _aggregate(entropy, mask, agg, normalizer)
        loss = loss - entropy_coef * entropy_loss
        metrics["entropy"] = entropy_loss
    return loss
