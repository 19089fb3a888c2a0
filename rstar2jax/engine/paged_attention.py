"""Paged KV cache stacked over layers, and ragged attention over it.

The pool holds ``num_pages`` pages of ``page_size`` tokens for every layer in one buffer per keys and values:
``k``, ``v``: ``[num_kv_heads, num_layers, num_pages, page_size, head_dim]``. The layer loop (a ``lax.scan``
or unrolled) carries the whole pool and writes and gathers it at its layer index: no per-layer slice of it
is ever copied. A sequence owns a row of a page table: its token at position ``p`` lives in page
``page_table[p // page_size]`` at offset ``p % page_size``. Page 0 is the *null page*: never allocated, it
stands for "no page" in page tables (its content is never read into an output).

A step feeds a flat batch of T tokens of any mix of sequences (:class:`RaggedBatch`): decode tokens, prefill
chunks, appended tool outputs, each with its own page-table row and position. At every layer all T tokens'
keys/values are written into their pages first; then each token attends by position to the keys/values of
positions ``0..p`` of its own sequence::

    out = sum_j softmax_j(q . k_j) v_j,   j <= p,

through one of two views of the batch: ``R1`` single-query rows (decode tokens, short runs), and ``R2`` tiles
of ``prefill_tile`` consecutive tokens of one sequence (prefill chunks), so that a long chunk reads its
sequence's pages once per tile rather than once per token. Each view is computed block by block over the page
table with the online softmax (running max ``m``, normaliser ``l``, accumulator ``acc``; per block
``m' = max(m, max_j s_j)``, ``l' = l e^{m - m'} + sum_j e^{s_j - m'}``, ``acc' = acc e^{m - m'} +
sum_j e^{s_j - m'} v_j``, ``out = acc / l``), for ``ceil((max_b p_b + 1) / block_tokens)`` blocks: data, not
shape, so a step costs the longest sequence in it (0 blocks for an empty view), not the engine's ``max_len``.
:func:`paged_attention_reference` is that loop in plain ``jnp`` (every backend; the tested ground truth). On
CUDA GPUs the single-query rows use JAX's maintained Pallas/Triton kernel
``jax.experimental.pallas.ops.gpu.paged_attention`` on the whole stacked pool (the layer's pages addressed by
offsetting the page ids by ``layer * num_pages``), tested against the reference on CPU in Pallas interpret
mode. tokamax 0.0.12 was checked: its attention API takes a ``PagingInfo`` but every kernel of it raises
``NotImplementedError`` for paging, so it offers no paged kernel to select.

FP8 pages (``EngineConfig.kv_dtype="fp8"``): ``k``, ``v`` are float8_e4m3fn and ``k_scale``, ``v_scale``
``[K, L, P, page_size]`` (bfloat16) hold a power-of-two scale per head for each token slot of a page::

    s = 2^ceil(log2(max_d |x_d| / 448)),   q_d = round_e4m3(x_d / s),   x^_d = q_d s

(``x``: one token's key or value of one head, ``d`` over ``head_dim``). Each token is quantized once, when its
key/value is written, from its own maximum: a page filled token by token never requantizes what it holds
(no double rounding, no rewrite of the page), prefill and decode write alike, and a page copied for a fork
or attached from the prefix cache carries its scales with it (they live in the page's slots). Error bound,
per element: ``|x^_d - x_d| <= max(2^-4 |x_d|, 2^-10 s) <= max(2^-4 |x_d|, max_d |x_d| / 229376)``. The
scales cost 2 bytes per token, head and layer beside ``head_dim`` bytes of values: a pool of fixed bytes holds
``2 Dh / (Dh + 2)`` times the tokens of a bfloat16 pool (1.97 at ``Dh`` = 128). Attention folds the scales
into the scores and probabilities (``s_j = (q . k_j) s^k_j``, ``acc += (p_j s^v_j) v_j``), which is how
the Pallas kernel reads them too (its ``k_scales_pages`` / ``v_scales_pages``, per token slot). A per-page
scale would need requantizing the page whenever a later token raised its maximum, and the kernel would need
it broadcast to every slot of the whole pool at every layer.
"""

from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp

from rstar2jax.models import ModelConfig, exact, exact_kernels
from rstar2jax.models.attention import resolve_attention
from rstar2jax.models.config import FP8, attention_name
from rstar2jax.models.platform import pallas_interpreted
from rstar2jax.models.quantization import FP8_DTYPE, KV_SCALE_DTYPE, dequantize_kv, quantize_kv

NULL_PAGE = 0


@flax.struct.dataclass
class PagedKV:
    """The page pool: ``k``, ``v``: ``[num_kv_heads, num_layers, num_pages, page_size, head_dim]``; for FP8
    pages also ``k_scale``, ``v_scale``: ``[num_kv_heads, num_layers, num_pages, page_size]`` (module
    docstring). Every leaf has the pages on axis 2, so a page is copied or poisoned leaf by leaf."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def num_layers(self) -> int:
        return self.k.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes_per_page(self) -> int:
        """Bytes one page holds over all layers, keys and values (and their scales)."""
        leaves = jax.tree.leaves(self)
        return sum(jnp.dtype(x.dtype).itemsize * math.prod(x.shape) for x in leaves) // self.num_pages

    def write(self, layer, page: jax.Array, offset: jax.Array, k: jax.Array, v: jax.Array) -> PagedKV:
        """The pool with ``k``, ``v`` (``[T, K, Dh]``, one token per row) written at ``layer`` into
        ``page[t]`` at ``offset[t]`` (a page of ``num_pages``: dropped); FP8 pages quantize each token."""
        put = lambda pool, x: pool.at[:, layer, page, offset].set(
            jnp.swapaxes(x, 0, 1).astype(pool.dtype), mode="drop")
        if not self.quantized:
            return PagedKV(k=put(self.k, k), v=put(self.v, v))
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        return PagedKV(k=put(self.k, kq), v=put(self.v, vq), k_scale=put(self.k_scale, ks),
                       v_scale=put(self.v_scale, vs))


def pool_shape(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int):
    return (num_kv_heads, num_layers, num_pages, page_size, head_dim)


def init_pages(shape: tuple[int, ...], kv_dtype) -> PagedKV:
    """An all-zero pool of :func:`pool_shape` ``shape``: ``kv_dtype`` a float dtype, or ``"fp8"``."""
    if kv_dtype != FP8:
        return PagedKV(k=jnp.zeros(shape, kv_dtype), v=jnp.zeros(shape, kv_dtype))
    values, scales = lambda: jnp.zeros(shape, FP8_DTYPE), lambda: jnp.zeros(shape[:-1], KV_SCALE_DTYPE)
    return PagedKV(k=values(), v=values(), k_scale=scales(), v_scale=scales())


def kv_bytes_per_token(config: ModelConfig, kv_dtype=None) -> int:
    """Bytes of one token's keys and values over all layers: ``2 L K Dh itemsize``, or for FP8 pages
    ``2 L K (Dh + 2)`` (a byte per element and a bfloat16 scale per head)."""
    L, K, Dh = config.num_layers, config.num_kv_heads, config.head_dim
    if kv_dtype == FP8:
        return 2 * L * K * (Dh * jnp.dtype(FP8_DTYPE).itemsize + jnp.dtype(KV_SCALE_DTYPE).itemsize)
    return 2 * L * K * Dh * jnp.dtype(kv_dtype or config.compute_dtype).itemsize


def pages_for_bytes(num_bytes: float, config: ModelConfig, *, page_size: int, kv_dtype=None) -> int:
    """Pages of ``page_size`` tokens that ``num_bytes`` of pool hold (the ``EngineConfig.num_pages`` of a
    pool sized in bytes): an FP8 pool holds about twice a bfloat16 one's."""
    return int(num_bytes) // (page_size * kv_bytes_per_token(config, kv_dtype))


def decode_attention(impl: str, kv_dtype=None) -> str:
    """The paged decode attention that runs for ``impl`` (``models.attention.resolve_attention`` for
    decoding: ``"auto"`` is the Pallas kernel on a CUDA GPU, blockwise elsewhere). With FP8 pages
    (``kv_dtype="fp8"``) the Pallas kernel is used only where it compiles for float8 pages
    (:func:`pallas_reads_fp8`): ``"auto"`` falls back to ``"blockwise"``, an explicit ``"pallas_triton"``
    raises ValueError naming it (``EngineConfig`` refuses implementations that cannot read FP8 pages)."""
    resolved = resolve_attention(impl, use="decoding")
    if kv_dtype == FP8 and resolved == "pallas_triton" and not pallas_reads_fp8():
        if attention_name(impl, "decoding") == "auto":
            return "blockwise"
        raise ValueError(f"attention={impl!r} cannot read FP8 KV pages on {jax.devices()[0].device_kind}: "
                         "the Pallas kernel does not compile for float8 pages there; use "
                         "attention='blockwise', or KV pages in the compute dtype")
    return resolved


@functools.cache
def pallas_reads_fp8() -> bool:
    """Whether the Pallas GPU decode kernel compiles for FP8 pages on the default device (tried once)."""
    pool = jax.ShapeDtypeStruct((1, 1, 2, 16, 64), FP8_DTYPE)
    scale = jax.ShapeDtypeStruct((1, 1, 2, 16), KV_SCALE_DTYPE)
    q = jax.ShapeDtypeStruct((1, 1, 16, 64), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    attend = lambda q, k, v, ks, vs, table, positions: paged_decode_attention_pallas(
        q, k, v, 0, table, positions, k_scale=ks, v_scale=vs, interpret=pallas_interpreted())
    try:
        jax.jit(attend).lower(q, pool, pool, scale, scale, rows, rows).compile()
        return True
    except Exception:  # noqa: BLE001 - whatever stops it compiling, the kernel cannot serve FP8 pages here
        return False


def paged_attention_reference(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                              page_table: jax.Array, positions: jax.Array, *,
                              block_pages: int = 16, k_scale: jax.Array | None = None,
                              v_scale: jax.Array | None = None) -> jax.Array:
    """Causal attention of rows of queries at ``positions`` over the pages of their rows (module docstring).

    Args:
      q: ``[R, n, H, Dh]``: R rows of n queries each (a row's queries belong to one sequence), already
        scaled.
      k_pool, v_pool: ``[K, L, P, page_size, Dh]`` the stacked pool; query head ``h`` reads kv head
        ``h // (H // K)``.
      layer: the layer whose pages are read (an int or a traced int32 scalar).
      page_table: int32 ``[R, max_pages]``: each row's page-table row.
      positions: int32 ``[R, n]``: each query's position; -1 for padding (its output is 0).
      block_pages: pages per block of the online softmax.
      k_scale, v_scale: ``[K, L, P, page_size]`` the scales of FP8 pools (module docstring), or None.

    Returns:
      ``[R, n, H, Dh]`` in ``q.dtype``. Keys after a row's last query position are never read into the sums
      (values there are zeroed, so stale or poisoned pages beyond a sequence cannot leak in).
    """
    R, n, H, Dh = q.shape
    K, _, _, page_size, _ = k_pool.shape
    G = H // K
    max_pages = page_table.shape[1]
    block_pages = min(block_pages, max_pages)
    pad = -max_pages % block_pages
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)), constant_values=NULL_PAGE)
    block_tokens = block_pages * page_size
    # [K, R, n * G, Dh]: batched over (kv head, row), the row's queries of the head group as matrix rows.
    qg = jnp.transpose(q.reshape(R, n, K, G, Dh), (2, 0, 1, 3, 4)).reshape(K, R, n * G, Dh)
    query_pos = jnp.repeat(positions, G, axis=1)  # [R, n * G], in qg's row order
    last = jnp.max(positions, axis=1)  # [R]: keys past it are read by no query of the row
    num_blocks = (jnp.max(last) + block_tokens) // block_tokens  # 0 when every query is padding
    floor = jnp.finfo(jnp.float32).min

    def body(i, carry):
        m, norm, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(page_table, i * block_pages, block_pages, axis=1)  # [R, bp]
        kb = k_pool[:, layer, ids].reshape(K, R, block_tokens, Dh)  # one gather from the stacked pool
        vb = v_pool[:, layer, ids].reshape(K, R, block_tokens, Dh)
        key_pos = i * block_tokens + jnp.arange(block_tokens)
        readable = (key_pos[None, :] <= last[:, None])[None]  # [1, R, S]
        vb = jnp.where(readable[..., None], vb, 0).astype(q.dtype)
        s = jnp.einsum("krqd,krsd->krqs", qg, kb.astype(q.dtype), preferred_element_type=jnp.float32)
        mask = (key_pos[None, None, :] <= query_pos[:, :, None])[None]  # [1, R, nG, S]
        # FP8 pages: the scales multiply scores and probabilities, per key (zero past the row's end).
        scales = lambda pool: jnp.where(readable, pool[:, layer, ids].reshape(K, R, block_tokens), 0)[
            :, :, None, :].astype(jnp.float32)
        if k_scale is not None:
            s = s * scales(k_scale)
        s = jnp.where(mask, s, floor)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        norm = norm * correction + jnp.sum(p, axis=-1)
        weights = p if v_scale is None else p * scales(v_scale)
        acc = acc * correction[..., None] + jnp.einsum(
            "krqs,krsd->krqd", weights.astype(q.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, norm, acc

    init = (jnp.full((K, R, n * G), floor, jnp.float32), jnp.zeros((K, R, n * G), jnp.float32),
            jnp.zeros((K, R, n * G, Dh), jnp.float32))
    _, norm, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)[..., None]
    out = jnp.transpose(out.reshape(K, R, n, G, Dh), (1, 2, 0, 3, 4))
    return out.reshape(R, n, H, Dh).astype(q.dtype)


def _kernel_blocking(max_pages: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) that divide the page table as the Pallas kernel requires."""
    k_splits = math.gcd(max_pages, 16)
    return k_splits, math.gcd(max_pages // k_splits, 8)


def paged_decode_attention_pallas(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, layer,
                                  page_table: jax.Array, positions: jax.Array, *,
                                  interpret: bool = False, k_scale: jax.Array | None = None,
                                  v_scale: jax.Array | None = None) -> jax.Array:
    """:func:`paged_attention_reference` for one query per row (``n == 1``) with JAX's Pallas GPU kernel.

    The kernel gets the whole stacked pool as ``[K, L * P, page_size, Dh]`` (a free reshape) and the row's
    page ids offset by ``layer * P``, so no layer slice of the pool is made. Row ``b`` reads the
    ``ceil((positions[b] + 1) / page_size)`` pages it holds; padding rows (position -1) read none and give
    0. ``interpret=True`` runs the kernel in the Pallas interpreter (any backend: tests). FP8 pools go to
    the kernel as they are, with their per-slot scales (``k_scale``, ``v_scale`` ``[K, L, P, page_size]``).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as kernel  # GPU-only import chain

    R, n, H, Dh = q.shape
    if n != 1:
        raise ValueError(f"the Pallas paged kernel decodes one query per row, got {n}")
    K, L, P, page_size, _ = k_pool.shape
    k_splits, per_block = _kernel_blocking(page_table.shape[1])
    if k_scale is None:
        flat = lambda pool: pool.reshape(K, L * P, page_size, Dh).astype(q.dtype)
        scales = {}
    else:  # the kernel casts float8 blocks to the query's dtype itself, after the scales
        flat = lambda pool: pool.reshape(K, L * P, page_size, Dh)
        scales = dict(k_scales_pages=k_scale.reshape(K, L * P, page_size),
                      v_scales_pages=v_scale.reshape(K, L * P, page_size))
    out = kernel.paged_attention(
        q[:, 0], flat(k_pool), flat(v_pool), (page_table + layer * P).astype(jnp.int32),
        (positions[:, 0] + 1).astype(jnp.int32), **scales, k_splits=k_splits,
        pages_per_compute_block=per_block, interpret=interpret)
    return out[:, None]


@flax.struct.dataclass
class RaggedBatch:
    """Where a step's T flat tokens go and how they are grouped for attention (computed once per step).

    Attributes:
      token_page, token_offset: int32 ``[T]``: the page and offset each token's key/value is written to
        (``num_pages`` for a token that writes nothing: padding, a decode row that cannot run).
      row_token: int32 ``[R1]``: the flat token of each single-query row (T: padding).
      row_positions: int32 ``[R1, 1]``: its position (-1: padding).
      row_pages: int32 ``[R1, max_pages]``: its sequence's page-table row.
      tile_token: int32 ``[R2, Q]``: the flat tokens of each tile, consecutive positions of one sequence
        (T: padding).
      tile_positions: int32 ``[R2, Q]`` (-1: padding); tile_pages: int32 ``[R2, max_pages]``.
    """

    token_page: jax.Array
    token_offset: jax.Array
    row_token: jax.Array
    row_positions: jax.Array
    row_pages: jax.Array
    tile_token: jax.Array
    tile_positions: jax.Array
    tile_pages: jax.Array


@flax.struct.dataclass
class PagedCacheView:
    """What :func:`rstar2jax.models.forward_hidden` takes as its ``cache`` to run a ragged batch (``tokens``
    ``[1, T]``) on the page pool: the pool and the batch's :class:`RaggedBatch`.

    The layer loop calls :meth:`write_and_attend` once per layer (with a traced layer index under
    ``lax.scan``) and carries the view with the updated pool.
    """

    pages: PagedKV
    batch: RaggedBatch
    attention: str = flax.struct.field(pytree_node=False, default="blockwise")
    block_pages: int = flax.struct.field(pytree_node=False, default=16)
    # With attention="exact": what computes it (models.exact_kernels.resolve: "xla" or "pallas_triton").
    exact_kernels: str = flax.struct.field(pytree_node=False, default="xla")

    def write_and_attend(self, layer, q: jax.Array, k: jax.Array, v: jax.Array):
        """Scatter the batch's keys/values (``[1, T, K, Dh]``) into their pages at ``layer``, then attend
        (``q``: ``[1, T, H, Dh]``, scaled) through both views. Returns (``[1, T, H, Dh]``, updated view)."""
        batch = self.batch
        pages = self.pages.write(layer, batch.token_page, batch.token_offset, k[0], v[0])
        scales = dict(k_scale=pages.k_scale, v_scale=pages.v_scale)
        q = q[0]  # [T, H, Dh]
        if self.attention == "exact":
            return (paged_exact_attention(q, pages, layer, batch, self.exact_kernels)[None],
                    self.replace(pages=pages))
        rows_q = q.at[batch.row_token].get(mode="fill", fill_value=0)[:, None]  # [R1, 1, H, Dh]
        if self.attention == "pallas_triton":
            rows = paged_decode_attention_pallas(rows_q, pages.k, pages.v, layer, batch.row_pages,
                                                 batch.row_positions, interpret=pallas_interpreted(),
                                                 **scales)
        else:
            rows = paged_attention_reference(rows_q, pages.k, pages.v, layer, batch.row_pages,
                                             batch.row_positions, block_pages=self.block_pages, **scales)
        out = jnp.zeros_like(q).at[batch.row_token].set(rows[:, 0], mode="drop")
        if batch.tile_token.shape[0]:
            tiles_q = q.at[batch.tile_token].get(mode="fill", fill_value=0)  # [R2, Q, H, Dh]
            tiles = paged_attention_reference(tiles_q, pages.k, pages.v, layer, batch.tile_pages,
                                              batch.tile_positions, block_pages=self.block_pages, **scales)
            out = out.at[batch.tile_token.reshape(-1)].set(tiles.reshape(-1, *q.shape[1:]), mode="drop")
        return out[None], self.replace(pages=pages)


def paged_exact_attention(q: jax.Array, pages: PagedKV, layer, batch: RaggedBatch,
                          kernels: str = "xla") -> jax.Array:
    """Every flat token's attention (q ``[T, H, Dh]``, scaled) over its sequence's pages by
    ``models.exact.attend_tile``, the routine the exact trainer attends packed rows with: the same key
    blocks in the same order, so a token's output has the same bits as in the trainer (``ModelConfig.numerics
    = "exact"``). Each token's page-table row and position come from the single-query row or tile that holds
    it. ``kernels="pallas_triton"``: the same blocks by ``models.exact_kernels.attention``'s kernel, which the
    trainer's packed rows run too (not for FP8 pages: ``exact_kernels.unsupported_reason``). FP8 pages are
    read back by ``quantization.dequantize_kv``, as the exact trainer rounds its keys and values
    (``quantization.straight_through_kv``)."""
    T, max_pages, page_size = q.shape[0], batch.row_pages.shape[1], pages.page_size
    tile_rows = jnp.repeat(batch.tile_pages, batch.tile_token.shape[1], axis=0)
    token_pages = jnp.zeros((T, max_pages), jnp.int32).at[batch.row_token].set(batch.row_pages, mode="drop")
    token_pages = token_pages.at[batch.tile_token.reshape(-1)].set(tile_rows, mode="drop")
    token_pos = jnp.full((T,), -1, jnp.int32).at[batch.row_token].set(batch.row_positions[:, 0], mode="drop")
    token_pos = token_pos.at[batch.tile_token.reshape(-1)].set(batch.tile_positions.reshape(-1), mode="drop")
    if kernels == "pallas_triton":  # the pool flat per kv head; each page-table entry a key-row offset
        K, L, P = pages.k.shape[:3]
        flat = lambda pool: pool.reshape(K, L * P * page_size, -1)
        table = (layer * P + token_pages) * page_size
        return exact_kernels.attention(q, flat(pages.k), flat(pages.v), table, token_pos, page_size)
    num_blocks = (jnp.max(token_pos) + exact.KEY_BLOCK) // exact.KEY_BLOCK
    offsets = jnp.arange(exact.KEY_BLOCK)

    def tile(q, table, pos):
        def key_block(i):
            key_pos = i * exact.KEY_BLOCK + offsets
            ids = table[:, jnp.minimum(key_pos // page_size, max_pages - 1)]  # [R, S]
            # [R, S, K, Dh] values, [R, S, K] scales
            gather = lambda pool: jnp.moveaxis(pool[:, layer, ids, key_pos % page_size], 0, 2)
            if not pages.quantized:
                return gather(pages.k), gather(pages.v)
            return (dequantize_kv(gather(pages.k), gather(pages.k_scale), q.dtype),
                    dequantize_kv(gather(pages.v), gather(pages.v_scale), q.dtype))

        return exact.attend_tile(q, key_block, num_blocks, pos, pages.k.shape[0])

    return exact.tiled_rows(tile, q, token_pages, token_pos)
