"""Causal attention: its implementations for training over packed sequences, and the one resolver that
picks an implementation for training and for decoding (the engine's paged KV cache).

``attention(q, k, v, segment_ids, implementation=...)`` computes, for every query position t of a row,

    out_t = sum_{s in A(t)} softmax_s(q_t . k_s) v_s,     A(t) = {s : start(t) <= s <= t}

where ``start(t)`` is the first index of the run of equal segment ids that holds t: a token attends to the
earlier tokens of its own packed sequence only (positions restart per segment in the RoPE angles, which the
caller applies). Segments must therefore be contiguous runs of one id, as ``build_batch`` lays them out;
padding (id 0) at a row's end is a run of its own. Query heads are grouped over kv heads (GQA: head h reads
kv head ``h // (H // K)``); q arrives already multiplied by ``head_dim ** -0.5``; softmax runs in float32.

Implementations: one vocabulary for training and decoding (``models.config.ATTENTION_IMPLEMENTATIONS``;
decoding offers ``DECODE_ATTENTION_IMPLEMENTATIONS``: ``auto``, ``blockwise`` and ``pallas_triton``).
Old names are accepted and mean the same implementation (``models.config.ATTENTION_ALIASES``): ``"xla"`` is
``"dense"``; the engine's ``"jnp"`` is ``"blockwise"``, its ``"pallas_gpu"`` and ``"pallas_interpret"`` are
``"pallas_triton"``.

- ``"dense"``: the dense reference, ``[B, H, T, T]`` scores (memory quadratic in T); training only;
- ``"blockwise"`` (``models.blockwise_attention``): portable online-softmax attention (FlashAttention-2's
  recurrences written with XLA ops, a ``jax.custom_vjp`` whose backward recomputes the scores block by
  block): forward and backward memory linear in T; key blocks before a query block's earliest segment
  start, and after the query block (causal), are skipped, so a row packed with short sequences costs about
  the sum of their squares. Decoding: the engine's online softmax over KV pages in blocks of
  ``EngineConfig.attention_block`` tokens (``engine.paged_attention``);
- ``"pallas_triton"``: Pallas kernels lowered through Triton (NVIDIA and AMD GPUs). Training: the blockwise
  recurrences as fused kernels (``models.flash_attention``): grouped-query heads read in place, the same
  block skipping, no JAX version pin. Decoding: JAX's paged-attention kernel for the decode rows;
- ``"jax_pallas_mha"``: JAX's own Pallas Triton flash attention
  (``jax.experimental.pallas.ops.gpu.attention``, deprecated in JAX 0.11) with the segment starts as its
  segment ids and kv heads repeated; training only;
- ``"tokamax"``: tokamax's fused kernels (Mosaic GPU, then Triton, then cuDNN), NVIDIA GPUs only; the segment
  structure goes in as tokamax's ``Mask(k_start=start(t), is_causal=True)``, which is linear in T too;
  training only;
- ``"auto"`` (:func:`resolve_attention`). Training: on a CUDA or ROCm GPU, the first of
  ``AUTO_CANDIDATES`` that the installed packages offer and that passes an on-device check (:func:`probe`:
  compiled, run and compared with the dense reference, forward and gradient, once per process);
  ``blockwise`` elsewhere, or with a warning when no GPU kernel passes; :func:`auto_choice` says which and
  why. Decoding: ``DECODE_AUTO`` (the Pallas kernel on CUDA GPUs), ``blockwise`` elsewhere.

The GPU kernels' adapters live in ``models.attention_kernels``. Off GPUs the Pallas kernels run in Pallas'
interpreter (slow: for tests); which backend is which is ``models.platform``'s to say.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax.models import flash_attention
from rstar2jax.models.attention_kernels import GPU_KERNELS, unavailable_reason
from rstar2jax.models.blockwise_attention import blockwise_attention
from rstar2jax.models.config import attention_name
from rstar2jax.models.platform import accelerator
from rstar2jax.models.segments import segment_starts

DEFAULT_BLOCK_SIZE = 512


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with an explicit mask, without repeating kv heads.

    q ``[B, T, H, Dh]`` (already scaled), k ``[B, K, S, Dh]``, v ``[B, K, Dh, S]`` (the KV cache's layout),
    mask ``[B, T, S]`` bool; softmax in float32. Every query must see at least one key.
    """
    B, T, H, Dh = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, H // K, Dh)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bkds->btkgd", probs, v)
    return out.reshape(B, T, H, Dh)


def _dense_causal_attention(q, k, v, starts):
    index = jnp.arange(q.shape[1])
    mask = (index[None, None, :] <= index[None, :, None]) & (index[None, None, :] >= starts[:, :, None])
    return dense_attention(q, jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 3, 1)), mask)


# Per accelerator, the kernels "auto" tries, fastest first. tokamax's Mosaic GPU kernel is Hopper's fastest
# where its pinned JAX matches; ours and JAX's are Triton kernels, which run on NVIDIA and AMD GPUs alike.
# cuDNN's fused attention (jax.nn.dot_product_attention(implementation="cudnn")) is not a candidate: its
# public API takes per-row lengths but no segments (JAX 0.10.2 and 0.11), so it cannot hold packed rows.
AUTO_CANDIDATES = {
    "cuda": ("tokamax", "pallas_triton", "jax_pallas_mha"),
    "rocm": ("pallas_triton", "jax_pallas_mha"),
}
# The on-device check: a small packed batch (segments of 100, 150 and 70 tokens; one of 320) against the dense
# reference in float32, forward and gradient; relative L2 error allowed per compute dtype (float32: TF32
# inputs, or full float32 where jax_default_matmul_precision asks for it, as the tests do).
_PROBE_SEGMENTS = ((100, 150, 70), (320,))
_PROBE_TOLERANCE = {"bfloat16": 3e-2, "float16": 1e-2, "float32": 5e-3, "float32_full": 1e-4}


def _probe_inputs(head_dim: int, dtype: str, heads: int = 4, kv_heads: int = 2):
    rng = np.random.default_rng(0)
    rows, length = len(_PROBE_SEGMENTS), sum(_PROBE_SEGMENTS[0])
    segment_ids = np.stack([np.repeat(np.arange(1, len(s) + 1), s) for s in _PROBE_SEGMENTS]).astype(np.int32)
    q = rng.normal(size=(rows, length, heads, head_dim)) * head_dim**-0.5
    k, v = (rng.normal(size=(rows, length, kv_heads, head_dim)) for _ in range(2))
    cotangent = rng.normal(size=q.shape)
    return [jnp.asarray(x, dtype) for x in (q, k, v, cotangent)], segment_ids


def probe(implementation: str, head_dim: int = 128, dtype: str = "bfloat16") -> str | None:
    """Compiles and runs ``implementation`` on the default device at a small packed shape, forward and
    gradient, against the dense reference in float32: None when it matches, else what went wrong.

    Runs in a thread of its own: "auto" is first resolved while the training step is being traced, and JAX's
    trace state is per thread, so there the check still runs on the device instead of being staged into
    the step (with the caller's matmul precision, also a per-thread setting)."""
    precision = jax.config.jax_default_matmul_precision
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="attention-probe") as pool:
        return pool.submit(_probe, implementation, head_dim, dtype, precision).result()


def _probe(implementation: str, head_dim: int, dtype: str, precision: str | None) -> str | None:
    with jax.default_matmul_precision(precision):
        return _check_against_dense(implementation, head_dim, dtype)


def _check_against_dense(implementation: str, head_dim: int, dtype: str) -> str | None:
    (q, k, v, cotangent), segment_ids = _probe_inputs(head_dim, dtype)
    full = dtype == "float32" and jax.config.jax_default_matmul_precision in flash_attention.FULL_FLOAT32
    tolerance = _PROBE_TOLERANCE["float32_full" if full else dtype]

    def value_and_grads(name, q, k, v, cotangent):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids, implementation=name), q, k, v)
        return (out, *vjp(cotangent))

    try:
        got = jax.device_get(jax.jit(functools.partial(value_and_grads, implementation))(q, k, v, cotangent))
    except Exception as error:  # noqa: BLE001 (any failure to trace, lower, compile or run is a "no")
        return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    upcast = [x.astype(jnp.float32) for x in (q, k, v, cotangent)]
    expected = jax.device_get(jax.jit(functools.partial(value_and_grads, "dense"))(*upcast))
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, expected, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        error = np.linalg.norm(a - b) / np.linalg.norm(b)
        if not np.isfinite(error) or error > tolerance:
            return f"{name} differs from the dense reference: relative error {error:.2e}"
    return None


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``"auto"`` stands for here: ``implementation``, ``reason`` (one line), and each kernel tried
    before it with why it was passed over (``rejected``: ``(name, why)`` pairs)."""

    implementation: str
    reason: str
    rejected: tuple[tuple[str, str], ...] = ()


# Cached for the process: the choice depends only on the device, the installed packages and the arguments,
# none of which change within a process; a second run in it reuses the device check's verdict.
@functools.cache
def _auto_choice(platform: str, head_dim: int, dtype: str, precision: str | None) -> AutoChoice:
    del precision  # part of the cache key: what the device check requires of float32 depends on it
    candidates = AUTO_CANDIDATES.get(platform, ())
    if not candidates:
        return AutoChoice("blockwise", f"no GPU kernel on {platform}: the portable blockwise XLA attention")
    rejected = []
    for name in candidates:
        why = unavailable_reason(name, head_dim) or probe(name, head_dim, dtype)
        if why is None:
            return AutoChoice(
                name,
                f"{platform}: {name} passed its on-device check (forward and gradient of a packed "
                f"{dtype} batch, head dimension {head_dim}, against the dense reference)",
                tuple(rejected),
            )
        rejected.append((name, why))
    summary = "; ".join(f"{name}: {why}" for name, why in rejected)
    warnings.warn(
        f"attention 'auto' on {platform}: no GPU kernel works here ({summary}); using the slower blockwise "
        "XLA attention",
        RuntimeWarning,
        stacklevel=3,
    )
    return AutoChoice("blockwise", f"{platform}: no GPU kernel passed its check: the blockwise fallback",
                      tuple(rejected))


def auto_choice(head_dim: int = 128, dtype: str = "bfloat16") -> AutoChoice:
    """What ``"auto"`` picks on the default backend for this head dimension and compute dtype, and why.

    CPU and TPU: ``blockwise``. CUDA / ROCm GPUs: the first of ``AUTO_CANDIDATES[accelerator]`` that the
    installed packages offer (:func:`unavailable_reason`) and that passes :func:`probe` on the device (once
    per process, head dimension, dtype and matmul precision); ``blockwise`` with a warning when none does.
    """
    precision = jax.config.jax_default_matmul_precision
    return _auto_choice(accelerator(), head_dim, jnp.dtype(dtype).name, precision)


# Per accelerator, what "auto" decodes with: JAX's paged-attention Pallas kernel on CUDA GPUs (its ROCm
# lowering is not tried); the portable blockwise attention over pages elsewhere.
DECODE_AUTO = {"cuda": "pallas_triton"}


def resolve_attention(
    implementation: str, *, use: str = "training", head_dim: int = 128, dtype: str = "bfloat16"
) -> str:
    """The one attention resolver: the implementation that runs for ``use`` (``"training"``: packed rows,
    :func:`attention`; ``"decoding"``: the engine's paged KV cache) on the default backend. A name of the
    vocabulary is returned as it is, an old name as its new one; ``"auto"`` resolves as the module doc says
    (training: :func:`auto_choice` for ``head_dim`` and the compute ``dtype``). A name ``use`` lacks is a
    ValueError naming what it accepts."""
    implementation = attention_name(implementation, use)
    if implementation != "auto":
        return implementation
    if use == "decoding":
        return DECODE_AUTO.get(accelerator(), "blockwise")
    return auto_choice(head_dim, dtype).implementation


def resolve_implementation(implementation: str, head_dim: int = 128, dtype: str = "bfloat16") -> str:
    """:func:`resolve_attention` for training (its earlier name)."""
    return resolve_attention(implementation, use="training", head_dim=head_dim, dtype=dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    implementation: str = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> jax.Array:
    """Causal attention within packed segments (see the module doc).

    Args:
      q: ``[B, T, H, Dh]`` queries, already scaled by ``Dh ** -0.5``.
      k, v: ``[B, T, K, Dh]`` keys and values; ``H`` a multiple of ``K``.
      segment_ids: int ``[B, T]``, contiguous runs of one id per packed sequence; ``None``: one sequence.
      implementation: one of ``models.config.ATTENTION_IMPLEMENTATIONS`` (or an old name, see the module
        doc).
      block_size: query/key block of ``"blockwise"`` (rounded down to the sequence for short rows).

    Returns:
      ``[B, T, H, Dh]`` in q's dtype.
    """
    B, T, H, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D or H % k.shape[2]:
        raise ValueError(f"attention shapes q {q.shape}, k {k.shape}, v {v.shape} do not fit [B, T, H|K, Dh]")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids shape {segment_ids.shape} must be {(B, T)}")
    if block_size <= 0 or block_size % 8:
        raise ValueError(f"block_size must be a positive multiple of 8, got {block_size}")
    if segment_ids is None:
        starts = jnp.zeros((B, T), jnp.int32)
    else:
        starts = segment_starts(segment_ids)
    requested = attention_name(implementation)
    implementation = resolve_attention(requested, head_dim=D, dtype=q.dtype)
    if implementation == "dense":
        return _dense_causal_attention(q, k, v, starts)
    if implementation in GPU_KERNELS:
        try:
            return GPU_KERNELS[implementation](q, k, v, starts).astype(q.dtype)
        except Exception as error:  # noqa: BLE001 (any failure of a GPU kernel while tracing)
            if requested != "auto":
                raise
            # "auto" checked the kernel on this device at one shape; should these shapes fail to trace, it
            # keeps the portable path, saying so.
            warnings.warn(
                f"attention 'auto': {implementation} failed ({type(error).__name__}: {str(error)[:200]}); "
                "using 'blockwise'",
                RuntimeWarning,
                stacklevel=2,
            )
    return blockwise_attention(q, k, v, starts, block_size)
