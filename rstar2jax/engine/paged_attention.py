"""Paged KV cache and length-bounded attention over it.

The pool holds ``num_pages`` pages of ``page_size`` tokens for every layer: ``k[layer]`` and ``v[layer]`` are
``[num_kv_heads, num_pages, page_size, head_dim]`` (one buffer per layer, so a decode step writes and reads
each layer's pool in place, never a slice copy of a stacked array). A sequence owns a row of a page table:
its token at position ``p`` lives in page ``page_table[p // page_size]`` at offset ``p % page_size``. Page 0
is the *null page*: never allocated, it stands for "no page" in page tables (its content is never read
into an output).

Attention of a query at position ``p`` reads the keys/values at positions ``0..p`` of its own row::

    out = sum_j softmax_j(q . k_j) v_j,   j <= p,

computed block by block over the page table with the online softmax (running max ``m``, normaliser ``l``,
accumulator ``acc``; per block ``m' = max(m, max_j s_j)``, ``l' = l e^{m - m'} + sum_j e^{s_j - m'}``,
``acc' = acc e^{m - m'} + sum_j e^{s_j - m'} v_j``, ``out = acc / l``). The number of blocks is
``ceil((max_b p_b + 1) / block_tokens)``, data, not shape: a step costs the longest sequence in the batch, not
the engine's ``max_len``. :func:`paged_attention_reference` is that loop in plain ``jnp`` (every backend; the
tested ground truth). On CUDA GPUs decode steps (one query per row) use JAX's maintained Pallas/Triton kernel
``jax.experimental.pallas.ops.gpu.paged_attention`` (per row it reads only ``ceil((p + 1) / page_size)``
pages), tested against the reference on CPU in Pallas interpret mode. tokamax 0.0.12 was checked: its
attention API takes a ``PagingInfo`` but every kernel of it raises ``NotImplementedError`` for paging, so it
offers no paged decode kernel to select.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from rstar2jax.models.platform import accelerator

ATTENTION_IMPLS = ("auto", "jnp", "pallas_gpu", "pallas_interpret")
NULL_PAGE = 0


@flax.struct.dataclass
class PagedKV:
    """The page pool: ``k``, ``v``: tuples (one per layer) of ``[num_kv_heads, num_pages, page_size,
    head_dim]`` arrays."""

    k: tuple
    v: tuple

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes_per_page(self) -> int:
        """Bytes one page holds over all layers, keys and values."""
        return sum(a.dtype.itemsize * math.prod(a.shape) for a in self.k + self.v) // self.num_pages


def init_pages(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int,
               dtype) -> PagedKV:
    """An all-zero pool."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    make = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return PagedKV(k=make(), v=make())


def resolve_attention(impl: str) -> str:
    """``"auto"``: ``"pallas_gpu"`` on a CUDA GPU, ``"jnp"`` elsewhere (CPU, ROCm, TPU); others unchanged."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention={impl!r}; expected one of {ATTENTION_IMPLS}")
    if impl != "auto":
        return impl
    return "pallas_gpu" if accelerator() == "cuda" else "jnp"


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                              positions: jax.Array, *, block_pages: int = 16) -> jax.Array:
    """Causal attention of queries at ``positions`` over the pages of their rows (see the module docstring).

    Args:
      q: ``[B, T, H, Dh]`` queries, already scaled.
      k_pages, v_pages: ``[K, P, page_size, Dh]`` one layer's pool; query head ``h`` reads kv head
        ``h // (H // K)``.
      page_table: int32 ``[B, max_pages]``.
      positions: int32 ``[B, T]``: each query's position; -1 for padding (its output is 0).
      block_pages: pages per block of the online softmax.

    Returns:
      ``[B, T, H, Dh]`` in ``q.dtype``. Keys after a row's last query position are never read into the sums
      (values there are zeroed, so stale or poisoned pages beyond a sequence cannot leak in).
    """
    B, T, H, Dh = q.shape
    K, _, page_size, _ = k_pages.shape
    G = H // K
    max_pages = page_table.shape[1]
    block_pages = min(block_pages, max_pages)
    pad = -max_pages % block_pages
    if pad:
        page_table = jnp.pad(page_table, ((0, 0), (0, pad)), constant_values=NULL_PAGE)
    block_tokens = block_pages * page_size
    qg = jnp.transpose(q.reshape(B, T, K, G, Dh), (0, 2, 3, 1, 4))  # [B, K, G, T, Dh]
    last = jnp.max(positions, axis=1)  # [B]: keys past it are read by no query of the row
    num_blocks = (jnp.max(last) + block_tokens) // block_tokens  # 0 when every query is padding
    floor = jnp.finfo(jnp.float32).min

    def body(i, carry):
        m, norm, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(page_table, i * block_pages, block_pages, axis=1)  # [B, bp]
        kb = k_pages[:, ids].reshape(K, B, block_tokens, Dh)
        vb = v_pages[:, ids].reshape(K, B, block_tokens, Dh)
        key_pos = i * block_tokens + jnp.arange(block_tokens)
        vb = jnp.where((key_pos[None, :] <= last[:, None])[None, :, :, None], vb, 0).astype(q.dtype)
        s = jnp.einsum("bkgtd,kbsd->bkgts", qg, kb.astype(q.dtype), preferred_element_type=jnp.float32)
        mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
        s = jnp.where(mask, s, floor)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        norm = norm * correction + jnp.sum(p, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "bkgts,kbsd->bkgtd", p.astype(q.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, norm, acc

    init = (jnp.full((B, K, G, T), floor, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, Dh), jnp.float32))
    _, norm, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, Dh).astype(q.dtype)


def _kernel_blocking(max_pages: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) that divide the page table as the Pallas kernel requires."""
    k_splits = math.gcd(max_pages, 16)
    return k_splits, math.gcd(max_pages // k_splits, 8)


def paged_decode_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                                  positions: jax.Array, *, interpret: bool = False) -> jax.Array:
    """:func:`paged_attention_reference` for one query per row (``T == 1``) with JAX's Pallas GPU kernel.

    Row ``b`` reads the ``ceil((positions[b] + 1) / page_size)`` pages it holds; padding rows (position -1)
    read none and give 0. ``interpret=True`` runs the kernel in the Pallas interpreter (any backend: tests).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as kernel  # GPU-only import chain

    B, T, H, Dh = q.shape
    if T != 1:
        raise ValueError(f"the Pallas paged kernel decodes one query per row, got {T}")
    k_splits, per_block = _kernel_blocking(page_table.shape[1])
    out = kernel.paged_attention(
        q[:, 0], k_pages.astype(q.dtype), v_pages.astype(q.dtype), page_table.astype(jnp.int32),
        (positions[:, 0] + 1).astype(jnp.int32), k_splits=k_splits, pages_per_compute_block=per_block,
        interpret=interpret)
    return out[:, None]


@flax.struct.dataclass
class PagedCacheView:
    """What :func:`rstar2jax.models.forward` takes as its ``cache`` to run on the page pool: the pool, the
    page-table rows of the batch and each token's position (-1: padding, nothing written, output 0).

    ``forward`` calls :meth:`write_and_attend` once per layer (layers unrolled, as the pool is one buffer per
    layer) and returns the view with the updated pool.
    """

    pages: PagedKV
    page_table: jax.Array  # int32 [B, max_pages]
    positions: jax.Array  # int32 [B, T]
    attention: str = flax.struct.field(pytree_node=False, default="jnp")
    block_pages: int = flax.struct.field(pytree_node=False, default=16)

    def write_and_attend(self, layer_index: int, q: jax.Array, k: jax.Array, v: jax.Array):
        """Scatter the batch's keys/values (``[B, T, K, Dh]``) into their pages, then attend (``q``: ``[B, T,
        H, Dh]``, scaled) over each row's pages. Writes to the null page or of padding tokens are dropped."""
        pages = self.pages
        page_size, num_pages = pages.page_size, pages.num_pages
        pos = self.positions
        slot_page = jnp.take_along_axis(self.page_table, jnp.clip(pos // page_size, 0,
                                                                   self.page_table.shape[1] - 1), axis=1)
        # Out of range (num_pages): dropped.
        target = jnp.where((pos >= 0) & (slot_page != NULL_PAGE), slot_page, num_pages)
        offset = pos % page_size
        k_layer, v_layer = pages.k[layer_index], pages.v[layer_index]
        k_layer = k_layer.at[:, target, offset].set(jnp.transpose(k, (2, 0, 1, 3)).astype(k_layer.dtype),
                                                    mode="drop")
        v_layer = v_layer.at[:, target, offset].set(jnp.transpose(v, (2, 0, 1, 3)).astype(v_layer.dtype),
                                                    mode="drop")
        replace = lambda layers, new: layers[:layer_index] + (new,) + layers[layer_index + 1:]
        view = self.replace(pages=PagedKV(k=replace(pages.k, k_layer), v=replace(pages.v, v_layer)))
        if q.shape[1] == 1 and self.attention in ("pallas_gpu", "pallas_interpret"):
            out = paged_decode_attention_pallas(q, k_layer, v_layer, self.page_table, pos,
                                                interpret=self.attention == "pallas_interpret")
        else:
            out = paged_attention_reference(q, k_layer, v_layer, self.page_table, pos,
                                            block_pages=self.block_pages)
        return out, view
