"""The GPU kernels behind the training attention (``models.attention``), each as
``kernel(q, k, v, starts) -> out`` over packed rows (``starts``: ``models.segments.segment_starts``), and
what each needs from the installed packages (:func:`unavailable_reason`: feature detection, nothing
compiled).

- ``pallas_triton``: our Pallas kernels lowered through Triton (``models.flash_attention``);
- ``jax_pallas_mha``: JAX's own Pallas Triton flash attention (``jax.experimental.pallas.ops.gpu.attention``)
  with the segment starts as its segment ids and kv heads repeated;
- ``tokamax``: tokamax's fused kernels (Mosaic GPU, then Triton, then cuDNN), the segments as tokamax's
  ``Mask(k_start=start(t), is_causal=True)``.

Off GPUs the Pallas kernels run in Pallas' interpreter (``models.platform.pallas_interpreted``: the tests).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings

import jax
import jax.numpy as jnp

from rstar2jax.models import flash_attention
from rstar2jax.models.platform import pallas_interpreted
from rstar2jax.models.segments import segment_ends

# tokamax's kernels, tried in order (its public API takes a dense [B, N, T, S] mask only).
_TOKAMAX_KERNELS = ("mosaic_gpu", "triton", "cudnn")
# tokamax's GPU kernels tile the sequence (the Mosaic one in pairs of 64-query blocks): rows are padded to a
# multiple of this and the padding sliced off.
_TOKAMAX_LENGTH_MULTIPLE = 256

# Each kernel pads a row to its tile (padded keys sit after every real query, so causality hides them; a
# padded query starts its own segment at itself, so its row is finite) and slices it off.


def _pad_rows(q, k, v, starts, multiple: int):
    T = q.shape[1]
    pad = -T % multiple
    if not pad:
        return q, k, v, starts
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    own = jnp.broadcast_to(jnp.arange(T, T + pad, dtype=starts.dtype), (starts.shape[0], pad))
    return q, k, v, jnp.concatenate([starts, own], axis=1)


def _pallas_triton_attention(q, k, v, starts, blocks=flash_attention.DEFAULT_BLOCKS):
    T = q.shape[1]
    q, k, v, starts = _pad_rows(q, k, v, starts, blocks.length_multiple)
    out = flash_attention.flash_attention(
        q, k, v, starts, segment_ends(starts), blocks=blocks, interpret=pallas_interpreted()
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
    out = jax_mha.mha(
        q, k, v, starts, sm_scale=1.0, causal=True, block_sizes=blocks, interpret=pallas_interpreted()
    )
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


#: The GPU kernels by name (``models.attention`` dispatches through this table).
GPU_KERNELS = {
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
    raise ValueError(f"{implementation!r} is not a GPU kernel; expected one of {tuple(GPU_KERNELS)}")
