"""Exact numerics (``ModelConfig.numerics="exact"``): the engine's and the trainer's forward compute every
token's hidden states, logits and log-prob with the same programs, so the sampler's log-probs equal the
trainer's bit for bit.

Why the default programs differ: XLA:CPU picks a matmul's and a reduction's code by shape (a one-row product
takes a matrix-vector path, and Eigen's blocking of a product changes with its row count: measured 4e-6 apart
in float32 and 1e-3 in bfloat16 at ``[m, 512] @ [512, 1536]`` for m = 2..16 against m = 512), the paged decode
attention and the trainer's blockwise attention reduce over keys in other blocks, and the vocabulary softmax
is blocked by the token count.

What exact mode does instead, for every token alike, in the engine's ragged step and the trainer's packed
rows:

- every per-token computation (norms, projections, RoPE, MLP, final norm, logits, the log-prob) runs over
  tiles of :data:`TILE_ROWS` rows with :func:`tiled_rows`: the same shapes, hence the same code, whatever the
  batch, in a loop whose trip count XLA cannot see (so a one-tile loop is never inlined into its caller);
- attention is one routine (:func:`attend_tile`): each query reduces over the keys of its own sequence in
  blocks of :data:`KEY_BLOCK` positions from the sequence's first token, in order, with the online softmax;
  blocks past a query's position change nothing (every update is then an exact identity), so the engine may
  run more of them than the trainer; a row's result does not depend on the tile's row count (its products
  are batched over the rows, its key sum is :func:`_halving_sum`), so the trainer attends in tiles of
  :data:`ATTENTION_TILE_ROWS` rows, the engine in tiles of :data:`TILE_ROWS`;
- the log-prob and entropy come from ``logprobs.token_logprobs_and_entropy`` with a fixed vocabulary chunk
  (:data:`VOCAB_CHUNK`), tile by tile.

Only the forward values are exact: the gradients of :func:`tiled_rows` and :func:`packed_attention` are the
default numerics' (the row-wise function over all rows at once, ``attention.attention``), which cost what
the default backward costs.

The paged cache decides how its keys are gathered (``engine.paged_attention``); packed training rows gather
theirs with :func:`packed_attention`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rstar2jax.models.attention import attention
from rstar2jax.models.logprobs import einsum_logits, token_logprobs_and_entropy
from rstar2jax.models.segments import segment_starts

TILE_ROWS = 8
KEY_BLOCK = 32
VOCAB_CHUNK = 4096
# The trainer's attention tile: attend_tile's per-row results do not depend on its row count R (its products
# are batched over the rows; tested against the engine's TILE_ROWS), so the trainer runs fewer, larger tiles.
ATTENTION_TILE_ROWS = 128


def tiled_rows(fn: Callable, *arrays: jax.Array, tile: int = TILE_ROWS, consts: tuple = (),
               backward: Callable | None = None):
    """``fn(*consts, *tile_arrays)`` over row tiles: ``arrays`` (leading dim N each) padded with zeros to
    ``ceil(N / tile)`` tiles of ``tile`` rows, ``fn`` run on each in a loop, its outputs (a pytree of
    ``[tile, ...]`` arrays) put back together and cut to N rows.

    ``fn`` must be row-wise (row i of its outputs depends on row i of ``arrays`` and on ``consts`` only).
    Only the forward values are exact: the gradient is the VJP of ``backward`` (default ``fn``: the same
    computation, e.g. with XLA's products where ``fn`` calls a fixed-tile kernel) over all N rows at once
    (the default numerics' program, fast), so whatever is differentiated must come in through ``arrays`` or
    ``consts`` (a pytree, e.g. a layer's weights), not through a closure."""
    n = arrays[0].shape[0]
    if any(a.shape[0] != n for a in arrays):
        raise ValueError(f"tiled_rows: leading dims differ: {[a.shape for a in arrays]}")
    return _tiled_rows(fn, backward or fn, tile, consts, arrays)


def _tiles(arrays, tile: int):
    """``arrays`` padded with zero rows to whole tiles, ``[tiles, tile, ...]`` each."""
    n = arrays[0].shape[0]
    tiles = -(-n // tile)
    pad = tiles * tile - n
    return tuple(
        jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(tiles, tile, *a.shape[1:]) for a in arrays
    )


def _rows(out, n: int):
    """Tiled outputs ``[tiles, tile, ...]`` back to their first ``n`` rows."""
    return jax.tree.map(lambda o: o.reshape(o.shape[0] * o.shape[1], *o.shape[2:])[:n], out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tiled_rows(fn: Callable, backward: Callable, tile: int, consts, arrays):
    del backward
    tiled = _tiles(arrays, tile)
    tiles = tiled[0].shape[0]
    # A trip count XLA cannot see, so a single tile (a batch-1 decode step) runs the loop body that many tiles
    # run, never code XLA inlined into the caller and fused with its neighbours.
    count = jax.lax.optimization_barrier(jnp.int32(tiles))
    shapes = jax.eval_shape(lambda args: fn(*consts, *args), tuple(a[0] for a in tiled))

    def body(i, out):
        y = fn(*consts, *(a[i] for a in tiled))
        return jax.tree.map(lambda o, y: o.at[i].set(y), out, y)

    empty = jax.tree.map(lambda s: jnp.zeros((tiles, *s.shape), s.dtype), shapes)
    return _rows(jax.lax.fori_loop(0, count, body, empty), arrays[0].shape[0])


def _tiled_rows_fwd(fn, backward, tile, consts, arrays):
    return _tiled_rows(fn, backward, tile, consts, arrays), (consts, arrays)


def _tiled_rows_bwd(fn, backward, tile, residuals, cotangent):
    del fn, tile
    _, vjp = jax.vjp(lambda consts, arrays: backward(*consts, *arrays), *residuals)
    return vjp(cotangent)


_tiled_rows.defvjp(_tiled_rows_fwd, _tiled_rows_bwd)


def attend_tile(q: jax.Array, key_block: Callable, num_blocks, query_pos: jax.Array,
                num_kv_heads: int) -> jax.Array:
    """Causal attention of ``q`` ``[R, H, Dh]`` (scaled) over each row's own sequence.

    ``key_block(i)`` gives (keys, values) ``[R, KEY_BLOCK, K, Dh]`` of sequence positions ``i * KEY_BLOCK +
    j`` for each row; ``query_pos`` ``[R]`` is each query's position in its sequence (-1: padding, output
    0); keys after it are masked (their values zeroed: stale or poisoned pages cannot leak in).
    ``num_blocks``: an int (differentiable) or a traced count. Returns ``[R, H, Dh]`` in q's dtype."""
    R, H, Dh = q.shape
    K, S = num_kv_heads, KEY_BLOCK
    qg = q.reshape(R, K, H // K, Dh)
    floor = jnp.finfo(jnp.float32).min

    def body(i, carry):
        m, norm, acc = carry
        kb, vb = key_block(i)
        mask = (i * S + jnp.arange(S))[None, :] <= query_pos[:, None]  # [R, S]
        vb = jnp.where(mask[:, :, None, None], vb, 0).astype(q.dtype)
        s = jnp.einsum("rkgd,rskd->rkgs", qg, kb.astype(q.dtype), preferred_element_type=jnp.float32)
        seen = mask[:, None, None, :]
        s = jnp.where(seen, s, floor)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(seen, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        norm = norm * correction + _halving_sum(p)
        acc = acc * correction[..., None] + jnp.einsum(
            "rkgs,rskd->rkgd", p.astype(q.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, norm, acc

    shape = (R, K, H // K)
    init = (jnp.full(shape, floor, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, Dh), jnp.float32))
    _, norm, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)[..., None]
    return out.reshape(R, H, Dh).astype(q.dtype)


def _halving_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two long) by halving it: elementwise adds in one fixed order, so a
    row's sum does not depend on the number of rows (XLA:CPU's reduction does: the sums of 32 float32 values
    measured 5.7e-6 apart between 8 or 16 rows and 32 or more)."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """:func:`attend_tile` over packed rows: q ``[B, T, H, Dh]`` (scaled), k, v ``[B, T, K, Dh]``,
    ``segment_ids`` ``[B, T]`` or None (one sequence per row), as ``attention.attention`` takes them.

    Only the forward values are exact: the gradient is that of ``attention.attention(q, k, v, segment_ids)``
    (the default numerics' attention, ``"auto"``: fast)."""
    return _packed_attention(q, k, v, segment_ids)


@jax.custom_vjp
def _packed_attention(q, k, v, segment_ids):
    B, T, H, Dh = q.shape
    K, N = k.shape[2], B * T
    starts = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_starts(segment_ids)
    flat_start = (jnp.arange(B, dtype=jnp.int32)[:, None] * T + starts).reshape(N)
    query_pos = (jnp.arange(T, dtype=jnp.int32)[None, :] - starts).reshape(N)
    k_rows, v_rows = k.reshape(N, K, Dh), v.reshape(N, K, Dh)

    def tile(q, start, pos):
        def key_block(i):
            index = jnp.minimum(start[:, None] + i * KEY_BLOCK + jnp.arange(KEY_BLOCK), N - 1)
            return k_rows[index], v_rows[index]

        # Blocks past every query of the tile would change nothing: they are not run.
        return attend_tile(q, key_block, jnp.max(pos) // KEY_BLOCK + 1, pos, K)

    return tiled_rows(tile, q.reshape(N, H, Dh), flat_start, query_pos,
                      tile=ATTENTION_TILE_ROWS).reshape(B, T, H, Dh)


def _packed_attention_fwd(q, k, v, segment_ids):
    return _packed_attention(q, k, v, segment_ids), (q, k, v, segment_ids)


def _packed_attention_bwd(residuals, cotangent):
    q, k, v, segment_ids = residuals
    _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids), q, k, v)
    return (*vjp(cotangent), None)


_packed_attention.defvjp(_packed_attention_fwd, _packed_attention_bwd)


def token_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, head_layout: str,
                   temperature: float = 1.0, tile: int = TILE_ROWS,
                   product=einsum_logits) -> tuple[jax.Array, jax.Array]:
    """``logprobs.token_logprobs_and_entropy`` of ``hidden`` ``[N, D]`` and ``targets`` ``[N]`` by tiles of
    ``tile`` rows with a fixed vocabulary chunk, its logits by ``product``: (log-probs, entropies) float32
    ``[N]``, the same bits for a token whatever else is in the batch."""
    chunk = min(VOCAB_CHUNK, head.shape[0] if head_layout == "vd" else head.shape[1])
    def fn(head, h, t, product=product):
        return token_logprobs_and_entropy(h, head, t, temperature=temperature, head_layout=head_layout,
                                          chunk=chunk, product=product)

    return tiled_rows(fn, hidden, targets, tile=tile, consts=(head,),
                      backward=functools.partial(fn, product=einsum_logits))


def logits(hidden: jax.Array, head: jax.Array, head_layout: str, *, tile: int = TILE_ROWS,
           product=einsum_logits) -> jax.Array:
    """float32 ``[N, V]`` logits of ``hidden`` ``[N, D]`` by tiles of ``tile`` rows, each by ``product``
    (what the engine samples from)."""
    return tiled_rows(lambda head, h: product(h, head, head_layout == "vd"), hidden, tile=tile,
                      consts=(head,))
