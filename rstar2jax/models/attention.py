"""Causal self-attention over packed sequences for training: one API, several implementations.

``attention(q, k, v, segment_ids, implementation=...)`` computes, for every query position t of a row,

    out_t = sum_{s in A(t)} softmax_s(q_t . k_s) v_s,     A(t) = {s : start(t) <= s <= t}

where ``start(t)`` is the first index of the run of equal segment ids that holds t: a token attends to the
earlier tokens of its own packed sequence only (positions restart per segment in the RoPE angles, which the
caller applies). Segments must therefore be contiguous runs of one id, as ``build_batch`` lays them out;
padding (id 0) at a row's end is a run of its own. Query heads are grouped over kv heads (GQA: head h reads
kv head ``h // (H // K)``); q arrives already multiplied by ``head_dim ** -0.5``; softmax runs in float32.

Implementations (``IMPLEMENTATIONS``):

- ``"xla"``: the dense reference, ``[B, H, T, T]`` scores (memory quadratic in T);
- ``"blockwise"`` (``models.blockwise_attention``): portable online-softmax attention (FlashAttention-2's
  recurrences written with XLA ops, a ``jax.custom_vjp`` whose backward recomputes the scores block by
  block): forward and backward memory linear in T; key blocks before a query block's earliest segment
  start, and after the query block (causal), are skipped, so a row packed with short sequences costs about
  the sum of their squares;
- ``"pallas_triton"``: the same recurrences as fused Pallas kernels lowered through Triton
  (``models.flash_attention``; NVIDIA and AMD GPUs): grouped-query heads read in place, the same block
  skipping, no JAX version pin;
- ``"jax_pallas_mha"``: JAX's own Pallas Triton flash attention
  (``jax.experimental.pallas.ops.gpu.attention``, deprecated in JAX 0.11) with the segment starts as its
  segment ids and kv heads repeated;
- ``"tokamax"``: tokamax's fused kernels (Mosaic GPU, then Triton, then cuDNN), NVIDIA GPUs only; the segment
  structure goes in as tokamax's ``Mask(k_start=start(t), is_causal=True)``, which is linear in T too;
- ``"auto"``: on a CUDA or ROCm GPU, the first of ``AUTO_CANDIDATES`` that the installed packages offer and
  that passes an on-device check (:func:`probe`: compiled, run and compared with the dense reference,
  forward and gradient, once per process); ``blockwise`` elsewhere, or with a warning when no GPU kernel
  passes. :func:`auto_choice` says which and why.

On a backend without a GPU, ``"pallas_triton"`` and ``"jax_pallas_mha"`` run in Pallas' interpreter (slow:
for tests).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from rstar2jax.models import flash_attention
from rstar2jax.models.blockwise_attention import blockwise_attention
from rstar2jax.models.config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS
from rstar2jax.models.platform import accelerator

DEFAULT_BLOCK_SIZE = 512
# tokamax's kernels, tried in order (its public API takes a dense [B, N, T, S] mask only).
_TOKAMAX_KERNELS = ("mosaic_gpu", "triton", "cudnn")
# tokamax's GPU kernels tile the sequence (the Mosaic one in pairs of 64-query blocks): rows are padded to a
# multiple of this and the padding sliced off.
_TOKAMAX_LENGTH_MULTIPLE = 256


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """``start(t)``: int32 ``[B, T]`` index of the first token of the run of equal ids holding t."""
    T = segment_ids.shape[-1]
    index = jnp.arange(T, dtype=jnp.int32)
    changed = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return jax.lax.cummax(jnp.where(changed, index, 0), axis=1)


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


def _xla_attention(q, k, v, starts):
    index = jnp.arange(q.shape[1])
    mask = (index[None, None, :] <= index[None, :, None]) & (index[None, None, :] >= starts[:, :, None])
    return dense_attention(q, jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 3, 1)), mask)


# ---------------------------------------------------------------------------------------------------------
# GPU kernels. Each pads a row to its kernels' tile (padded keys sit after every real query, so causality
# hides them; a padded query starts its own segment at itself, so its row is finite) and slices it off.


def _pad_rows(q, k, v, starts, multiple: int):
    T = q.shape[1]
    pad = -T % multiple
    if not pad:
        return q, k, v, starts
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    own = jnp.broadcast_to(jnp.arange(T, T + pad, dtype=starts.dtype), (starts.shape[0], pad))
    return q, k, v, jnp.concatenate([starts, own], axis=1)


def segment_ends(starts: jax.Array) -> jax.Array:
    """int32 ``[B, T]``: the last index of the segment holding t, from :func:`segment_starts`' output."""
    T = starts.shape[-1]
    return T - 1 - segment_starts(starts[:, ::-1])[:, ::-1]


def _interpret() -> bool:
    """Pallas' interpreter off GPUs (the CPU tests), its Triton lowering on them."""
    return accelerator() not in ("cuda", "rocm")


def _pallas_triton_attention(q, k, v, starts, blocks=flash_attention.DEFAULT_BLOCKS):
    T = q.shape[1]
    q, k, v, starts = _pad_rows(q, k, v, starts, blocks.length_multiple)
    out = flash_attention.flash_attention(
        q, k, v, starts, segment_ends(starts), blocks=blocks, interpret=_interpret()
    )
    return out[:, :T]


def _jax_mha_module():
    """``jax.experimental.pallas.ops.gpu.attention`` (JAX 0.11 deprecates it in favour of tokamax)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as jax_mha  # noqa: PLC0415
    return jax_mha


# JAX's kernel tiles: the fused backward needs as many dQ query blocks as dK/dV key blocks.
_JAX_MHA_BLOCK = 64


def _jax_pallas_mha_attention(q, k, v, starts):
    jax_mha = _jax_mha_module()
    T, H = q.shape[1:3]
    q, k, v, starts = _pad_rows(q, k, v, starts, 2 * _JAX_MHA_BLOCK)
    # Its kernel has no grouped-query layout: kv heads are repeated (their gradients summed back by
    # jnp.repeat's transpose). Segment ids are the starts themselves, unique per segment.
    groups = H // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    block = _JAX_MHA_BLOCK
    blocks = jax_mha.BlockSizes(
        block_q=2 * block, block_k=block, block_q_dkv=block, block_kv_dkv=block, block_q_dq=block,
        block_kv_dq=block,
    )
    out = jax_mha.mha(q, k, v, starts, sm_scale=1.0, causal=True, block_sizes=blocks, interpret=_interpret())
    return out[:, :T]


_ABSL_FLAGS_LOCK = threading.RLock()  # one scope at a time: a trace on another thread must not end it early


@contextlib.contextmanager
def _absl_flags_marked_parsed():
    """tokamax reads its options from absl flags, and while ``absl.flags.FLAGS`` is unparsed it parses
    ``sys.argv`` to get them: a host program's own command line, which may not be absl's (pytest's, a
    notebook kernel's). Inside this scope FLAGS count as parsed, so tokamax sees its options' defaults;
    leaving it unparses them again if they were, so the host program finds FLAGS as it left them (values
    untouched, still to be parsed)."""
    from absl import flags  # noqa: PLC0415

    with _ABSL_FLAGS_LOCK:
        if flags.FLAGS.is_parsed():
            yield
            return
        flags.FLAGS.mark_as_parsed()
        try:
            yield
        finally:
            # absl's unparse_flags() would also reset values a host program set; this undoes only the mark.
            vars(flags.FLAGS)["__flags_parsed"] = False


def _tokamax_attention(q, k, v, starts, kernels=_TOKAMAX_KERNELS):
    """tokamax's attention, its forward and its backward each traced with absl flags marked parsed (see
    :func:`_absl_flags_marked_parsed`): the backward is traced after this function returns, hence the
    custom VJP that re-enters the scope."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def call(q, k, v, starts, kernels):
        with _absl_flags_marked_parsed():
            return _tokamax_call(q, k, v, starts, kernels)

    def forward(q, k, v, starts, kernels):
        with _absl_flags_marked_parsed():
            out, pullback = jax.vjp(lambda q, k, v: _tokamax_call(q, k, v, starts, kernels), q, k, v)
        return out, pullback

    def backward(kernels, pullback, cotangent):
        with _absl_flags_marked_parsed():
            return (*pullback(cotangent), None)

    call.defvjp(forward, backward)
    return call(q, k, v, starts, kernels)


def _tokamax_call(q, k, v, starts, kernels):
    from tokamax._src.ops.attention import api, base  # noqa: PLC0415 (optional, GPU-only dependency)

    T = q.shape[1]
    q, k, v, starts = _pad_rows(q, k, v, starts, _TOKAMAX_LENGTH_MULTIPLE)
    mask = base.Mask(k_start=starts[:, None, :], is_causal=True)
    errors = []
    for name in kernels:
        if name not in api.IMPLEMENTATIONS:
            continue
        try:
            out = api.IMPLEMENTATIONS[name](
                q,
                k,
                v,
                bias=None,
                mask=mask,
                logits_scale=1.0,
                precision=None,
                logits_soft_cap=None,
                q_sharding=None,
            )
        except NotImplementedError as e:
            errors.append(f"{name}: {e}")
        else:
            return out[:, :T]
    raise NotImplementedError(f"no tokamax attention kernel accepts these inputs: {errors}")


_GPU_KERNELS = {
    "tokamax": _tokamax_attention,
    "pallas_triton": _pallas_triton_attention,
    "jax_pallas_mha": _jax_pallas_mha_attention,
}


def unavailable_reason(implementation: str, head_dim: int = 128) -> str | None:
    """Why a GPU kernel cannot run with the installed packages (feature detection, nothing compiled); None
    when it can be tried."""
    if implementation == "tokamax":
        try:
            from tokamax._src.ops.attention import api, base  # noqa: F401, PLC0415
        except ImportError as error:
            return f"tokamax is not importable ({error})"
        return None
    if implementation == "pallas_triton":
        if flash_attention.IMPORT_ERROR:
            return f"this JAX has no Pallas Triton backend ({flash_attention.IMPORT_ERROR})"
        if not flash_attention.head_dim_supported(head_dim):
            return f"head dimension {head_dim} is not a power of two in [16, 256]"
        return None
    if implementation == "jax_pallas_mha":
        try:
            jax_mha = _jax_mha_module()
        except ImportError as error:
            return f"this JAX has no jax.experimental.pallas.ops.gpu.attention ({error})"
        parameters = inspect.signature(jax_mha.mha).parameters
        missing = [n for n in ("segment_ids", "causal", "block_sizes", "interpret") if n not in parameters]
        if missing:
            return f"jax.experimental.pallas.ops.gpu.attention.mha lacks {missing}"
        return None
    raise ValueError(f"{implementation!r} is not a GPU kernel; expected one of {tuple(_GPU_KERNELS)}")


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
    expected = jax.device_get(jax.jit(functools.partial(value_and_grads, "xla"))(*upcast))
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


def resolve_implementation(implementation: str, head_dim: int = 128, dtype: str = "bfloat16") -> str:
    """The implementation ``"auto"`` stands for on the default backend (others are returned unchanged)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r}; expected one of {IMPLEMENTATIONS}")
    if implementation != "auto":
        return implementation
    return auto_choice(head_dim, dtype).implementation


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
      implementation: one of ``IMPLEMENTATIONS``.
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
    requested, implementation = implementation, resolve_implementation(implementation, D, q.dtype)
    if implementation == "xla":
        return _xla_attention(q, k, v, starts)
    if implementation in _GPU_KERNELS:
        try:
            return _GPU_KERNELS[implementation](q, k, v, starts).astype(q.dtype)
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
