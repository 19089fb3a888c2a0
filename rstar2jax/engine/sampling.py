"""Per-row token sampling: temperature, top-k and top-p as data (one compiled program for every setting).

A sampled row draws with the Gumbel-max trick, ``argmax(logits / T + g)`` over its kept tokens, where ``g`` is
``jax.random.gumbel(key, (vocab,))``: exactly ``softmax(logits / T)`` restricted to the kept tokens. What
each kind of row costs:

- greedy rows (``T == 0``): :func:`first_argmax`, one max pass over the vocabulary; a batch without a
  sampled row does nothing more;
- truncated rows (top-k or top-p): ``lax.top_k`` of ``CANDIDATES`` tokens, the thresholds found on that
  short list (:func:`_thresholds_on_list`), and Gumbel noise drawn only for the listed tokens
  (:func:`gumbel_at`: the values ``jax.random.gumbel`` gives those indices, bit for bit). A row whose kept
  set does not fit the list (top-p needing more tokens, ties at its end) falls back to the exact search
  below, alone;
- untruncated sampled rows, and the fallback: the noise over the whole vocabulary, one row at a time, with
  :func:`truncation_mask`'s bisection (32 halvings of an order-preserving integer image of the logits) where
  the row truncates.

Every path gives the tokens of the reference definition (Gumbel noise over the whole vocabulary, kept set
from a sort): only a probability mass that equals ``top_p`` to within float32 rounding can decide otherwise.
:func:`sample_with_logprobs` also returns each row's raw log-prob and entropy, from the same max pass and two
exp-and-sum passes; its ``greedy_only`` compiles none of the sampled paths (the engine's greedy program).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# NumPy constants: jnp ones would start the JAX backend at import time, before launchers can set up
# emulated devices or jax.distributed.
_SIGN_BIT = np.uint32(0x80000000)
_ARGMAX_BLOCK = 128  # vocabulary entries per block in first_argmax
#: Tokens listed per truncated row (``lax.top_k``): kept sets of up to ``CANDIDATES - 1`` tokens are
#: sampled from the list; larger ones (or ties reaching the list's end) fall back to the full search.
CANDIDATES = 128
_FLOAT_ONE_BITS = np.uint32(0x3F800000)  # the bits of float32 1.0


def _first_true(mask: jax.Array) -> jax.Array:
    """Index of the first True along the last axis (its length where none is)."""
    iota = jax.lax.broadcasted_iota(jnp.int32, mask.shape, mask.ndim - 1)
    return jnp.min(jnp.where(mask, iota, mask.shape[-1]), axis=-1)


def _blocks(x: jax.Array) -> jax.Array:
    """``x`` as ``[..., blocks, _ARGMAX_BLOCK]`` (-inf padding after the last entry never comes first)."""
    pad = -x.shape[-1] % _ARGMAX_BLOCK
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    return x.reshape(*x.shape[:-1], -1, _ARGMAX_BLOCK)


def _argmax_of_blocks(blocks: jax.Array, block_max: jax.Array, best: jax.Array) -> jax.Array:
    """First index of ``best`` (the maximum, ``[...]``) given the blocks and their maxima."""
    block = _first_true(block_max == best[..., None])
    entries = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]
    return block * _ARGMAX_BLOCK + _first_true(entries == best[..., None])


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of the first maximum along the last axis: int32, ``jnp.argmax(x, axis=-1)`` for NaN-free ``x``.

    ``jnp.argmax`` is a variadic (value, index) reduction, which XLA:CPU runs over 10x slower than a plain
    max. Here the only full pass is a max over blocks of ``_ARGMAX_BLOCK`` entries; then the first block
    holding the maximum and the first maximum inside that one block are found on small arrays.
    """
    blocks = _blocks(x)
    block_max = jnp.max(blocks, axis=-1)
    return _argmax_of_blocks(blocks, block_max, jnp.max(block_max, axis=-1))


def sortable_bits(x: jax.Array) -> jax.Array:
    """uint32 image of float32 ``x`` with the same order (``a < b`` iff their images are).

    Non-negative floats get the sign bit set; negative floats have all bits flipped (their magnitude order
    reverses). ``-inf`` maps below every finite value, ``-0.0`` just below ``+0.0``.
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
    Found by bisection over the whole vocabulary (64 passes); :func:`sample_tokens` runs it only for rows
    whose kept set does not fit its candidate list.

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


# ---- Gumbel noise of chosen vocabulary entries


def _gumbel_from_bits(bits: jax.Array) -> jax.Array:
    """``jax.random.gumbel``'s float32 transform of 32 random bits (its default, low-range mode)."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    floats = jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | _FLOAT_ONE_BITS, jnp.float32)
    uniform = jnp.maximum(tiny, (floats - np.float32(1.0)) * (np.float32(1.0) - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


def gumbel_at(keys: jax.Array, index: jax.Array) -> jax.Array:
    """Per row, ``jax.random.gumbel(keys[b], (V,))[index[b]]`` for any ``V > index``, drawing nothing else.

    JAX's partitionable threefry (its default) makes entry ``i`` of a draw the hash of the key and ``i``
    alone; this hashes only the requested entries. :func:`indexed_noise_matches` says whether this JAX
    draws that way.

    Args:
      keys: ``[B]`` typed threefry PRNG keys; index: int ``[B, L]``.

    Returns:
      float32 ``[B, L]``.
    """
    from jax.extend.random import threefry2x32_p

    data = jax.random.key_data(keys)  # uint32 [B, 2]
    shape = index.shape
    k1, k2 = (jnp.broadcast_to(data[:, i, None], shape) for i in (0, 1))
    high, low = jnp.zeros(shape, jnp.uint32), index.astype(jnp.uint32)
    bits1, bits2 = threefry2x32_p.bind(k1, k2, high, low)
    return _gumbel_from_bits(bits1 ^ bits2)


def indexed_noise_matches(keys: jax.Array) -> bool:
    """Whether :func:`gumbel_at` gives ``jax.random.gumbel``'s values for ``keys`` in this JAX: a threefry
    key, the partitionable threefry (JAX's default since 0.5) and the default low-range Gumbel transform
    (both are config flags a user can flip). The tests check the transform against ``jax.random.gumbel``.
    Without it, truncated rows draw the whole vocabulary's noise: the same tokens, more work."""
    return (str(jax.random.key_impl(keys)) == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)
            and not getattr(jax.config, "jax_use_high_dynamic_range_gumbel", False))


# ---- drawing


def _ordered(x: jax.Array) -> jax.Array:
    """int32 image of float32 ``x`` in :func:`sortable_bits`' order (signed, for max and compare)."""
    return jax.lax.bitcast_convert_type(sortable_bits(x) ^ _SIGN_BIT, jnp.int32)


def _thresholds_on_list(values, vocab: int, top_p, top_k, full_mass):
    """:func:`truncation_mask`'s thresholds found on each row's listed candidates.

    Top-k's threshold is the k-th largest image, top-p's the largest listed image whose tokens at or above
    it hold ``top_p`` of the top-k set's mass (the whole vocabulary's, ``full_mass`` = sum of
    ``exp(scaled - max)``, when top-k keeps all); both counts run over the list, which is exact for any
    threshold above ``bound``, the largest image an unlisted token can have. A row fits when its threshold
    is (and its top-k set, whose mass the top-p step needs, is listed whole).

    Args:
      values: ``lax.top_k``'s values of the scaled logits, ``[B, L]``.
      top_p: float32 ``[B]``; top_k: int32 ``[B]``; full_mass: float32 ``[B]``.

    Returns:
      (kept: bool ``[B, L]``, fits: bool ``[B]``).
    """
    floor = np.int32(np.iinfo(np.int32).min)
    keys = _ordered(values)
    last = values[:, -1]
    bound = _ordered(jnp.where(last == 0, np.float32(0), last))  # ties of -0.0 and +0.0: either is unlisted
    at_least = keys[:, None, :] >= keys[:, :, None]  # [B, j, i]: listed token i at or above listed token j
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    k_truncates = k < vocab
    k_cut = jnp.max(jnp.where(jnp.sum(at_least, axis=-1) >= k[:, None], keys, floor), axis=-1)
    k_cut = jnp.where(k_truncates, k_cut, floor)
    weights = jnp.where(keys >= k_cut[:, None], jnp.exp(values - values[:, :1]), np.float32(0))
    total = jnp.where(k_truncates, jnp.sum(weights, axis=-1), full_mass)
    probs = weights / total[:, None]
    mass = jnp.sum(jnp.where(at_least, probs[:, None, :], np.float32(0)), axis=-1)  # [B, j]
    p_cut = jnp.max(jnp.where(mass >= top_p[:, None], keys, floor), axis=-1)
    cut = jnp.maximum(k_cut, jnp.where(top_p >= 1.0, floor, p_cut))
    fits = (~k_truncates | (k_cut > bound)) & (cut > bound)
    return keys >= cut[:, None], fits


class Candidates(NamedTuple):
    """:func:`candidates`' result: per row, the ``L`` listed tokens (``index``, ``values``: ``lax.top_k`` of
    the scaled logits), which of them are kept (``kept``) and whether the kept set is listed whole
    (``fits``; where it is not, ``kept`` means nothing)."""

    index: jax.Array
    values: jax.Array
    kept: jax.Array
    fits: jax.Array


def candidates(scaled_logits: jax.Array, top_p: jax.Array, top_k: jax.Array) -> Candidates:
    """:func:`truncation_mask` on a list of each row's ``CANDIDATES`` largest scaled logits: one
    ``lax.top_k`` pass over the vocabulary (and one exp pass when some row has top-p without top-k)
    instead of 64. Rows that truncate nothing never fit.

    Args:
      scaled_logits: float32 ``[B, V]``; top_p: float32 ``[B]``; top_k: int32 ``[B]``.
    """
    rows, vocab = scaled_logits.shape
    values, index = jax.lax.top_k(scaled_logits, min(CANDIDATES, vocab))
    full_mass = jax.lax.cond(
        jnp.any((top_p < 1.0) & ((top_k <= 0) | (top_k >= vocab))),
        lambda: jnp.sum(jnp.exp(scaled_logits - values[:, :1]), axis=-1),
        lambda: jnp.ones((rows,), jnp.float32),
    )
    kept, fits = _thresholds_on_list(values, vocab, top_p, top_k, full_mass)
    return Candidates(index, values, kept, fits)


def _draw_listed(scaled, keys, top_p, top_k):
    """Rows' draws from their :func:`candidates`: (tokens int32 ``[B]``, fits bool ``[B]``: whether the
    token is right)."""
    vocab = scaled.shape[-1]
    index, values, kept, fits = candidates(scaled, top_p, top_k)
    if indexed_noise_matches(keys):
        noise = gumbel_at(keys, index)
    else:
        noise = jnp.take_along_axis(_noise(keys, vocab), index, axis=-1)
    noised = jnp.where(kept, values + noise, -jnp.inf)
    best = jnp.max(noised, axis=-1, keepdims=True)
    token = jnp.min(jnp.where(noised == best, index, vocab), axis=-1)  # the first maximum, as first_argmax
    return token, fits


def _noise(keys: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise over the whole vocabulary, one row per key: float32 ``[B, vocab]``."""
    return jax.vmap(lambda key: jax.random.gumbel(key, (vocab,), jnp.float32))(keys)


def _draw_in_full(scaled, keys, top_p, top_k, truncate, rows):
    """Draws of the rows flagged in ``rows`` with noise over the whole vocabulary (and the bisection of
    :func:`truncation_mask` where they truncate), one row at a time: int32 ``[B]``, 0 elsewhere."""
    batch, vocab = scaled.shape
    order = jnp.nonzero(rows, size=batch, fill_value=0)[0]

    def draw(i, tokens):
        r = order[i]
        row = jax.lax.dynamic_slice_in_dim(scaled, r, 1)
        kept = jax.lax.cond(truncate[r], lambda: truncation_mask(row, top_p[r, None], top_k[r, None]),
                            lambda: jnp.ones(row.shape, bool))
        noise = _noise(keys[r, None], vocab)
        return tokens.at[r].set(first_argmax(jnp.where(kept, row + noise, -jnp.inf))[0])

    return jax.lax.fori_loop(0, jnp.sum(rows), draw, jnp.zeros((batch,), jnp.int32))


def _draw(logits, keys, temperature, top_p, top_k, greedy):
    """The token of every row (module docstring); ``greedy`` is :func:`first_argmax` of ``logits``."""
    vocab = logits.shape[-1]
    sampled = temperature > 0
    truncate = sampled & ((top_p < 1.0) | ((top_k > 0) & (top_k < vocab)))

    def stochastic():
        scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
        # Rows that truncate nothing (greedy ones included) get settings that never fit the list.
        p, k = jnp.where(truncate, top_p, 1.0), jnp.where(truncate, top_k, 0)
        listed, fits = jax.lax.cond(jnp.any(truncate), lambda: _draw_listed(scaled, keys, p, k),
                                    lambda: (jnp.zeros_like(greedy), jnp.zeros(truncate.shape, bool)))
        in_full = sampled & ~fits
        drawn = _draw_in_full(scaled, keys, top_p, top_k, truncate, in_full)
        return jnp.where(fits, listed, jnp.where(in_full, drawn, greedy))

    return jax.lax.cond(jnp.any(sampled), stochastic, lambda: greedy)


def _checked(logits, keys, temperature, top_p, top_k):
    """The float32 logits, their blocks, block maxima and row maxima, after checking the shapes."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {logits.shape}")
    rows = logits.shape[0]
    for name, value in (("keys", keys), ("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value.shape != (rows,):
            raise ValueError(f"{name} must have shape ({rows},), got {value.shape}")
    logits = logits.astype(jnp.float32)
    blocks = _blocks(logits)
    # The barrier keeps XLA from rewriting the row maximum as a second pass over the blocks.
    block_max = jax.lax.optimization_barrier(jnp.max(blocks, axis=-1))
    return logits, blocks, block_max, jnp.max(block_max, axis=-1)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    top_k: jax.Array,
) -> jax.Array:
    """Draw one token per row.

    Row ``b`` is greedy (:func:`first_argmax`) when ``temperature[b] == 0``; otherwise it samples from
    ``softmax(logits[b] / temperature[b])`` restricted to :func:`truncation_mask` (by the Gumbel-max trick
    with ``jax.random.gumbel(keys[b], (V,))``, whatever path the module docstring gives the row). Work for
    sampled rows is skipped at run time when no row needs it (greedy batches cost one max pass).

    Args:
      logits: float32 ``[B, V]``.
      keys: ``[B]`` typed PRNG keys, one per row.
      temperature, top_p: float32 ``[B]``; top_k: int32 ``[B]``.

    Returns:
      int32 ``[B]`` token ids.
    """
    logits, blocks, block_max, best = _checked(logits, keys, temperature, top_p, top_k)
    greedy = _argmax_of_blocks(blocks, block_max, best)
    return _draw(logits, keys, temperature, top_p, top_k, greedy)


class Sampled(NamedTuple):
    """:func:`sample_with_logprobs`' result per row: the token, its raw log-prob
    ``log softmax(logits)[token]`` and the entropy of ``softmax(logits)`` (both of the untempered,
    untruncated policy)."""

    tokens: jax.Array
    logprobs: jax.Array
    entropies: jax.Array


def sample_with_logprobs(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: jax.Array,
                         top_k: jax.Array, *, greedy_only: bool = False) -> Sampled:
    """:func:`sample_tokens` with each token's raw log-prob and each row's entropy; ``greedy_only`` takes
    every row's :func:`first_argmax` (and compiles none of the sampling paths).

    The row maximum ``m`` comes from the greedy max pass; ``log Z = m + log sum(e)`` and ``H = log sum(e) -
    sum(e (l - m)) / sum(e)`` with ``e = exp(l - m)``, each sum one more pass.
    """
    logits, blocks, block_max, best = _checked(logits, keys, temperature, top_p, top_k)
    tokens = _argmax_of_blocks(blocks, block_max, best)
    if not greedy_only:
        tokens = _draw(logits, keys, temperature, top_p, top_k, tokens)
    # Both sums run over the [rows, blocks, 128] view (XLA:CPU splits those reductions across threads, a
    # flat row's not), each from the logits with its own exp: a shared ``l - m`` or exp would be written
    # out whole, then read twice. The second clips -inf logits to the lowest float first (exp gives 0, and
    # 0 * lowest is 0 where 0 * -inf is NaN).
    total = jnp.sum(jnp.exp(blocks - best[:, None, None]), axis=(1, 2))
    clipped = jnp.maximum(blocks, np.finfo(np.float32).min) - best[:, None, None]
    weighted = jnp.sum(jnp.exp(clipped) * clipped, axis=(1, 2))
    log_sum = jnp.log(total)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return Sampled(tokens, picked - (best + log_sum), log_sum - weighted / total)
