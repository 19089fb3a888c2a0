"""Fixed-tile Pallas kernels for exact numerics (``ModelConfig.numerics="exact"``) on GPUs, lowered through
Triton, with ``models.exact``'s portable XLA programs as the fallback; ``ModelConfig.exact_kernels`` picks.

Why kernels: exact mode makes the engine's log-probs the trainer's by running every token through programs
of fixed shapes. On XLA:CPU a fixed shape is a fixed program; on a GPU XLA also fuses a dot with its
neighbours and autotunes it per compiled module, so the engine's step and the trainer's forward could
reduce one product in different orders. A Pallas kernel is one opaque program whatever surrounds it.

- :func:`row_matmul`: ``x`` ``[R, IN] @ w`` ``[IN, OUT]`` for a tile of :data:`PALLAS_TILE_ROWS` rows, one
  program per block of output columns, the reduction over ``IN`` in blocks of :data:`MATMUL_BLOCK_IN` in
  order into a float32 accumulator (Triton's ``tl.dot`` needs blocks of at least 16: hence a 16-row tile on
  this path, 8 on the XLA one); the output block: the widest of :data:`MATMUL_BLOCK_OUT` that divides
  ``OUT`` (:func:`output_block`), so one weight is always cut alike. Exact mode's projections (q/k/v/o, the
  MLP: :func:`einsum`) and the output head (the logits the engine samples from, and each vocabulary chunk of
  the log-prob: :func:`logits`, :func:`token_logprobs`) run through it, tile by tile.
- :func:`attention`: one program per (query row, query head) reduces over the keys of the row's sequence in
  blocks of ``exact.KEY_BLOCK`` positions, in order, with the online softmax and float32 accumulators, up
  to the row's own position (later keys are masked: their scores dropped and values zeroed, so stale or
  poisoned pages cannot leak in; position -1: a padding row, output 0). Keys are read through a table of
  flat key-row offsets, so the engine's pages and the trainer's packed rows are one kernel.
  :func:`packed_attention` is the trainer's entry (its gradient: the XLA program's, which needs no bits in
  common with anything), ``engine.paged_attention.paged_exact_attention`` the engine's.

The choice (:func:`resolve`, the one function the engine and the trainer ask, so they cannot disagree):
``"auto"`` is ``"pallas_triton"`` on CUDA and ROCm GPUs when JAX has Pallas' Triton backend and the model's
shapes fit the kernels (:func:`unsupported_reason`), ``"xla"`` elsewhere; ``"xla"`` and ``"pallas_triton"``
force one (off GPUs the kernels run in Pallas' interpreter: the CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from rstar2jax.models import exact
from rstar2jax.models.config import FP8, ModelConfig
from rstar2jax.models.flash_attention import FULL_FLOAT32, IMPORT_ERROR
from rstar2jax.models.logprobs import einsum_logits
from rstar2jax.models.platform import accelerator, pallas_interpreted
from rstar2jax.models.segments import segment_starts

if IMPORT_ERROR is None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

#: The row tile of exact numerics on the kernels' path (``exact.TILE_ROWS`` on XLA's): Triton's ``tl.dot``
#: takes no block under 16.
PALLAS_TILE_ROWS = 16
#: :func:`row_matmul`'s reduction block: the input width is summed over in blocks of this many, in order.
MATMUL_BLOCK_IN = 32
#: :func:`row_matmul`'s output blocks, widest first: a weight's is the first that divides its width.
MATMUL_BLOCK_OUT = (128, 64, 32, 16)


def output_block(width: int) -> int | None:
    """The output block of a weight ``width`` columns wide (None: no block of :data:`MATMUL_BLOCK_OUT`
    divides it)."""
    return next((block for block in MATMUL_BLOCK_OUT if width % block == 0), None)


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the kernels cannot run ``config``'s model (None: they can). Triton blocks are powers of two: the
    head dimension must be one (>= 16), every projection's input width a multiple of
    :data:`MATMUL_BLOCK_IN` (hence of 16: an output block), the vocabulary a multiple of 16. They take
    neither FP8 weights nor FP8 KV pages (``config.rollout_precision``)."""
    precision = config.rollout_precision
    if FP8 in (precision.weight_dtype, precision.kv_dtype):
        return "an FP8 rollout (rollout_precision): the kernels take neither FP8 weights nor FP8 pages"
    if IMPORT_ERROR is not None:
        return f"no Pallas Triton backend in this JAX ({IMPORT_ERROR})"
    Dh = config.head_dim
    if Dh < 16 or Dh & (Dh - 1):
        return f"head_dim={Dh} is not a power of two >= 16"
    widths = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
              "num_heads * head_dim": config.num_heads * Dh,
              "num_kv_heads * head_dim": config.num_kv_heads * Dh}
    if output_block(config.vocab_size) is None:
        return f"vocab_size={config.vocab_size} is not a multiple of {MATMUL_BLOCK_OUT[-1]}"
    for name, width in widths.items():
        if width % MATMUL_BLOCK_IN:
            return f"{name}={width} is not a multiple of {MATMUL_BLOCK_IN}"
    return None


def resolve(config: ModelConfig) -> str:
    """The exact-mode kernels that run ``config``'s model here: ``"xla"`` or ``"pallas_triton"``
    (``config.exact_kernels``: ``"auto"`` as the module doc says; a forced ``"pallas_triton"`` whose model
    the kernels cannot run is a ValueError naming why)."""
    why = unsupported_reason(config)
    if config.exact_kernels == "auto":
        return "pallas_triton" if why is None and accelerator() in ("cuda", "rocm") else "xla"
    if config.exact_kernels == "pallas_triton" and why is not None:
        raise ValueError(f"exact_kernels='pallas_triton' cannot run this model: {why}")
    return config.exact_kernels


def tile_rows(kernels: str) -> int:
    """The row tile of ``exact.tiled_rows`` under ``kernels`` (a resolved name)."""
    return PALLAS_TILE_ROWS if kernels == "pallas_triton" else exact.TILE_ROWS


def _dot(a, b, trans_b: bool = False):
    """``a @ b`` (``b.T`` if ``trans_b``) into float32; float32 inputs follow ``jax_default_matmul_precision``
    as XLA's dots do."""
    full = jax.config.jax_default_matmul_precision in FULL_FLOAT32
    return plgpu.dot(a, b, trans_b=trans_b, precision=lax.Precision.HIGHEST if full else None)


def _matmul_kernel(x_ref, w_ref, out_ref, *, blocks: int, transposed: bool):
    def step(i, acc):
        columns = pl.ds(i * MATMUL_BLOCK_IN, MATMUL_BLOCK_IN)
        w = w_ref[:, columns] if transposed else w_ref[columns, :]
        return acc + _dot(x_ref[:, columns], w, trans_b=transposed)

    acc = lax.fori_loop(0, blocks, step, jnp.zeros(out_ref.shape, jnp.float32))
    out_ref[...] = acc.astype(out_ref.dtype)


def row_matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False, out_dtype=None) -> jax.Array:
    """``x`` ``[PALLAS_TILE_ROWS, IN] @ w`` ``[IN, OUT]`` (``transposed``: ``w`` ``[OUT, IN]``, ``x @ w.T``,
    as a tied embedding is laid out) by the fixed-tile kernel (module doc), w cast to x's dtype, the result in
    ``out_dtype`` (default: x's). Its gradient is XLA's products (the trainer's backward needs no bits in
    common with the engine)."""
    (R, IN), (OUT, w_in) = x.shape, (w.shape[::-1] if not transposed else w.shape)
    if R != PALLAS_TILE_ROWS or w_in != IN or IN % MATMUL_BLOCK_IN or output_block(OUT) is None:
        raise ValueError(f"row_matmul: x {x.shape} @ w {w.shape}{'.T' if transposed else ''} does not fit "
                         f"[{PALLAS_TILE_ROWS}, k*{MATMUL_BLOCK_IN}] @ [k*{MATMUL_BLOCK_IN}, "
                         f"m*{MATMUL_BLOCK_OUT[-1]}]")
    return _row_matmul(x, w.astype(x.dtype), transposed, jnp.dtype(out_dtype or x.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _row_matmul(x, w, transposed: bool, out_dtype: str):
    (R, IN), OUT = x.shape, w.shape[0] if transposed else w.shape[1]
    block = output_block(OUT)
    w_spec = (pl.BlockSpec((block, IN), lambda j: (j, 0)) if transposed else
              pl.BlockSpec((IN, block), lambda j: (0, j)))
    return pl.pallas_call(
        functools.partial(_matmul_kernel, blocks=IN // MATMUL_BLOCK_IN, transposed=transposed),
        grid=(OUT // block,),
        in_specs=[pl.BlockSpec((R, IN), lambda j: (0, 0)), w_spec],
        out_specs=pl.BlockSpec((R, block), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((R, OUT), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),  # Triton's (not Mosaic GPU's)
        interpret=pallas_interpreted(),
        name="exact_row_matmul",
    )(x, w)


def _row_matmul_forward(x, w, transposed, out_dtype):
    return _row_matmul(x, w, transposed, out_dtype), (x, w)


def _row_matmul_backward(transposed, out_dtype, residuals, cotangent):
    x, w = residuals
    product = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    d_x = product(cotangent, w if transposed else w.T)
    d_w = product(cotangent.T, x) if transposed else product(x.T, cotangent)
    return d_x.astype(x.dtype), d_w.astype(w.dtype)


_row_matmul.defvjp(_row_matmul_forward, _row_matmul_backward)


def _kernel_logits(h: jax.Array, w: jax.Array, vd: bool) -> jax.Array:
    return row_matmul(h, w, transposed=vd, out_dtype=jnp.float32)


def logits_product(kernels: str):
    """The output head's product of a tile under ``kernels`` (a resolved name): ``logprobs.einsum_logits``
    or the kernel's (``product`` of ``logprobs.token_logprobs_and_entropy``)."""
    return einsum_logits if kernels == "xla" else _kernel_logits


def token_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, head_layout: str, kernels: str,
                   temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``exact.token_logprobs`` under ``kernels`` (a resolved name): its tile and its head product."""
    return exact.token_logprobs(hidden, head, targets, head_layout=head_layout, temperature=temperature,
                                tile=tile_rows(kernels), product=logits_product(kernels))


def logits(hidden: jax.Array, head: jax.Array, head_layout: str, kernels: str) -> jax.Array:
    """``exact.logits`` under ``kernels`` (a resolved name); the kernels read the head cast to the compute
    dtype once."""
    if kernels != "xla":
        head = head.astype(hidden.dtype)
    return exact.logits(hidden, head, head_layout, tile=tile_rows(kernels), product=logits_product(kernels))


def einsum(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` by :func:`row_matmul` for exact mode's projections of one tile (``x``
    ``[1, PALLAS_TILE_ROWS, ...]``): ``spec`` contracts x's trailing axes with w's leading ones
    (``"btd,dhk->bthk"``, ``"bthk,hkd->btd"``, ``"btd,df->btf"``)."""
    inputs, out = spec.replace(" ", "").split("->")
    x_subs, w_subs = inputs.split(",")
    contracted = len(x_subs) - 2
    if x_subs[2:] != w_subs[:contracted] or out != x_subs[:2] + w_subs[contracted:]:
        raise ValueError(f"exact_kernels.einsum: {spec!r} does not contract x's trailing axes with w's "
                         "leading ones")
    rows = x.reshape(x.shape[0] * x.shape[1], -1)
    y = row_matmul(rows, w.reshape(rows.shape[1], -1))
    return y.reshape(*x.shape[:2], *w.shape[contracted:])


def _attention_kernel(pos_ref, table_ref, q_ref, k_ref, v_ref, out_ref, *, entry_size: int):
    """One query row and head: q ``[Dh]``, keys and values ``[M, Dh]`` of its kv head, the row's table of
    flat offsets of its ``entry_size``-position runs of keys."""
    S, (M, Dh) = exact.KEY_BLOCK, k_ref.shape
    pos, width = pos_ref[...], table_ref.shape[0]
    q = q_ref[...].astype(jnp.float32)
    floor = jnp.finfo(jnp.float32).min

    def body(i, carry):
        m, norm, acc = carry
        key_pos = i * S + jnp.arange(S)
        index = table_ref[jnp.minimum(key_pos // entry_size, width - 1)] + key_pos % entry_size
        index = jnp.clip(index, 0, M - 1)
        seen = key_pos <= pos
        k, v = k_ref[index, :].astype(jnp.float32), v_ref[index, :]
        s = jnp.where(seen, jnp.sum(q[None, :] * k, axis=1), floor)
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        v = jnp.where(seen[:, None], v, 0).astype(jnp.float32)
        weighted = p.astype(v_ref.dtype).astype(jnp.float32)[:, None] * v
        return m_new, norm * correction + jnp.sum(p), acc * correction + jnp.sum(weighted, axis=0)

    init = (jnp.float32(floor), jnp.float32(0), jnp.zeros((Dh,), jnp.float32))
    _, norm, acc = lax.fori_loop(0, (pos + S) // S, body, init)
    out_ref[...] = (acc / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)).astype(out_ref.dtype)


def attention(q: jax.Array, keys: jax.Array, values: jax.Array, table: jax.Array, query_pos: jax.Array,
              entry_size: int) -> jax.Array:
    """Exact-mode attention of every row by the kernel (module doc): q ``[N, H, Dh]`` (scaled), keys and
    values ``[K, M, Dh]`` (flat key rows per kv head), ``table`` int ``[N, W]``: row n's key at sequence
    position p is key row ``table[n, p // entry_size] + p % entry_size``; ``query_pos`` ``[N]`` (-1:
    padding). Returns ``[N, H, Dh]`` in q's dtype."""
    N, H, Dh = q.shape
    K, M, _ = keys.shape
    G = H // K
    row = lambda n, h: (n, 0)
    return pl.pallas_call(
        functools.partial(_attention_kernel, entry_size=entry_size),
        grid=(N, H),
        in_specs=[pl.BlockSpec((None,), lambda n, h: (n,)), pl.BlockSpec((None, table.shape[1]), row),
                  pl.BlockSpec((None, None, Dh), lambda n, h: (n, h, 0)),
                  *[pl.BlockSpec((None, M, Dh), lambda n, h: (h // G, 0, 0))] * 2],
        out_specs=pl.BlockSpec((None, None, Dh), lambda n, h: (n, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=pallas_interpreted(),
        name="exact_attention",
    )(query_pos.astype(jnp.int32), table.astype(jnp.int32), q, keys.astype(q.dtype), values.astype(q.dtype))


@jax.custom_vjp
def _packed_attention(q, k, v, segment_ids):
    B, T, H, Dh = q.shape
    N, K = B * T, k.shape[2]
    starts = segment_starts(segment_ids)
    flat_start = jnp.arange(B, dtype=jnp.int32)[:, None] * T + starts
    table = flat_start.reshape(N, 1) + exact.KEY_BLOCK * jnp.arange(-(-T // exact.KEY_BLOCK), dtype=jnp.int32)
    query_pos = (jnp.arange(T, dtype=jnp.int32)[None, :] - starts).reshape(N)
    flat = lambda x: jnp.swapaxes(x.reshape(N, K, Dh), 0, 1)
    out = attention(q.reshape(N, H, Dh), flat(k), flat(v), table, query_pos, exact.KEY_BLOCK)
    return out.reshape(q.shape)


def _packed_attention_forward(q, k, v, segment_ids):
    return _packed_attention(q, k, v, segment_ids), (q, k, v, segment_ids)


def _packed_attention_backward(residuals, cotangent):
    q, k, v, segment_ids = residuals
    _, vjp = jax.vjp(lambda q, k, v: exact.packed_attention(q, k, v, segment_ids), q, k, v)
    return (*vjp(cotangent), None)


_packed_attention.defvjp(_packed_attention_forward, _packed_attention_backward)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
                     kernels: str) -> jax.Array:
    """``exact.packed_attention`` (the trainer's packed rows) by ``kernels`` (a resolved name): the XLA
    program, or :func:`attention`'s kernel forward with the XLA program's gradient."""
    if kernels == "xla":
        return exact.packed_attention(q, k, v, segment_ids)
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    return _packed_attention(q, k, v, segment_ids)
