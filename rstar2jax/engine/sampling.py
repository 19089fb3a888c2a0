"""Per-row token sampling: temperature, top-k and top-p as data (one compiled program for every setting).

Top-k and top-p thresholds are found by bisection on an order-preserving integer image of the logits instead
of a sort over the vocabulary: 32 exact halvings of the uint32 range, each one compare-and-reduce over the
vocabulary. Rows sample with the Gumbel-max trick, ``argmax(logits / T + Gumbel noise)``, which draws exactly
from ``softmax(logits / T)`` restricted to the kept tokens. Both greedy and sampled argmaxes are
:func:`first_argmax`, which XLA:CPU runs far faster than ``jnp.argmax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# A NumPy constant: a jnp one would start the JAX backend at import time, before launchers can set up
# emulated devices or jax.distributed.
_SIGN_BIT = np.uint32(0x80000000)
_ARGMAX_BLOCK = 128  # vocabulary entries per block in first_argmax


def _first_true(mask: jax.Array) -> jax.Array:
    """Index of the first True along the last axis (its length where none is)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, mask.shape, mask.ndim - 1)
    return jnp.min(jnp.where(mask, iota, mask.shape[-1]), axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of the first maximum along the last axis: int32, ``jnp.argmax(x, axis=-1)`` for NaN-free ``x``.

    ``jnp.argmax`` is a variadic (value, index) reduction, which XLA:CPU runs over 10x slower than a plain
    max. Here the only full pass is a max over blocks of ``_ARGMAX_BLOCK`` entries; then the first block
    holding the maximum and the first maximum inside that one block are found on small arrays.
    """
    pad = -x.shape[-1] % _ARGMAX_BLOCK  # -inf padding after the last entry never comes first
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    blocks = x.reshape(*x.shape[:-1], -1, _ARGMAX_BLOCK)
    block_max = jnp.max(blocks, axis=-1)
    best = jnp.max(block_max, axis=-1, keepdims=True)
    block = _first_true(block_max == best)
    entries = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
    return block * _ARGMAX_BLOCK + _first_true(entries == best)


def sortable_bits(x: jax.Array) -> jax.Array:
    """uint32 image of float32 ``x`` with the same order (``a < b`` iff their images are).

    Non-negative floats get the sign bit set; negative floats have all bits flipped (their magnitude order
    reverses). ``-inf`` maps below every finite value.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits & _SIGN_BIT, ~bits, bits | _SIGN_BIT)


def _largest_threshold(keys: jax.Array, holds) -> jax.Array:
    """Per row, the largest uint32 ``t`` with ``holds(keys >= t)`` true, given that ``holds`` is monotone
    (true for small ``t``, false past some point) and true at ``t = 0`` (every token kept).

    keys: uint32 ``[B, V]``; holds: ``[B, V] bool -> [B] bool``. Returns uint32 ``[B]``.
    """
    def halve(_, bounds):
        lo, hi = bounds
        span = hi - lo  # uint32 arithmetic: hi >= lo, no overflow
        mid = lo + span // 2 + (span & 1)  # ceil((lo + hi) / 2): always > lo while lo < hi
        ok = holds(keys >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    rows = keys.shape[0]
    lo = jnp.zeros((rows,), jnp.uint32)
    hi = jnp.full((rows,), 0xFFFFFFFF, jnp.uint32)
    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def truncation_mask(scaled_logits: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """Tokens kept by top-k then top-p (the transformers order): bool ``[B, V]``.

    Top-k keeps the ``top_k`` largest logits (``top_k <= 0`` keeps all; ties at the k-th value are all kept).
    Top-p then keeps the smallest set of the largest remaining tokens whose probability mass, renormalised
    over the top-k set, reaches ``top_p`` (``top_p >= 1`` keeps all; ties at the threshold are all kept).

    Args:
      scaled_logits: float32 ``[B, V]`` (already divided by the temperature).
      top_p: float32 ``[B]``; top_k: int32 ``[B]``.
    """
    keys = sortable_bits(scaled_logits)
    vocab = scaled_logits.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    k_threshold = _largest_threshold(keys, lambda kept: jnp.sum(kept, axis=-1) >= k)
    in_top_k = keys >= k_threshold[:, None]

    probs = jax.nn.softmax(jnp.where(in_top_k, scaled_logits, -jnp.inf), axis=-1)
    mass_reaches_p = lambda kept: jnp.sum(jnp.where(kept, probs, 0.0), axis=-1) >= top_p
    p_threshold = _largest_threshold(keys, mass_reaches_p)
    p_threshold = jnp.where(top_p >= 1.0, 0, p_threshold)
    return keys >= jnp.maximum(k_threshold, p_threshold)[:, None]


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
) -> jax.Array:
    """Draw one token per row.

    Row ``b`` is greedy (:func:`first_argmax`) when ``temperature[b] == 0``; otherwise it samples from
    ``softmax(logits[b] / temperature[b])`` restricted to :func:`truncation_mask`. The truncation pass and the
    noise are skipped at run time when no row needs them (greedy batches cost one argmax).

    Args:
      logits: float32 ``[B, V]``.
      keys: ``[B]`` typed PRNG keys, one per row.
      temperature, top_p: float32 ``[B]``; top_k: int32 ``[B]``.

    Returns:
      int32 ``[B]`` token ids.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {logits.shape}")
    rows = logits.shape[0]
    for name, value in (("keys", keys), ("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {value.shape}")
    logits = logits.astype(jnp.float32)
    greedy = first_argmax(logits)

    def stochastic():
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        truncate = (temperature > 0) & ((top_p < 1.0) | ((top_k > 0) & (top_k < logits.shape[-1])))
        kept = jax.lax.cond(
            jnp.any(truncate),
            lambda: truncation_mask(scaled, top_p, top_k),
            lambda: jnp.ones(scaled.shape, bool),
        )
        noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        sampled = first_argmax(jnp.where(kept, scaled + noise, -jnp.inf))
        return jnp.where(temperature > 0, sampled, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)

