"""Sequence-level ratios over (possibly packed) token batches: GSPO's ratio and rollout correction.

Token inputs are ``[B, T]`` with a ``loss_mask``; ``segment_ids`` (``[B, T]`` int, 1, 2, ... per sequence in
a row, 0 = padding) say which tokens form one sequence. Without ``segment_ids`` each row is one sequence. A
"sequence sum" at a token is the sum over the loss tokens of that token's own sequence.

Rollout correction (verl's ``rollout_corr``, the "truncated / masked importance sampling" of Yao et al. 2025)
reweights the loss by how far the trainer's probabilities pi_train (log-probs of the policy the update starts
from, evaluated by the trainer) are from the rollout engine's pi_rollout (log-probs the engine recorded while
sampling), which differ by kernels, precision and batching even for the same weights.
:func:`rollout_mismatch` measures that difference (mean |delta log p|, the k3 KL estimate, the fraction of
tokens whose ratio leaves [0.5, 2]): the figure to log when the engine samples in another precision (FP8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks
from rstar2jax.algo._checks import masked as _masked

# verl clamps log-ratios to +-20 before exponentiating, so exp never overflows.
LOG_RATIO_BOUND = 20.0

#: How a sequence's importance ratio is formed from its token ratios r_t (over its loss tokens):
#:   "sequence":  R = prod_t r_t                     (verl's rollout_is_level="sequence")
#:   "geometric": R = (prod_t r_t)^(1 / n_tokens)    (verl's "geometric"; GSPO's ratio)
SEQUENCE_RATIOS = ("sequence", "geometric")


def _check_tokens(loss_mask, segment_ids, **arrays) -> tuple[jax.Array, jax.Array | None, dict]:
    loss_mask = _checks.as_array("loss_mask", loss_mask)
    _checks.check_rank("loss_mask", loss_mask, 2)
    _checks.check_mask("loss_mask", loss_mask)
    out = {}
    for name, x in arrays.items():
        x = _checks.as_array(name, x)
        _checks.check_floating(name, x)
        _checks.check_shape(name, x, loss_mask.shape, "loss_mask")
        out[name] = x
    if segment_ids is not None:
        segment_ids = _checks.as_array("segment_ids", segment_ids)
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise TypeError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")
        _checks.check_shape("segment_ids", segment_ids, loss_mask.shape, "loss_mask")
    return loss_mask, segment_ids, out


def sequence_sum(values: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Per token, the sum of ``values`` ``[B, T]`` over the tokens of its own sequence (same row and segment).

    Without ``segment_ids``: the row sum, broadcast over the row. Mask ``values`` first to sum loss tokens
    only.
    """
    if segment_ids is None:
        return jnp.broadcast_to(jnp.sum(values, axis=-1, keepdims=True), values.shape)
    rows, length = values.shape
    # Segment ids lie in [0, T] (a segment takes at least one position), so row * (T + 1) + id is unique.
    ids = segment_ids + (length + 1) * jnp.arange(rows, dtype=segment_ids.dtype)[:, None]
    sums = jax.ops.segment_sum(values.reshape(-1), ids.reshape(-1), num_segments=rows * (length + 1))
    return sums[ids]


def sequence_log_ratio(
    log_ratio: jax.Array,
    loss_mask: jax.Array,
    *,
    kind: str = "geometric",
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Per token, log R of its sequence from token log-ratios x_t (``[B, T]``, loss tokens only):

      sequence:  log R = sum_t m_t x_t
      geometric: log R = sum_t m_t x_t / sum_t m_t
    """
    _checks.check_option("kind", kind, SEQUENCE_RATIOS)
    mask = loss_mask.astype(log_ratio.dtype)
    total = sequence_sum(_masked(log_ratio, mask) * mask, segment_ids)
    if kind == "sequence":
        return total
    return total / jnp.maximum(sequence_sum(mask, segment_ids), 1.0)


def gspo_log_ratio(
    logp: jax.Array, old_logp: jax.Array, loss_mask: jax.Array, *, segment_ids: jax.Array | None = None
) -> jax.Array:
    """GSPO-token's per-token log-ratio (Zheng et al. 2025, Eq. 13-14; verl's ``gspo`` policy loss):

      log s_i   = (1 / |y_i|) sum_t (log pi(y_it) - log pi_old(y_it))      (geometric mean of token ratios)
      log s_it  = sg[log s_i] + log pi(y_it) - sg[log pi(y_it)]

    The value is the sequence's log s_i at each of its tokens; the gradient is that of log pi(y_it), so
    d s_it / d theta = s_i grad log pi(y_it), which is GSPO's gradient when aggregated per sequence.
    Masked-out positions get 0. ``[B, T]`` in, ``[B, T]`` out in the compute dtype.
    """
    loss_mask, segment_ids, arrays = _check_tokens(loss_mask, segment_ids, logp=logp, old_logp=old_logp)
    dtype = _checks.compute_dtype(arrays["logp"].dtype)
    mask = loss_mask.astype(dtype)
    logp = _masked(arrays["logp"].astype(dtype), mask)
    old_logp = _masked(arrays["old_logp"].astype(dtype), mask)
    seq = sequence_log_ratio(logp - jax.lax.stop_gradient(old_logp), mask, segment_ids=segment_ids)
    return jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp)


def rollout_correction(
    train_logp: jax.Array,
    rollout_logp: jax.Array,
    loss_mask: jax.Array,
    *,
    token_cap: float | None = 2.0,
    sequence_mask: str | None = None,
    mask_threshold: float = 2.0,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Importance weights for the rollout/trainer mismatch (no gradient), ``[B, T]``.

    With token ratios r_t = exp(clip(log pi_train(y_t) - log pi_rollout(y_t), -20, 20)):

      token-level truncated IS (``token_cap`` = C):      w_t = min(r_t, C)          (verl "token", "truncate")
      sequence-level masking (``sequence_mask``, C' = ``mask_threshold``):
          w_t = w_t * 1[1/C' <= R <= C']  with R the sequence's ratio (``SEQUENCE_RATIOS``)  (verl "mask")

    Either part can be off (``token_cap=None``, ``sequence_mask=None``). Multiply the per-token policy loss
    by w (``policy_loss(is_weights=w)``). Masked-out positions get w = 0.

    Metrics (sums over loss tokens, so that they add up over micro-batches; divide by the loss tokens):
      rollout_is_ratio: sum of r_t; rollout_is_capped: number of tokens with r_t > C;
      rollout_is_masked: number of loss tokens in masked sequences.

    Returns:
      (weights, metric sums), float32 (float64 for float64 inputs).
    """
    loss_mask, segment_ids, arrays = _check_tokens(
        loss_mask, segment_ids, train_logp=train_logp, rollout_logp=rollout_logp
    )
    if sequence_mask is not None:
        _checks.check_option("sequence_mask", sequence_mask, SEQUENCE_RATIOS)
    for name, value in (("token_cap", token_cap), ("mask_threshold", mask_threshold)):
        if value is not None and not value > 1.0:
            raise ValueError(f"{name} must be > 1, got {value!r}")
    mask, log_ratio = _clipped_log_ratio(arrays["train_logp"], arrays["rollout_logp"], loss_mask)
    dtype = mask.dtype
    ratio = jnp.exp(log_ratio)
    weights = mask
    capped = jnp.zeros((), dtype)
    if token_cap is not None:
        weights = weights * jnp.minimum(ratio, token_cap)
        capped = jnp.sum(mask * (ratio > token_cap))
    masked = jnp.zeros((), dtype)
    if sequence_mask is not None:
        log_seq = sequence_log_ratio(log_ratio, mask, kind=sequence_mask, segment_ids=segment_ids)
        bound = jnp.log(jnp.asarray(mask_threshold, dtype))
        keep = (log_seq >= -bound) & (log_seq <= bound)
        weights = weights * keep
        masked = jnp.sum(mask * ~keep)
    metrics = {
        "rollout_is_ratio": jnp.sum(mask * ratio),
        "rollout_is_capped": capped,
        "rollout_is_masked": masked,
    }
    return jax.lax.stop_gradient(weights), metrics


#: The token ratio band outside which ``rollout_mismatch`` counts a token (as verl's rollout_corr reports).
MISMATCH_RATIO_BAND = (0.5, 2.0)


def _clipped_log_ratio(train_logp, rollout_logp, loss_mask) -> tuple[jax.Array, jax.Array]:
    """(mask, clip(log pi_train - log pi_rollout, -20, 20)) in the compute dtype, masked positions 0, no
    gradient."""
    dtype = _checks.compute_dtype(train_logp.dtype)
    mask = loss_mask.astype(dtype)
    train_logp = _masked(train_logp.astype(dtype), mask)
    rollout_logp = _masked(rollout_logp.astype(dtype), mask)
    return mask, jax.lax.stop_gradient(jnp.clip(train_logp - rollout_logp, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def rollout_mismatch(
    train_logp: jax.Array,
    rollout_logp: jax.Array,
    loss_mask: jax.Array,
    *,
    band: tuple[float, float] = MISMATCH_RATIO_BAND,
    sums: bool = False,
) -> dict[str, jax.Array]:
    """How far the rollout engine's log-probs are from the trainer's over the loss tokens (no gradient).

    With d_t = clip(log pi_train(y_t) - log pi_rollout(y_t), -20, 20) and r_t = exp(d_t), n loss tokens:

      mismatch_abs_log_ratio  = (1/n) sum_t |d_t|                  (mean |delta log p|)
      mismatch_k3_kl          = (1/n) sum_t (r_t - 1 - d_t)        (Schulman's k3: each term >= 0, the mean
                                                                    estimates KL(pi_rollout || pi_train))
      mismatch_outside_band   = (1/n) #{t : r_t < band[0] or r_t > band[1]}
      mismatch_tokens         = n

    The means are 0 when there are no loss tokens. With ``sums`` the first three are sums instead (divide by
    the total of ``mismatch_tokens`` after adding micro-batches up). ``[B, T]`` inputs; float32 (float64 for
    float64 inputs) scalars out.
    """
    loss_mask, _, arrays = _check_tokens(loss_mask, None, train_logp=train_logp, rollout_logp=rollout_logp)
    low, high = band
    if not 0 < low < 1 < high:
        raise ValueError(f"band must be (low, high) with 0 < low < 1 < high, got {band!r}")
    mask, log_ratio = _clipped_log_ratio(arrays["train_logp"], arrays["rollout_logp"], loss_mask)
    ratio = jnp.exp(log_ratio)
    tokens = jnp.sum(mask)
    scale = 1.0 if sums else 1.0 / jnp.maximum(tokens, 1.0)
    return {
        "mismatch_abs_log_ratio": scale * jnp.sum(mask * jnp.abs(log_ratio)),
        "mismatch_k3_kl": scale * jnp.sum(mask * (ratio - 1.0 - log_ratio)),
        "mismatch_outside_band": scale * jnp.sum(mask * ((ratio < low) | (ratio > high))),
        "mismatch_tokens": tokens,
    }
