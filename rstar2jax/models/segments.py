"""Packed rows: where each token's sequence starts and ends in its row.

A packed row holds several sequences as contiguous runs of one segment id (``data.packing`` lays them out;
padding, id 0, at a row's end is a run of its own). Attention, the loss normalisers and the per-sequence
sums read the runs through these two index maps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """``start(t)``: int32 ``[B, T]`` index of the first token of the run of equal ids holding t."""
    T = segment_ids.shape[-1]
    index = jnp.arange(T, dtype=jnp.int32)
    changed = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return jax.lax.cummax(jnp.where(changed, index, 0), axis=1)


def segment_ends(starts: jax.Array) -> jax.Array:
    """int32 ``[B, T]``: the last index of the run holding t, from :func:`segment_starts`' output (or from
    the segment ids themselves: equal runs, equal ends)."""
    T = starts.shape[-1]
    return T - 1 - segment_starts(starts[:, ::-1])[:, ::-1]
