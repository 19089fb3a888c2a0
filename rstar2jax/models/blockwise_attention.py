"""Blockwise (online-softmax) causal attention over packed rows, written with XLA ops: FlashAttention-2's
recurrences as a ``jax.custom_vjp`` whose backward recomputes the scores block by block, so forward and
backward memory are linear in T. Key blocks before a query block's earliest segment start, and after the query
block (causal), are skipped. The portable ``"blockwise"`` implementation of :mod:`rstar2jax.models.attention`.

Token-major layout throughout (q [B, T, K, G, D], k and v [B, T, K, D]): blocks are slices along T and results
are written into whole-sequence buffers in place, so no transposed copy of a [T, H, D] array is made. Scores
of a block pair are [B, K, G, bq, bk].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["blockwise_attention"]

# Masked scores: finite, so a block whose scores are all masked gives exp(masked - max) = 1 rather than NaN;
# such entries are zeroed explicitly.
_MASKED = -1e30


def _block_mask(i, j, block, starts_i):
    """[B, 1, 1, bq, bk] bool: key j*block + s visible from query i*block + t (causal, same segment)."""
    q_pos = i * block + jnp.arange(block)
    k_pos = j * block + jnp.arange(block)
    causal = k_pos[None, :] <= q_pos[:, None]
    return (causal[None] & (k_pos[None, None, :] >= starts_i[:, :, None]))[:, None, None]


def _slice(x, i, block):
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)


def _update(x, value, i, block):
    return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), i * block, axis=1)


def _first_key_blocks(starts, block):
    """Per query block, the first key block any of its queries sees (segment starts never decrease)."""
    B, T = starts.shape
    return jnp.min(starts.reshape(B, T // block, block), axis=(0, 2)) // block


def _blockwise_forward(q, k, v, starts, block):
    B, T, K, G, D = q.shape
    first = _first_key_blocks(starts, block)

    def query_block(i, outputs):
        out, lse = outputs
        q_i = _slice(q, i, block)
        starts_i = _slice(starts, i, block)

        def key_block(j, carry):
            m, denom, acc = carry
            k_j, v_j = _slice(k, j, block), _slice(v, j, block)
            s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
            mask = _block_mask(i, j, block, starts_i)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASKED), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            denom = alpha * denom + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32)
            return m_new, denom, alpha[..., None] * acc + pv

        init = (
            jnp.full((B, K, G, block), _MASKED, jnp.float32),
            jnp.zeros((B, K, G, block), jnp.float32),
            jnp.zeros((B, K, G, block, D), jnp.float32),
        )
        m, denom, acc = jax.lax.fori_loop(first[i], i + 1, key_block, init)
        out_i = jnp.moveaxis(acc / denom[..., None], 3, 1)  # [B, bq, K, G, D]
        return _update(out, out_i, i, block), _update(lse, jnp.moveaxis(m + jnp.log(denom), 3, 1), i, block)

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:-1], jnp.float32))
    return jax.lax.fori_loop(0, T // block, query_block, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blockwise_core(q, k, v, starts, block):
    return _blockwise_forward(q, k, v, starts, block)[0]


def _blockwise_fwd(q, k, v, starts, block):
    out, lse = _blockwise_forward(q, k, v, starts, block)
    return out, (q, k, v, starts, out, lse)


def _blockwise_bwd(block, residuals, d_out):
    """FlashAttention-2's backward: per key block j, over the query blocks that see it,
    P = exp(S - lse), dV_j += P^T dO, dS = P * (dO V_j^T - rowsum(dO * O)), dK_j += dS^T Q, dQ += dS K_j."""
    q, k, v, starts, out, lse = residuals
    B, T, K, G, D = q.shape
    first = _first_key_blocks(starts, block)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, K, G]

    def key_block(j, grads):
        d_q, d_k, d_v = grads
        k_j, v_j = _slice(k, j, block), _slice(v, j, block)
        # Query blocks whose earliest segment start lies at or before this key block may see it.
        last = jnp.sum(first <= j)

        def query_block(i, carry):
            d_q, d_k_j, d_v_j = carry
            q_i, do_i = _slice(q, i, block), _slice(d_out, i, block)
            lse_i = jnp.moveaxis(_slice(lse, i, block), 1, 3)  # [B, K, G, bq]
            delta_i = jnp.moveaxis(_slice(delta, i, block), 1, 3)
            s = jnp.einsum("bqkgd,bskd->bkgqs", q_i, k_j, preferred_element_type=jnp.float32)
            mask = _block_mask(i, j, block, _slice(starts, i, block))
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            d_v_j = d_v_j + jnp.einsum("bkgqs,bqkgd->bskd", p, do_i, preferred_element_type=jnp.float32)
            d_p = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            d_s = p * (d_p - delta_i[..., None])
            d_k_j = d_k_j + jnp.einsum("bkgqs,bqkgd->bskd", d_s, q_i, preferred_element_type=jnp.float32)
            d_q_i = _slice(d_q, i, block) + jnp.einsum(
                "bkgqs,bskd->bqkgd", d_s, k_j, preferred_element_type=jnp.float32
            )
            return _update(d_q, d_q_i, i, block), d_k_j, d_v_j

        zeros = jnp.zeros((B, block, K, D), jnp.float32)
        d_q, d_k_j, d_v_j = jax.lax.fori_loop(j, last, query_block, (d_q, zeros, zeros))
        return d_q, _update(d_k, d_k_j, j, block), _update(d_v, d_v_j, j, block)

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype))
    d_q, d_k, d_v = jax.lax.fori_loop(0, T // block, key_block, init)
    return d_q.astype(q.dtype), d_k, d_v, None


_blockwise_core.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, starts, block_size: int):
    """Attention of ``q [B, T, H, D]`` over ``k``, ``v [B, T, K, D]`` where query t sees keys
    ``starts[b, t] <= s <= t``, in blocks of at most ``block_size`` (rows padded to a whole block)."""
    B, T, H, D = q.shape
    K = k.shape[2]
    block = min(block_size, -(-T // 8) * 8)
    padded = -(-T // block) * block
    if padded != T:  # padding queries attend to themselves only (start = own index)
        pad = ((0, 0), (0, padded - T), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        starts = jnp.concatenate(
            [starts, jnp.broadcast_to(jnp.arange(T, padded, dtype=starts.dtype), (B, padded - T))], axis=1
        )
    out = _blockwise_core(q.reshape(B, padded, K, H // K, D), k, v, starts, block)
    return out.reshape(B, padded, H, D)[:, :T]
