"""Flash attention over packed causal rows as Pallas kernels lowered through Triton (NVIDIA and AMD GPUs).

Computes what ``models.attention`` defines: for query t of a row, with ``start(t)`` the first index of its
packed segment,

    out_t = sum_{s = start(t)}^{t} softmax_s(q_t . k_s) v_s,

by FlashAttention-2's recurrences, in base 2 (``x = (q . k) log2 e``): per query block, over the key blocks
it can see, ``m' = max(m, max_s x_s)``, ``l' = l 2^{m - m'} + sum_s 2^{x_s - m'}``,
``acc' = acc 2^{m - m'} + sum_s 2^{x_s - m'} v_s``; then ``out = acc / l`` and ``lse = m + log2 l`` (kept
for the backward). The backward recomputes ``P = 2^{x - lse}`` block by block: ``dV = P^T dO``,
``dS = P * (dO V^T - delta)`` with ``delta = rowsum(dO * O)``, ``dK = dS^T Q``, ``dQ = dS K``.

What the packing buys: a query block starts its key loop at the block holding its earliest segment start
(segment starts never decrease along a row), and a key block's dK/dV loop stops after the query block holding
the last segment end among its keys, so a row of short sequences costs about the sum of their squares rather
than the row's square. Grouped-query attention is native: the forward and dQ kernels read kv head
``h // G``; the dK/dV kernel runs per kv head and loops over its ``G`` query heads, so no repeated K/V or
per-query-head dK/dV is ever written.

Layout: q ``[B, T, H, D]`` (already scaled), k and v ``[B, T, K, D]``, the model's token-major layout;
``D`` a power of two >= 16 (Triton's tile constraint); ``T`` a multiple of every block (the caller pads).
``interpret=True`` runs the same kernels in Pallas' interpreter on any backend (the CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

try:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
except ImportError as error:  # a JAX without Pallas' Triton backend: these kernels are unavailable
    pl = plgpu = None
    IMPORT_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
    IMPORT_ERROR = None

_LOG2_E = math.log2(math.e)
# Masked scores: finite, so that a block whose keys a query cannot see gives 2^(masked - masked) rather than
# NaN; its probabilities are zeroed explicitly.
_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two, >= 16): forward query/key blocks, backward query/key blocks (the dQ and the
    dK/dV kernels share them), Triton warps per program (None: 8 for head dimensions above 64, else 4, as
    Triton's and JAX's flash attention choose) and software-pipelining stages."""

    forward_q: int = 128
    forward_k: int = 64
    backward_q: int = 64
    backward_k: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    @property
    def length_multiple(self) -> int:
        """Row lengths the kernels accept: multiples of this."""
        return max(self.forward_q, self.forward_k, self.backward_q, self.backward_k)


DEFAULT_BLOCKS = Blocks()


def head_dim_supported(head_dim: int) -> bool:
    """Whether the kernels take this head dimension (one Triton tile: a power of two from 16 to 256)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


# jax_default_matmul_precision values that ask float32 dots for full float32 (not TF32) inputs.
FULL_FLOAT32 = ("highest", "float32", "tensorfloat32_3x", "bfloat16_6x", "F32_F32_F32")


def _dot(a, b):
    """``a @ b`` accumulated in float32. Float32 inputs follow ``jax_default_matmul_precision`` as XLA's own
    dots do: TF32 by default on NVIDIA GPUs, full float32 under ``"highest"`` (what the tests pin)."""
    full = jax.config.jax_default_matmul_precision in FULL_FLOAT32
    return plgpu.dot(a, b, precision=lax.Precision.HIGHEST if full else None)


def _visible(q_pos, k_pos, q_starts):
    """[bq, bk] bool: key k_pos seen from query q_pos (causal, same segment)."""
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= q_starts[:, None])


def _probabilities(q, k, lse, visible):
    """P = 2^{(q . k) log2 e - lse}, zero where not visible: [bq, bk] float32."""
    scores = _dot(q, k.T) * _LOG2_E
    return jnp.where(visible, jnp.exp2(scores - lse[:, None]), 0.0)


def _forward_kernel(starts_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, block_q, block_k):
    i = pl.program_id(0)
    q = q_ref[...]
    q_pos = i * block_q + jnp.arange(block_q)
    q_starts = starts_ref[pl.ds(i * block_q, block_q)]

    def key_block(j, carry):
        acc, m, norm = carry
        k = k_ref[pl.ds(j * block_k, block_k), :]
        v = v_ref[pl.ds(j * block_k, block_k), :]
        visible = _visible(q_pos, j * block_k + jnp.arange(block_k), q_starts)
        scores = jnp.where(visible, _dot(q, k.T) * _LOG2_E, _MASKED)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        p = jnp.where(visible, jnp.exp2(scores - m_new[:, None]), 0.0)
        alpha = jnp.exp2(m - m_new)
        acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, alpha * norm + jnp.sum(p, axis=1)

    first = lax.div(jnp.min(q_starts), block_k)  # the key block of the block's earliest segment start
    last = lax.div((i + 1) * block_q + block_k - 1, block_k)  # causal: past the block's last query
    init = (
        jnp.zeros((block_q, q.shape[-1]), jnp.float32),
        jnp.full((block_q,), _MASKED, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    acc, m, norm = lax.fori_loop(first, last, key_block, init)
    out_ref[...] = (acc / norm[:, None]).astype(out_ref.dtype)
    lse_ref[...] = m + jnp.log2(norm)


def _dq_kernel(starts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block_q, block_k):
    i = pl.program_id(0)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = i * block_q + jnp.arange(block_q)
    q_starts = starts_ref[pl.ds(i * block_q, block_q)]

    def key_block(j, dq):
        k = k_ref[pl.ds(j * block_k, block_k), :]
        v = v_ref[pl.ds(j * block_k, block_k), :]
        p = _probabilities(q, k, lse, _visible(q_pos, j * block_k + jnp.arange(block_k), q_starts))
        d_scores = p * (_dot(do, v.T) - delta[:, None])
        return dq + _dot(d_scores.astype(k.dtype), k)

    first = lax.div(jnp.min(q_starts), block_k)
    last = lax.div((i + 1) * block_q + block_k - 1, block_k)
    dq = lax.fori_loop(first, last, key_block, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkdv_kernel(starts_ref, ends_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 block_q, block_k, groups, head_dim, seq_len):
    """One key block of one kv head: dK, dV summed over the kv head's ``groups`` query heads, whose q / dO
    columns ``[g D, (g + 1) D)`` and lse / delta entries ``[g T, (g + 1) T)`` the refs hold side by side."""
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * block_k + jnp.arange(block_k)
    first = lax.div(j * block_k, block_q)  # causal: earlier queries see none of these keys
    # Queries past the end of the segment holding this block's last key see none of them either.
    last = lax.div(jnp.max(ends_ref[pl.ds(j * block_k, block_k)]), block_q) + 1
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for g in range(groups):

        def query_block(i, carry, g=g):
            dk, dv = carry
            rows, columns = pl.ds(i * block_q, block_q), pl.ds(g * head_dim, head_dim)
            q, do = q_ref[rows, columns], do_ref[rows, columns]
            lse = lse_ref[pl.ds(g * seq_len + i * block_q, block_q)]
            delta = delta_ref[pl.ds(g * seq_len + i * block_q, block_q)]
            q_pos = i * block_q + jnp.arange(block_q)
            p = _probabilities(q, k, lse, _visible(q_pos, k_pos, starts_ref[rows]))
            dv = dv + _dot(p.astype(do.dtype).T, do)
            d_scores = p * (_dot(do, v.T) - delta[:, None])
            return dk + _dot(d_scores.astype(q.dtype).T, q), dv

        dk, dv = lax.fori_loop(first, last, query_block, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(blocks: Blocks, head_dim: int):
    num_warps = blocks.num_warps or (8 if head_dim > 64 else 4)
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=blocks.num_stages)


def _forward(q, k, v, starts, blocks: Blocks, interpret: bool):
    B, T, H, D = q.shape
    G = H // k.shape[2]
    bq, bk = blocks.forward_q, blocks.forward_k
    row = pl.BlockSpec((None, T), lambda i, b, h: (b, 0))
    q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    kv_row = pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, block_q=bq, block_k=bk),
        grid=(T // bq, B, H),
        in_specs=[row, q_block, kv_row, kv_row],
        out_specs=[q_block, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        compiler_params=_params(blocks, D),
        interpret=interpret,
        name="packed_flash_attention_forward",
    )(starts, q, k, v)
    return out, lse


def _backward(q, k, v, starts, ends, out, lse, d_out, blocks: Blocks, interpret: bool):
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    bq, bk = blocks.backward_q, blocks.backward_k
    # delta = rowsum(dO * O), [B, H, T] like lse.
    delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    row = pl.BlockSpec((None, T), lambda i, b, h: (b, 0))
    q_block = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    kv_row = pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    stats_block = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_q=bq, block_k=bk),
        grid=(T // bq, B, H),
        in_specs=[row, q_block, kv_row, kv_row, q_block, stats_block, stats_block],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(blocks, D),
        interpret=interpret,
        name="packed_flash_attention_dq",
    )(starts, q, k, v, d_out, lse, delta)

    # Per kv head: its G query heads' columns side by side ([B, T, K, G D]) and their statistics
    # ([B, K, G T]); both reshapes are free.
    group_rows = pl.BlockSpec((None, T, None, G * D), lambda j, b, kh: (b, 0, kh, 0))
    group_stats = pl.BlockSpec((None, None, G * T), lambda j, b, kh: (b, kh, 0))
    kv_block = pl.BlockSpec((None, bk, None, D), lambda j, b, kh: (b, j, kh, 0))
    key_row = pl.BlockSpec((None, T), lambda j, b, kh: (b, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=bq, block_k=bk, groups=G, head_dim=D, seq_len=T),
        grid=(T // bk, B, K),
        in_specs=[key_row, key_row, group_rows, kv_block, kv_block, group_rows, group_stats, group_stats],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(blocks, D),
        interpret=interpret,
        name="packed_flash_attention_dkdv",
    )(
        starts,
        ends,
        q.reshape(B, T, K, G * D),
        k,
        v,
        d_out.reshape(B, T, K, G * D),
        lse.reshape(B, K, G * T),
        delta.reshape(B, K, G * T),
    )
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, starts, ends, blocks, interpret):
    return _forward(q, k, v, starts, blocks, interpret)[0]


def _flash_fwd(q, k, v, starts, ends, blocks, interpret):
    out, lse = _forward(q, k, v, starts, blocks, interpret)
    return out, (q, k, v, starts, ends, out, lse)


def _flash_bwd(blocks, interpret, residuals, d_out):
    q, k, v, starts, ends, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, starts, ends, out, lse, d_out, blocks, interpret)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array, ends: jax.Array, *,
                    blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False) -> jax.Array:
    """Causal attention within packed segments (see the module doc), differentiable in q, k, v.

    Args:
      q: ``[B, T, H, D]``, already scaled; k, v: ``[B, T, K, D]``, ``H`` a multiple of ``K``.
      starts: int32 ``[B, T]``, the first index of each token's segment (non-decreasing along a row).
      ends: int32 ``[B, T]``, the last index of each token's segment.
      blocks: tile sizes; ``T`` must be a multiple of ``blocks.length_multiple``.
      interpret: run in Pallas' interpreter (any backend; slow).
    """
    B, T, H, D = q.shape
    if not head_dim_supported(D):
        raise ValueError(f"flash_attention: head dimension {D} is not a power of two in [16, 256]")
    if T % blocks.length_multiple:
        raise ValueError(f"flash_attention: length {T} is not a multiple of {blocks.length_multiple}")
    return _flash(q, k, v, starts.astype(jnp.int32), ends.astype(jnp.int32), blocks, interpret)
